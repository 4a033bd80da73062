"""Edits of 1 to 16 large references mixed with text-to-image, on default timeout settings: every request must
succeed and no healthy worker may be marked suspect.

The real AR, two denoisers and a gateway (default flags) as processes on the tiny model; CLIENTS concurrent clients
each send a shuffled mix of plain requests and edits whose references are 4096x4096 PNGs (about 58 KB each, every
limit respected). Afterwards the gateway's log is read for sidelined workers and calls that overran.

    python -m bench.edit_soak [--requests 24] [--clients 3]     # bench/results/edit_soak.json
"""
from __future__ import annotations

import argparse
import random
import tempfile
import threading
import time
from pathlib import Path

import grpc

from bench.common import median, write_result
from glmimage.v1 import common_pb2
from glmimage.v1 import gateway_service_pb2 as pb
from glmimage.v1 import gateway_service_pb2_grpc as pb_grpc
from tests.support.cluster import Cluster
from tests.support.images import image_file

REFERENCE = image_file((4096, 4096), color=(120, 80, 200))
MIX = (0, 0, 1, 0, 4, 0, 8, 16)  # references per request; 0: text-to-image


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--clients", type=int, default=3)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    plan = [MIX[i % len(MIX)] for i in range(args.requests)]
    rng.shuffle(plan)
    work = Path(tempfile.mkdtemp(prefix="edit-soak-"))
    procs = Cluster(work)
    outcomes: list[tuple[int, str, float]] = []  # references, status code name, seconds
    lock = threading.Lock()
    try:
        ar = procs.start("ar", "ar")
        dens = [procs.start(f"d{i}", "denoiser", ["--default-steps", "2"]) for i in range(2)]
        flags = ["--ar", ar.address, *(f for d in dens for f in ("--denoiser", d.address))]
        gw = procs.start("gateway", "gateway", flags)

        def client() -> None:
            with grpc.insecure_channel(gw.address) as channel:
                stub = pb_grpc.GatewayServiceStub(channel)
                while True:
                    with lock:
                        if not plan:
                            return
                        refs = plan.pop()
                    request = pb.GenerateImagesRequest(
                        prompt="a cat", height=64, width=64, num_inference_steps=2,
                        reference_images=[common_pb2.ReferenceImage(data=REFERENCE) for _ in range(refs)])
                    started = time.monotonic()
                    try:
                        stub.GenerateImages(request, timeout=900)
                        code = "OK"
                    except grpc.RpcError as err:
                        code = err.code().name
                    with lock:
                        outcomes.append((refs, code, time.monotonic() - started))

        started = time.monotonic()
        threads = [threading.Thread(target=client) for _ in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.monotonic() - started
        log = (work / "gateway.log").read_text()
    finally:
        procs.close()
    by_refs: dict[str, dict[str, object]] = {}
    for refs in sorted({r for r, _, _ in outcomes}):
        mine = [(c, s) for r, c, s in outcomes if r == refs]
        by_refs[str(refs)] = {"requests": len(mine), "ok": sum(c == "OK" for c, _ in mine),
                              "median_s": round(median([s for _, s in mine]), 2)}
    result = {"requests": len(outcomes), "clients": args.clients, "seconds": round(elapsed, 1),
              "ok": sum(c == "OK" for _, c, _ in outcomes), "by_references": by_refs,
              "suspect_lines": log.count("is suspect"), "overruns": log.count("failed after"),
              "slow_job_lines": log.count("a slow job, not a sick worker")}
    print(result)
    write_result("edit_soak", result, f"python -m bench.edit_soak --requests {args.requests} "
                                      f"--clients {args.clients}")


if __name__ == "__main__":
    main()
