"""Connection settings of every gRPC hop (runtime.keepalive), and what they are for, with real processes:

- idle, then a burst: bursts separated by idle gaps longer than every keepalive interval all succeed, and no server
  ever counts a ping strike (a server left at grpc's 5-minute minimum ping interval counts every keepalive ping
  as a strike and answers GOAWAY "too_many_pings" under the next burst);
- after a gateway restart the REST front and the SDK are served again, and no request meanwhile is answered
  "connection refused" (gRPC's default reconnect backoff leaves that answer standing for 8-13 s). How soon after
  the gateway's SERVING is a figure for bench/reconnect.py (medians over restarts); here the bound only has to
  fail a client that never comes back, and the reconnect backoff itself is pinned by the settings checks below.
"""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from glmimage import AsyncClient, Client, GlmImageError, RetryPolicy
from runtime import keepalive
from tests.support.cluster import Cluster
from tests.support.reconnect import restart_gateway

PROMPT = 'idle "then" busy'
SIZE = "64x64"
BURST = 4  # concurrent requests per burst, half through REST, half through the SDK (a connection each way)
KEEPALIVE_S = keepalive.KEEPALIVE_TIME_MS / 1000
# Idle gaps between the bursts, each longer than every keepalive interval in play. The first is also longer than
# three client pings: a server at grpc's default ping policy answers the third ping since it last sent data GOAWAY.
IDLE_GAPS_S = (3 * KEEPALIVE_S + 2, KEEPALIVE_S + 2)
# Longest silence allowed between two pings on a connection: a keepalive period plus its timeout.
MAX_PING_SILENCE_MS = keepalive.KEEPALIVE_TIME_MS + keepalive.KEEPALIVE_TIMEOUT_MS
# Server-side ping traces: "SERVER[0x...]: received ping <id>: now=@<ms>ms ... next_allowed_ping=@<ms>ms ..."
TRACE_ENV = {"GRPC_TRACE": "http_keepalive", "GRPC_VERBOSITY": "debug"}
_PING = re.compile(r"SERVER\[(\w+)\]: received ping \d+: now=@(\d+)ms transport_idle=\d "
                   r"next_allowed_ping=@(\S+?)(?:ms)? ping_strikes=(\d+)")
# A gateway down for some seconds, as a rescheduled pod is. gRPC's default reconnect backoff (1 s, x1.6, +-20%)
# makes its attempts about 1, 2.6, 5.2, 9.3 (+-1.9) and 15.8 (+-2.5) s after the first failure, so a gateway back
# after ~11-12 s would be reached only 2-6 s after it is serving.
OUTAGE_S = 10.8
# Served again within this of SERVING: 3x and more the slowest seen with both cores of a 2-core machine busy
# (7.2 s over 10 restarts, one 64x64 generation of about 2 s included); how soon they are back: bench/reconnect.py.
BACK_WITHIN_S = 30.0
SDK_NO_RETRY = RetryPolicy(max_attempts=1)  # a failure must show, not be retried away


# ---- fast checks on the settings themselves -----------------------------------------------------------------------

HOPS = ("gateway -> workers", "REST -> gateway", "SDK -> gateway", "SDK asyncio -> gateway")
DEAD = "127.0.0.1:1"  # channels connect lazily: nothing needs to listen


def _hops() -> dict[str, dict[str, Any]]:
    """What each hop really hands grpc for its channel, recorded at grpc's own constructors (later arguments
    override earlier ones there, as in a dict)."""
    from gateway.workers import CHANNEL_OPTIONS
    from rest.settings import RestSettings
    from rest.upstream import open_gateway
    from runtime.tls import make_channel

    seen: list[dict[str, Any]] = []

    def recording(real: Callable[..., Any]) -> Callable[..., Any]:
        def channel(target: str, options: Any = None, **kwargs: Any) -> Any:
            seen.append(dict(options or ()))
            return real(target, options=options, **kwargs)
        return channel

    async def open_every_hop() -> None:  # in HOPS order
        await make_channel(DEAD, None, CHANNEL_OPTIONS).close()
        await open_gateway(RestSettings(gateway_address=DEAD), None).channel.close()
        Client(DEAD).close()
        await AsyncClient(DEAD).close()

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(grpc, "insecure_channel", recording(grpc.insecure_channel))
        mp.setattr(grpc.aio, "insecure_channel", recording(grpc.aio.insecure_channel))
        asyncio.run(open_every_hop())
    assert len(seen) == len(HOPS)
    return dict(zip(HOPS, seen, strict=True))


