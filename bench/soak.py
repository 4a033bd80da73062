"""Soak: mixed load for a while with random denoiser kills and restarts (`make soak`, not part of make test).

The load comes in busy stretches (`--busy` seconds) separated by idle gaps (`--idle-gap` seconds, longer than
every keepalive interval: runtime.keepalive), so that connections sit idle and are then hit by a burst of
every client at once, as in production between peaks. Requests started within AFTER_GAP_S of a gap's end are
counted separately; no denoiser is killed during a gap or that window, so any failure there is the idle gap's.

Reports requests, successes, failures by reason (overall and right after idle gaps), and the RSS over time of
every process; fails if any request is lost (no answer, or an answer with the wrong number of images) or any
request right after an idle gap fails. Run: .venv/bin/python -m bench.soak
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
from tests.support.cluster import Cluster

DENOISERS = 3
AFTER_GAP_S = 5.0  # requests started this soon after an idle gap are "right after" it


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--kill-every", type=float, default=30.0, help="mean seconds between denoiser kills")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--busy", type=float, default=90.0, help="seconds of load between idle gaps")
    parser.add_argument("--idle-gap", type=float, default=35.0,
                        help="seconds without any request after each busy stretch (0: none); longer than every "
                             "keepalive interval, so idle connections are exercised")
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
    busy = threading.Event()  # cleared during idle gaps: clients wait, sending nothing
    busy.set()
    counts: collections.Counter[str] = collections.Counter()
    after_gap: collections.Counter[str] = collections.Counter()
    lock = threading.Lock()
    rss: list[dict[str, float]] = []
    kills = 0
    gaps = 0
    gap_ended = float("-inf")  # monotonic time the last idle gap ended
    inflight = 0

    def client(k: int) -> None:
        nonlocal inflight
        crng = random.Random(args.seed * 1000 + k)
        stub = gateway_service_pb2_grpc.GatewayServiceStub(grpc.insecure_channel(cluster.procs["gateway"].address))
        while not stop.is_set():
            with lock:  # with busy.clear() under the same lock: no request starts once a gap has begun
                sending = busy.is_set()
                if sending:
                    inflight += 1
            if not sending:
                busy.wait(1.0)
                continue
            n, size = crng.choice([1, 1, 2, 3]), crng.choice([64, 128])
            started = time.monotonic()
            try:
                resp = stub.GenerateImages(pb.GenerateImagesRequest(prompt="soak", n=n, height=size, width=size,
                                                                    seed=crng.randrange(2**31)), timeout=150)
                outcome = "ok" if len(resp.images) == n else "lost"
            except grpc.RpcError as err:
                outcome = "lost" if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED else err.code().name
            with lock:
                inflight -= 1
                counts["requests"] += 1
                counts[outcome] += 1
                if started - gap_ended < AFTER_GAP_S:
                    after_gap["requests"] += 1
                    after_gap[outcome] += 1

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(args.clients)]
    for t in threads:
        t.start()
    t0 = time.monotonic()
    next_kill = t0 + rng.expovariate(1 / args.kill_every)
    next_sample = t0
    next_gap = t0 + args.busy if args.idle_gap > 0 else float("inf")

    def sample(now: float) -> None:
        nonlocal next_sample
        if now >= next_sample:
            rss.append({"t": round(now - t0, 1),
                        **{name: p.rss() / 2**20 for name, p in cluster.procs.items() if p.popen.poll() is None}})
            next_sample = now + 5

    try:
        while time.monotonic() - t0 < args.duration:
            now = time.monotonic()
            sample(now)
            if now >= next_gap:
                with lock:
                    busy.clear()
                gaps += 1
                while inflight:  # the gap starts once the stretch's last requests have finished
                    time.sleep(0.1)
                idle_until = time.monotonic() + args.idle_gap
                while time.monotonic() < idle_until:  # idle: no request, no kill
                    sample(time.monotonic())
                    time.sleep(0.2)
                with lock:
                    gap_ended = time.monotonic()
                busy.set()  # every client at once: a burst onto connections that sat idle
                next_gap = gap_ended + args.busy
                next_kill = max(next_kill, gap_ended + AFTER_GAP_S)  # nor in the burst right after it
                continue
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
    gap_failures = {k: v for k, v in after_gap.items() if k not in ("requests", "ok")}
    result = {"duration_s": args.duration, "clients": args.clients, "denoiser_kills": kills,
              "busy_s": args.busy, "idle_gap_s": args.idle_gap, "idle_gaps": gaps,
              "requests": counts["requests"], "successes": counts["ok"], "failures_by_reason": failures,
              "lost": counts["lost"],
              "after_idle_gap": {"window_s": AFTER_GAP_S, "requests": after_gap["requests"],
                                 "successes": after_gap["ok"], "failures_by_reason": gap_failures},
              "rss_mib_over_time": rss}
    command = (f".venv/bin/python -m bench.soak --duration {args.duration:g} --busy {args.busy:g} "
               f"--idle-gap {args.idle_gap:g}")
    write_result("soak", result, command=command)
    print(f"requests {counts['requests']}, ok {counts['ok']}, failures {failures}, kills {kills}; "
          f"{gaps} idle gap(s) of {args.idle_gap:g} s: {after_gap['requests']} request(s) right after them, "
          f"failures {gap_failures}")
    lost_after_gaps = sum(gap_failures.values())
    if counts["lost"] or lost_after_gaps:
        raise SystemExit(f"{counts['lost']} request(s) lost; {lost_after_gaps} failed right after an idle gap")


if __name__ == "__main__":
    main()
