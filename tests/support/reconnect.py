"""A gateway killed and restarted on its port, and the seconds from its SERVING until the REST front and the SDK are
each served again. tests/test_keepalive.py checks that both come back; bench/reconnect.py reports how fast
(medians over several restarts): a fixed bound on one run's figure is a coin toss on a shared machine.
"""
from __future__ import annotations

import concurrent.futures as cf
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import httpx

from glmimage import Client, GlmImageError
from tests.support.cluster import Cluster, wait_serving

PROMPT = "back after a restart"
SIZE = "64x64"
BODY = {"prompt": PROMPT, "n": 1, "size": SIZE}
POLL_S = 0.05


@dataclass
class Back:
    """Seconds from a start until the first served request of each client (inf: not within give_up_s)."""

    rest_s: float
    sdk_s: float
    rest_answers: list[tuple[float, int, str]] = field(default_factory=list)  # (seconds, status, body) per try


@dataclass
class Restart:
    back: Back  # timed from the restarted gateway's SERVING
    # The same, on the live gateway just before the kill: what one request takes anyway (a generation, on a busy
    # machine most of the figure above).
    warm: Back


def restart_gateway(cluster: Cluster, http: httpx.Client, sdk: Client, outage_s: float,
                    give_up_s: float = 60.0) -> Restart:
    """Both clients served, the gateway SIGKILLed, both see it gone, `outage_s` of outage, the gateway restarted;
    then both clients try at once (each every POLL_S) until served. `sdk` must not retry: a failure must show."""
    warm = _until_served(cluster, http, sdk, time.monotonic(), give_up_s)
    assert warm.rest_s < give_up_s and warm.sdk_s < give_up_s, f"not served before the restart: {warm}"
    cluster.kill("gateway", signal.SIGKILL)
    # Both see it gone; from here their channels retry in the background with their reconnect backoff.
    gone = http.post(_rest_url(cluster), json=BODY)
    assert gone.status_code == 503, (gone.status_code, gone.text[:300])
    try:
        sdk.generate(PROMPT, size=SIZE)
        raise AssertionError("the SDK was served by a killed gateway")
    except GlmImageError as err:
        assert err.code == grpc.StatusCode.UNAVAILABLE, err
    time.sleep(outage_s)  # the outage is the point: the channels are deep in their reconnect backoff
    cluster.restart("gateway", wait=False)
    wait_serving(cluster.procs["gateway"].address, "glmimage.v1.GatewayService", timeout=120)
    return Restart(_until_served(cluster, http, sdk, time.monotonic(), give_up_s), warm)


def _rest_url(cluster: Cluster) -> str:
    return f"http://{cluster.procs['rest'].address}/v1/images/generations"


def _until_served(cluster: Cluster, http: httpx.Client, sdk: Client, t0: float, give_up_s: float) -> Back:
    """Both clients at once, each trying every POLL_S until served; seconds counted from t0."""
    rest = _rest_url(cluster)
    back = Back(float("inf"), float("inf"))

    def rest_ok() -> bool:
        r = http.post(rest, json=BODY)
        back.rest_answers.append((time.monotonic() - t0, r.status_code, r.text[:300]))
        return r.status_code == 200

    def sdk_ok() -> bool:
        try:
            sdk.generate(PROMPT, size=SIZE)
            return True
        except GlmImageError:
            return False

    def seconds_to_success(call: Callable[[], bool]) -> float:
        while not call():
            if time.monotonic() - t0 > give_up_s:
                return float("inf")
            time.sleep(POLL_S)
        return time.monotonic() - t0

    with cf.ThreadPoolExecutor(2) as pool:
        back.rest_s, back.sdk_s = pool.map(seconds_to_success, (rest_ok, sdk_ok))
    return back
