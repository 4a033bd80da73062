"""Gateway + REST front overhead with zero-cost backends (`make bench`, gateway part).

Runs four processes: the zero-cost AR and denoisers (bench.zero_cost_backends), the real gateway
(`python -m gateway`), the real REST front (`python -m rest`), and this one as the load generator.
Each round sends the same request three ways, side by side, in rotating order:

- `rest`: POST /v1/images/generations with an async httpx-API client (httpx2, the httpx fork the openai SDK uses:
  httpx 0.28's connection pool costs ~6 ms of client CPU per request at concurrency 32, which on two cores made
  the load generator, not the server, the bottleneck);
- `rest_raw`: the same POST over a minimal keep-alive HTTP/1.1 client, which isolates the server-side cost;
- `grpc`: GatewayService.GenerateImages called directly (grpc.aio).

The REST front's added latency is `rest` minus `grpc` at the same percentile (and `rest_raw` minus `grpc`).
Reported values are medians over the rounds; the CPU each process spends per request is reported too, since on
a shared machine it, not the wall clock, says what a free core would give. Writes bench/results/gateway.json.

    .venv/bin/python -m bench.gateway [--rounds 5]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx2
import psutil

from bench.common import median, percentile, write_result
from glmimage.v1 import common_pb2, gateway_service_pb2, gateway_service_pb2_grpc

log = logging.getLogger("bench.gateway")

REPO = Path(__file__).resolve().parents[1]
PROMPT = "a red fox in the snow"
WIDTH = HEIGHT = 64
PATH = "/v1/images/generations"
TARGETS = {"p50_added_ms_c1_max": 5.0, "rps_c32_min": 300.0, "gateway_peak_rss_mb_max": 150.0}
STARTUP_TIMEOUT_S = 60.0
CONCURRENCY = (1, 32)


@dataclass
class Proc:
    name: str
    pid: int
    popen: subprocess.Popen | None = None  # None: this process
    rss_samples: list[int] = field(default_factory=list)

    def peak_rss_mb(self) -> float:
        """The kernel's high-water mark (VmHWM) when readable, else the highest sample."""
        try:
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            pass
        return max(self.rss_samples, default=0) / 2**20

    def cpu_seconds(self) -> float:
        times = psutil.Process(self.pid).cpu_times()
        return times.user + times.system

    def loaded_torch(self) -> bool:
        """True if any torch shared object is mapped into the process (importing torch maps libtorch)."""
        maps = Path(f"/proc/{self.pid}/maps").read_text()
        return "libtorch" in maps or "/torch/" in maps


def _spawn(name: str, argv: list[str], log_dir: Path) -> Proc:
    out = (log_dir / f"{name}.log").open("w")
    popen = subprocess.Popen([sys.executable, *argv], cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    return Proc(name, popen.pid, popen)


async def _wait_file(path: Path, proc: Proc, deadline: float) -> str:
    assert proc.popen is not None
    while not path.exists():
        if proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.name} exited with code {proc.popen.returncode} during start-up")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{proc.name} did not start within {STARTUP_TIMEOUT_S:.0f}s")
        await asyncio.sleep(0.05)
    return path.read_text().strip()


async def _wait_healthy(http: httpx2.AsyncClient, deadline: float) -> None:
    while True:
        try:
            if (await http.get("/health")).status_code == 200:
                return
        except httpx2.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("the REST front did not report healthy in time")
        await asyncio.sleep(0.05)


