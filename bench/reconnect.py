"""How soon the REST front and the SDK are served again after a gateway restart (`make bench`, reconnect part).

Real processes on loopback and the tiny model (an AR, two denoisers, a gateway, a REST front), as in
tests/test_keepalive.py: the gateway is SIGKILLed, stays down for `--outage` seconds (long enough that gRPC's
default reconnect backoff would leave the clients waiting seconds past the gateway's return), is restarted on its
port; from its SERVING both clients try at once, every 50 ms, until served. Repeated `--restarts` times on the same
clients; reports the medians and the range of the seconds from SERVING to the first served request, and of the same
two requests on the live gateway just before each kill (one 64x64 generation: on a busy machine it is most of the
figure). The test only checks that both come back; this is the figure. Writes bench/results/reconnect.json.

    .venv/bin/python -m bench.reconnect [--restarts 5] [--outage 10.8]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import httpx

from bench.common import median, write_result
from glmimage import Client, RetryPolicy
from services.model.tiny import ensure_tiny_checkpoint
from tests.support.cluster import Cluster
from tests.support.reconnect import restart_gateway


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--restarts", type=int, default=5)
    p.add_argument("--outage", type=float, default=10.8, help="seconds the gateway stays down each time")
    args = p.parse_args(argv)
    ensure_tiny_checkpoint()
    cluster = Cluster(Path(tempfile.mkdtemp(prefix="reconnect-")))
    runs = []
    load_before = os.getloadavg()
    try:
        for name, role in (("ar", "ar"), ("d0", "denoiser"), ("d1", "denoiser")):
            cluster.start(name, role, wait=False)
        for name in ("ar", "d0", "d1"):
            cluster.wait_ready(name)
        cluster.start("gateway", "gateway", ["--ar", cluster.procs["ar"].address, "--request-timeout", "60",
                                             *[f"--denoiser={cluster.procs[d].address}" for d in ("d0", "d1")]])
        cluster.start("rest", "rest", ["--gateway-address", cluster.procs["gateway"].address])
        # No retries: a retry would hide the first failures behind its own backoff.
        with Client(cluster.procs["gateway"].address, retry=RetryPolicy(max_attempts=1), timeout=30) as sdk, \
                httpx.Client(timeout=30) as http:
            for i in range(args.restarts):
                r = restart_gateway(cluster, http, sdk, args.outage)
                runs.append({"rest_s": round(r.back.rest_s, 3), "sdk_s": round(r.back.sdk_s, 3),
                             "rest_tries": len(r.back.rest_answers), "warm_rest_s": round(r.warm.rest_s, 3),
                             "warm_sdk_s": round(r.warm.sdk_s, 3)})
                print(f"restart {i + 1}: after SERVING REST served in {r.back.rest_s:.2f} s, SDK {r.back.sdk_s:.2f} s;"
                      f" before the kill {r.warm.rest_s:.2f} s and {r.warm.sdk_s:.2f} s")
    finally:
        cluster.close()

    def summary(key: str) -> dict[str, float]:
        values = [r[key] for r in runs]
        return {"median": round(median(values), 3), "min": min(values), "max": max(values)}

    result = {key: summary(key) for key in ("rest_s", "sdk_s", "warm_rest_s", "warm_sdk_s")}
    write_result("reconnect", {
        "setup": {"restarts": args.restarts, "outage_s": args.outage, "poll_s": 0.05,
                  "processes": "AR, 2 denoisers, gateway, REST front; tiny model, 1 torch thread each",
                  "load_average_1m_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)]},
        "runs": runs, "seconds_after_serving": result,
    }, command=" ".join(["python -m bench.reconnect", *(sys.argv[1:] if argv is None else argv)]))
    for key, label in (("rest_s", "REST"), ("sdk_s", "SDK")):
        r, w = result[key], result[f"warm_{key}"]
        print(f"{label}: median {r['median']:.2f} s after SERVING ({r['min']:.2f}-{r['max']:.2f}); the same request "
              f"on the live gateway {w['median']:.2f} s ({w['min']:.2f}-{w['max']:.2f})")


if __name__ == "__main__":
    main()