def _server() -> dict[str, int]:
    from runtime.server import server_options

    return dict(server_options(64 << 20, 64 << 20))


@pytest.mark.parametrize("hop", HOPS)
def test_servers_accept_every_clients_keepalive(hop: str) -> None:
    client, server = _hops()[hop], _server()
    interval = server["grpc.http2.min_ping_interval_without_data_ms"]
    # Well below: a ping that fires late by up to half a period, or follows a BDP ping, is still not early.
    assert 2 * interval <= client["grpc.keepalive_time_ms"], (hop, interval, client)
    assert client["grpc.keepalive_timeout_ms"] < client["grpc.keepalive_time_ms"]
    assert client["grpc.keepalive_permit_without_calls"] == 1 and server["grpc.keepalive_permit_without_calls"] == 1
    # Without this grpc throttles a client to one ping a minute after two pings with no data of its own.
    assert client["grpc.http2.max_pings_without_data"] == 0
    assert server["grpc.http2.max_ping_strikes"] >= 1  # a client pinging too often is still cut off
    assert client["grpc.max_reconnect_backoff_ms"] <= 1_000
    assert client["grpc.initial_reconnect_backoff_ms"] <= 100


def test_every_channel_argument_is_one_grpc_reads() -> None:
    """grpc silently ignores an argument it does not know: the servers' ping interval was such a misspelling.
    Every key must be a string in grpc core itself."""
    core = Path(grpc._cython.cygrpc.__file__).read_bytes()
    keys = {key for options in [*_hops().values(), _server()] for key in options}
    assert len(keys) >= 10
    unknown = sorted(k for k in keys if k.encode() + b"\0" not in core)
    assert not unknown, f"not grpc channel arguments: {unknown}"


