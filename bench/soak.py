"""Soak: mixed load for a while with random denoiser kills and restarts (`make soak`, not part of make test).

Reports requests, successes, failures by reason, and the RSS over time of every process; fails if any request
is lost (no answer, or an answer with the wrong number of images). Run: .venv/bin/python -m bench.soak
"""
from __future__ import annotations

import argparse
import collections
import random
import signal
import tempfile
import threading
import time
from pathlib import Path

import grpc

from bench.common import write_result
from glmimage.v1 import gateway_service_pb2 as pb
from glmimage.v1 import gateway_service_pb2_grpc
from services.model.tiny import ensure_tiny_checkpoint
from tests.cluster import Cluster

DENOISERS = 3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--kill-every", type=float, default=30.0, help="mean seconds between denoiser kills")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    ensure_tiny_checkpoint()
    cluster = Cluster(Path(tempfile.mkdtemp(prefix="soak-")))
    cluster.start("ar", "ar")
    for i in range(DENOISERS):
        cluster.start(f"d{i}", "denoiser")
    cluster.start("gateway", "gateway", ["--ar", cluster.procs["ar"].address, "--request-timeout", "120",
                                         *[f"--denoiser={cluster.procs[f'd{i}'].address}" for i in range(DENOISERS)]])
    stop = threading.Event()
    counts: collections.Counter[str] = collections.Counter()
    lock = threading.Lock()
    rss: list[dict[str, float]] = []
    kills = 0

    def client(k: int) -> None:
        crng = random.Random(args.seed * 1000 + k)
        stub = gateway_service_pb2_grpc.GatewayServiceStub(grpc.insecure_channel(cluster.procs["gateway"].address))
        while not stop.is_set():
            n, size = crng.choice([1, 1, 2, 3]), crng.choice([64, 128])
            try:
                resp = stub.GenerateImages(pb.GenerateImagesRequest(prompt="soak", n=n, height=size, width=size,
                                                                    seed=crng.randrange(2**31)), timeout=150)
                outcome = "ok" if len(resp.images) == n else "lost"
            except grpc.RpcError as err:
                outcome = "lost" if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED else err.code().name
            with lock:
                counts["requests"] += 1
                counts[outcome] += 1

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(args.clients)]
    for t in threads:
        t.start()
    t0 = time.monotonic()
    next_kill = t0 + rng.expovariate(1 / args.kill_every)
    next_sample = t0
    try:
        while time.monotonic() - t0 < args.duration:
            now = time.monotonic()
            if now >= next_sample:
                rss.append({"t": round(now - t0, 1),
                            **{name: p.rss() / 2**20 for name, p in cluster.procs.items() if p.popen.poll() is None}})
                next_sample = now + 5
            if now >= next_kill:
                victim = f"d{rng.randrange(DENOISERS)}"
                cluster.kill(victim, signal.SIGKILL)
                kills += 1
                time.sleep(rng.uniform(0.5, 3.0))  # stay down a while, as a crashed pod would
                cluster.restart(victim)
                next_kill = time.monotonic() + rng.expovariate(1 / args.kill_every)
            time.sleep(0.2)
    finally:
        stop.set()
        for t in threads:
            t.join(200)
        cluster.close()
    failures = {k: v for k, v in counts.items() if k not in ("requests", "ok")}
    result = {"duration_s": args.duration, "clients": args.clients, "denoiser_kills": kills,
              "requests": counts["requests"], "successes": counts["ok"], "failures_by_reason": failures,
              "lost": counts["lost"], "rss_mib_over_time": rss}
    write_result("soak", result, command=f".venv/bin/python -m bench.soak --duration {args.duration:g}")
    print(f"requests {counts['requests']}, ok {counts['ok']}, failures {failures}, kills {kills}")
    if counts["lost"]:
        raise SystemExit(f"{counts['lost']} request(s) lost")


if __name__ == "__main__":
    main()