class RawHttpClient:
    """Keep-alive HTTP/1.1 POSTs of one fixed body over a pool of connections; just enough to read a response."""

    def __init__(self, host: str, port: int, body: bytes) -> None:
        self.host, self.port = host, port
        self.request = (f"POST {PATH} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                        f"Content-Length: {len(body)}\r\n\r\n").encode() + body
        self.pool: asyncio.Queue[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = asyncio.Queue()

    async def open(self, connections: int) -> None:
        for _ in range(connections):
            self.pool.put_nowait(await asyncio.open_connection(self.host, self.port))

    async def _exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
        writer.write(self.request)
        return await reader.readuntil(b"\r\n\r\n")

    async def post(self) -> None:
        reader, writer = await self.pool.get()
        try:
            try:
                head = await self._exchange(reader, writer)
            except (asyncio.IncompleteReadError, ConnectionError):
                # The server closes connections left idle past its keep-alive timeout (while other paths ran).
                writer.close()
                reader, writer = await asyncio.open_connection(self.host, self.port)
                head = await self._exchange(reader, writer)
            status, *headers = head.split(b"\r\n")
            length = next(int(h.split(b":", 1)[1]) for h in headers if h.lower().startswith(b"content-length:"))
            body = await reader.readexactly(length)
            if b" 200 " not in status:
                raise RuntimeError(f"REST answered {status!r}: {body[:200]!r}")
        finally:
            self.pool.put_nowait((reader, writer))

    async def close(self) -> None:
        while not self.pool.empty():
            _, writer = self.pool.get_nowait()
            writer.close()
            await writer.wait_closed()


async def _run_load(call: Callable[[], Awaitable[None]], concurrency: int, total: int) -> tuple[list[float], float]:
    """`total` calls spread over `concurrency` workers; returns per-call latencies (s) and the wall time."""
    latencies: list[float] = []
    remaining = total

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            t0 = time.perf_counter()
            await call()
            latencies.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies, time.perf_counter() - t0


async def _sample_rss(procs: list[Proc], stop: asyncio.Event) -> None:
    handles = [(p, psutil.Process(p.pid)) for p in procs]
    while not stop.is_set():
        for proc, handle in handles:
            proc.rss_samples.append(handle.memory_info().rss)
        try:
            await asyncio.wait_for(stop.wait(), 0.1)
        except TimeoutError:
            pass


async def _start_servers(args: argparse.Namespace, work: Path, procs: list[Proc]) -> tuple[Proc, Proc, str, str]:
    """Backends, gateway and REST, each waited for; appended to `procs` as they start so the caller can stop them."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    ready = work / "backends.json"
    procs.append(_spawn("backends", ["-m", "bench.zero_cost_backends", "--denoisers", str(args.denoisers),
                                     "--ready-file", str(ready)], work))
    backends = json.loads(await _wait_file(ready, procs[-1], deadline))
    port_file = work / "gateway.port"
    gateway = _spawn("gateway", ["-m", "gateway", "--port", "0", "--port-file", str(port_file),
                                 "--ar", backends["ar"], *(f"--denoiser={d}" for d in backends["denoisers"]),
                                 "--log-level", "WARNING", *args.gateway_arg], work)
    procs.append(gateway)
    gateway_address = f"127.0.0.1:{await _wait_file(port_file, gateway, deadline)}"
    port_file = work / "rest.port"
    rest = _spawn("rest", ["-m", "rest", "--port", "0", "--port-file", str(port_file),
                           "--gateway-address", gateway_address, "--log-level", "warning", *args.rest_arg], work)
    procs.append(rest)
    return gateway, rest, gateway_address, f"127.0.0.1:{await _wait_file(port_file, rest, deadline)}"


def _summarise(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for c in (f"c{n}" for n in CONCURRENCY):
        cell: dict[str, float] = {}
        for key in rounds[0][c]:
            if isinstance(rounds[0][c][key], dict):
                for sub in rounds[0][c][key]:
                    cell[f"{key}_{sub}"] = median([r[c][key][sub] for r in rounds])
            else:
                cell[key] = median([r[c][key] for r in rounds])
        summary[c] = cell
    return summary


async def _bench(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    procs: list[Proc] = []
    load_at_start = os.getloadavg()
    try:
        gateway, rest, gateway_address, rest_address = await _start_servers(args, work, procs)
        me, backends = Proc("loadgen", os.getpid()), procs[0]
        host, port = rest_address.split(":")
        body = {"prompt": PROMPT, "size": f"{WIDTH}x{HEIGHT}"}
        raw = RawHttpClient(host, int(port), json.dumps(body).encode())
        limits = httpx2.Limits(max_connections=64, max_keepalive_connections=64)
        async with httpx2.AsyncClient(base_url=f"http://{rest_address}", limits=limits, timeout=60) as http, \
                grpc.aio.insecure_channel(gateway_address) as channel:
            await _wait_healthy(http, time.monotonic() + STARTUP_TIMEOUT_S)
            await raw.open(max(CONCURRENCY))
            stub = gateway_service_pb2_grpc.GatewayServiceStub(channel)
            grpc_request = gateway_service_pb2.GenerateImagesRequest(
                prompt=PROMPT, n=1, width=WIDTH, height=HEIGHT, output_format=common_pb2.IMAGE_FORMAT_PNG)

            async def rest_httpx() -> None:
                resp = await http.post(PATH, json=body)
                if resp.status_code != 200:
                    raise RuntimeError(f"REST answered {resp.status_code}: {resp.text[:200]}")

            async def grpc_direct() -> None:
                await stub.GenerateImages(grpc_request, timeout=60)

            paths: dict[str, Callable[[], Awaitable[None]]] = {
                "rest": rest_httpx, "rest_raw": raw.post, "grpc": grpc_direct}
            stop = asyncio.Event()
            sampler = asyncio.create_task(_sample_rss([gateway, rest], stop))
            for call in paths.values():  # warm-up: connections, lazy imports, allocator pools
                await _run_load(call, 8, args.warmup)

            rounds: list[dict[str, Any]] = []
            names = list(paths)
            for r in range(args.rounds):
                row: dict[str, Any] = {}
                for concurrency in CONCURRENCY:
                    total = args.requests_c1 if concurrency == 1 else args.requests_c32
                    cell: dict[str, Any] = {}
                    # Rotate the order so that drift in the machine's load favours no path.
                    for name in names[r % len(names):] + names[:r % len(names)]:
                        before = {p.name: p.cpu_seconds() for p in (me, rest, gateway, backends)}
                        latencies, wall = await _run_load(paths[name], concurrency, total)
                        cell[name] = {
                            "p50_ms": percentile(latencies, 0.5) * 1000,
                            "p99_ms": percentile(latencies, 0.99) * 1000,
                            "rps": total / wall,
                            **{f"cpu_ms_{p.name}": (p.cpu_seconds() - before[p.name]) * 1000 / total
                               for p in (me, rest, gateway, backends) if p is not rest or name != "grpc"},
                        }
                    for name in ("rest", "rest_raw"):
                        cell[f"{name}_added_p50_ms"] = cell[name]["p50_ms"] - cell["grpc"]["p50_ms"]
                        cell[f"{name}_added_p99_ms"] = cell[name]["p99_ms"] - cell["grpc"]["p99_ms"]
                    row[f"c{concurrency}"] = cell
                rounds.append(row)
                print(f"round {r + 1}/{args.rounds}: c1 added p50 {row['c1']['rest_added_p50_ms']:.2f} ms "
                      f"(raw client {row['c1']['rest_raw_added_p50_ms']:.2f}), c32 REST {row['c32']['rest']['rps']:.0f}"
                      f" req/s (raw client {row['c32']['rest_raw']['rps']:.0f}), gRPC {row['c32']['grpc']['rps']:.0f}")
            stop.set()
            await sampler
            await raw.close()

        summary = _summarise(rounds)
        processes = {p.name: {"peak_rss_mb": round(p.peak_rss_mb(), 1), "torch_loaded": p.loaded_torch()}
                     for p in (gateway, rest)}
        checks = {
            "p50_added_ms_c1": summary["c1"]["rest_added_p50_ms"] <= TARGETS["p50_added_ms_c1_max"],
            "rps_c32": summary["c32"]["rest_rps"] >= TARGETS["rps_c32_min"],
            "gateway_peak_rss_mb": processes["gateway"]["peak_rss_mb"] < TARGETS["gateway_peak_rss_mb_max"],
            "no_torch": not any(p["torch_loaded"] for p in processes.values()),
        }
        return {
            "config": {"rounds": args.rounds, "requests_c1": args.requests_c1, "requests_c32": args.requests_c32,
                       "warmup": args.warmup, "denoisers": args.denoisers, "size": f"{WIDTH}x{HEIGHT}",
                       "gateway_args": args.gateway_arg, "rest_args": args.rest_arg,
                       "load_average_at_start": load_at_start},
            "summary": summary, "processes": processes, "targets": TARGETS, "meets_targets": checks,
            "load_average_at_end": os.getloadavg(), "rounds": rounds,
        }
    finally:
        children = [p.popen for p in procs if p.popen is not None]
        for child in reversed(children):
            if child.poll() is None:
                child.terminate()
        for child in children:
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--requests-c1", type=int, default=300, help="requests per path per round at concurrency 1")
    p.add_argument("--requests-c32", type=int, default=1500, help="requests per path per round at concurrency 32")
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--denoisers", type=int, default=4)
    p.add_argument("--gateway-arg", action="append", default=[], help="extra flag for the gateway (repeatable)")
    p.add_argument("--rest-arg", action="append", default=[], help="extra flag for the REST front (repeatable)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="bench-gateway-") as tmp:
        result = asyncio.run(_bench(args, Path(tmp)))
    print(json.dumps({k: result[k] for k in ("summary", "processes", "meets_targets")}, indent=2))
    write_result("gateway", result, "python -m bench.gateway " + " ".join(argv if argv is not None else sys.argv[1:]))


if __name__ == "__main__":
    main()