def test_sdk_imports_no_server_module() -> None:
    """The SDK and protocol package are the base install: the client keepalive lives there (glmimage.wire.keepalive)
    and the servers import it from there, never the other way round."""
    code = ("import sys, glmimage, glmimage.cli; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('services', 'gateway', 'rest', 'runtime')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", f"the SDK imported server modules: {done.stdout}"


# ---- real processes -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    c = Cluster(tmp_path_factory.mktemp("keepalive"))
    try:
        for name, role in (("ar", "ar"), ("d0", "denoiser"), ("d1", "denoiser")):
            c.start(name, role, wait=False, env=TRACE_ENV)
        for name in ("ar", "d0", "d1"):
            c.wait_ready(name)
        c.start("gateway", "gateway", ["--ar", c.procs["ar"].address, "--denoiser", c.procs["d0"].address,
                                       "--denoiser", c.procs["d1"].address, "--request-timeout", "60"],
                env=TRACE_ENV)
        c.start("rest", "rest", ["--gateway-address", c.procs["gateway"].address])  # waits for /health
        yield c
    finally:
        c.close()


def _offsets(cluster: Cluster) -> dict[str, int]:
    return {name: p.log.stat().st_size for name, p in cluster.procs.items() if p.log}


def _since(cluster: Cluster, offsets: dict[str, int], name: str) -> str:
    with open(cluster.procs[name].log, "rb") as f:
        f.seek(offsets.get(name, 0))
        return f.read().decode(errors="replace")


def _burst(cluster: Cluster, sdk: Client, http: httpx.Client, seed: int) -> list[str]:
    """BURST concurrent generations, half through REST and half through the SDK; returns the failures."""
    rest = f"http://{cluster.procs['rest'].address}/v1/images/generations"

    def via_rest(i: int) -> str | None:
        r = http.post(rest, json={"prompt": PROMPT, "n": 1, "size": SIZE, "seed": seed + i}, timeout=60)
        if r.status_code != 200 or len(r.json()["data"]) != 1:
            return f"REST {r.status_code}: {r.text[:300]}"
        return None

    def via_sdk(i: int) -> str | None:
        try:
            result = sdk.generate(PROMPT, n=1 + i % 2, size=SIZE, seed=seed + i, timeout=60)
        except GlmImageError as exc:
            return f"SDK {exc}"
        return None if len(result.images) == 1 + i % 2 else f"SDK: {len(result.images)} image(s)"

    with cf.ThreadPoolExecutor(BURST) as pool:
        futures = [pool.submit(via_rest if i % 2 else via_sdk, i) for i in range(BURST)]
        return [f for f in (fut.result() for fut in futures) if f]


def _pings(log: str) -> dict[str, list[tuple[int, str, int]]]:
    """Per server-side connection: (now ms, next allowed ping, strikes) of every ping it received."""
    out: dict[str, list[tuple[int, str, int]]] = {}
    for conn, now, allowed, strikes in _PING.findall(log):
        out.setdefault(conn, []).append((int(now), allowed, int(strikes)))
    return out


@pytest.mark.chaos
def test_bursts_after_idle_gaps_all_succeed_without_ping_strikes(cluster: Cluster) -> None:
    offsets = _offsets(cluster)
    sdk = Client(cluster.procs["gateway"].address, retry=SDK_NO_RETRY, timeout=60)
    failures: dict[int, list[str]] = {}
    try:
        with httpx.Client() as http:
            for cycle, gap in enumerate((0, *IDLE_GAPS_S)):
                time.sleep(gap)  # the idle period is the point of the test
                failures[cycle] = _burst(cluster, sdk, http, seed=100 * cycle)
    finally:
        sdk.close()
    logs = {name: _since(cluster, offsets, name) for name in cluster.procs}
    assert not any(failures.values()), f"failed requests by burst: {failures}"
    for name, log in logs.items():
        assert "too_many_pings" not in log and "ENHANCE_YOUR_CALM" not in log, f"{name} saw GOAWAY too_many_pings"
    unreachable = [line for line in logs["gateway"].splitlines()
                   if re.search(r"is unreachable|is suspect", line)]
    assert not unreachable, unreachable

    # Every server: no ping was early (a strike), and the connections that lived through the gaps kept pinging at
    # the keepalive period (with grpc's pings-without-data cap they fell back to one ping a minute).
    idle_ms = sum(IDLE_GAPS_S) * 1000
    for name, log in logs.items():
        if name == "rest":
            continue  # not a gRPC server
        conns = _pings(log)
        early = [(conn, p) for conn, pings in conns.items() for p in pings
                 if p[1] not in ("-∞", "-inf") and int(p[1]) > p[0]]
        assert not early, f"{name} counted ping strikes: {early[:5]}"
        kept_alive = [conn for conn, pings in conns.items()
                      if pings[-1][0] - pings[0][0] >= 0.9 * idle_ms
                      and max(b[0] - a[0] for a, b in zip(pings, pings[1:], strict=False)) <= MAX_PING_SILENCE_MS]
        # Workers: the gateway's connection; the gateway: the REST front's and the SDK's.
        want = 2 if name == "gateway" else 1
        assert len(kept_alive) >= want, (
            f"{name}: {len(kept_alive)} connection(s) pinged through the idle gaps, want {want}; pings per "
            f"connection (ms): { {c: [p[0] for p in ps] for c, ps in conns.items()} }")


@pytest.mark.chaos
def test_rest_and_sdk_are_back_after_a_restarted_gateway(cluster: Cluster) -> None:
    sdk = Client(cluster.procs["gateway"].address, retry=SDK_NO_RETRY, timeout=30)
    try:
        with httpx.Client(timeout=30) as http:
            back = restart_gateway(cluster, http, sdk, OUTAGE_S, give_up_s=BACK_WITHIN_S).back
    finally:
        sdk.close()
    assert back.rest_s <= BACK_WITHIN_S, f"REST not served {BACK_WITHIN_S:.0f}s after SERVING: {back.rest_answers}"
    assert back.sdk_s <= BACK_WITHIN_S, f"the SDK not served {BACK_WITHIN_S:.0f}s after the gateway was SERVING"
    # A request that found the channel still reconnecting waited for it instead of answering "connection refused"
    # (a 503 of the gateway's own, before it has seen its workers, is another matter).
    refused = [a for a in back.rest_answers if a[1] != 200 and "failed to connect" in a[2].lower()]
    assert not refused, refused
