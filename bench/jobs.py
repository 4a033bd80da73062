"""Jobs (issue 31): what a job costs over the synchronous call, and how fast the stores hand jobs out.

`python -m bench.jobs` (from the repo root), two parts:

- ``stack``: a real launcher stack on loopback with the tiny model (an AR, two denoisers, a gateway, the REST front,
  the embedded SQLite job store). The same 256x256 requests, alternately as a synchronous call and as a job
  (`Prefer: respond-async`, then GET every 50 ms until completed, as a client would poll), side by side; per kind the
  median and p95 seconds from the POST to the images, the median ratio job / sync, and the 202's own latency (the
  job written to the store before it is answered). The job's figure includes up to one poll interval and one
  runner poll (``--job-poll``, 0.5 s by default; a submit wakes the runner of the gateway that took it, so that
  one is rarely waited for).
- ``store``: the store alone, SQLite (a file) and PostgreSQL (a real server from Debian's package, when installed),
  no gateway: ``--jobs`` inserts, then ``--runners`` concurrent runners (asyncio tasks, each its own store
  connection) claim, renew once and finish until none is left; jobs per second end to end, and the median and p95
  of one insert and of one claim. Every job must end exactly once (checked).

Writes bench/results/jobs.json.

    .venv/bin/python -m bench.jobs [--requests 12] [--jobs 400] [--runners 4]
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.common import median, percentile, write_result
from gateway.jobs.model import COMPLETED, NewJob, Outcome, new_job_id
from gateway.jobs.store import JobStore, open_store
from glmimage.v1 import gateway_service_pb2
from services.model.tiny import ensure_tiny_checkpoint
from tests.support.jobs_stack import launcher_argv, running
from tests.support.net import free_port

POLL_S = 0.05


def _stats(values: list[float]) -> dict[str, float]:
    return {"median_s": round(median(values), 4), "p95_s": round(percentile(values, 0.95), 4), "n": len(values)}


# ---- the stack -------------------------------------------------------------------------------------------------

def run_stack(requests: int) -> dict[str, Any]:
    ensure_tiny_checkpoint()
    work = Path(tempfile.mkdtemp(prefix="bench-jobs-"))
    port = free_port()
    argv = launcher_argv(work, work / "jobs", port, denoisers=2)
    sync_s, job_s, accepted_s = [], [], []
    try:
        with running(argv, work) as stack, httpx.Client(base_url=stack.rest(), timeout=120) as http:
            body = {"prompt": 'a red "STOP" sign', "size": "256x256", "n": 1}
            http.post("/v1/images/generations", json={**body, "seed": 0}).raise_for_status()  # warm
            for i in range(requests):
                t = time.perf_counter()
                http.post("/v1/images/generations", json={**body, "seed": i}).raise_for_status()
                sync_s.append(time.perf_counter() - t)
                t = time.perf_counter()
                r = http.post("/v1/images/generations", json={**body, "seed": i}, headers={"Prefer": "respond-async"})
                accepted_s.append(time.perf_counter() - t)
                assert r.status_code == 202, r.text
                location = r.headers["location"]
                while (job := http.get(location).json())["status"] not in ("completed", "failed", "cancelled"):
                    time.sleep(POLL_S)
                assert job["status"] == "completed", job
                job_s.append(time.perf_counter() - t)
                print(f"request {i + 1}: sync {sync_s[-1]:.3f} s, job {job_s[-1]:.3f} s (202 in "
                      f"{accepted_s[-1] * 1000:.1f} ms)")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ratios = [j / s for j, s in zip(job_s, sync_s, strict=True)]
    return {"sync": _stats(sync_s), "job": _stats(job_s), "accepted_202": _stats(accepted_s),
            "job_over_sync_median_ratio": round(median(ratios), 3), "poll_s": POLL_S}


# ---- the store -------------------------------------------------------------------------------------------------

async def _store_round(url: str, jobs: int, runners: int) -> dict[str, Any]:
    stores: list[JobStore] = [open_store(url) for _ in range(runners + 1)]
    for s in stores:
        await s.connect()
    writer, *claimers = stores
    request = gateway_service_pb2.GenerateImagesRequest(prompt="p").SerializeToString()
    inserts, claims, ended = [], [], []
    now = time.time()
    t0 = time.perf_counter()
    for _ in range(jobs):
        t = time.perf_counter()
        await writer.insert(NewJob(id=new_job_id(), tenant=f"t{len(inserts) % 4}", request=request, n=1,
                                   priority=1, created_at=now, deadline=now + 3600))
        inserts.append(time.perf_counter() - t)
    inserted = time.perf_counter() - t0

    async def runner(store: JobStore, name: str) -> None:
        while True:
            t = time.perf_counter()
            lease = await store.claim(name, time.time(), 30.0, 10)
            claims.append(time.perf_counter() - t)
            if lease is None:
                return
            await store.renew(lease, time.time(), 30.0, 1, 2)
            done = time.time()
            assert await store.finish(lease, Outcome(COMPLETED, done, done + 3600, result=b"r"))
            ended.append(lease.job.id)

    t1 = time.perf_counter()
    await asyncio.gather(*(runner(s, f"r{i}") for i, s in enumerate(claimers)))
    ran = time.perf_counter() - t1
    counts = await writer.counts()
    for s in stores:
        await s.close()
    assert len(ended) == len(set(ended)) == jobs and counts.get(COMPLETED) == jobs, (len(ended), counts)
    return {"jobs": jobs, "runners": runners, "insert": _stats(inserts), "claim": _stats(claims),
            "inserts_per_s": round(jobs / inserted, 1), "claim_renew_finish_per_s": round(jobs / ran, 1)}


def run_store(jobs: int, runners: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    work = Path(tempfile.mkdtemp(prefix="bench-jobstore-"))
    try:
        out["sqlite"] = asyncio.run(_store_round(f"sqlite:///{work / 'jobs.sqlite3'}", jobs, runners))
        print(f"sqlite: {out['sqlite']}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    try:
        from tests.support.postgres_server import running_postgres
        with running_postgres() as pg:
            out["postgres"] = asyncio.run(_store_round(pg.dsn(), jobs, runners))
            print(f"postgres: {out['postgres']}")
    except (AssertionError, FileNotFoundError, OSError) as exc:  # no Debian postgresql here: say so, skip
        out["postgres"] = {"skipped": str(exc).splitlines()[0][:200]}
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--jobs", type=int, default=400)
    p.add_argument("--runners", type=int, default=4)
    args = p.parse_args(argv)
    load = os.getloadavg()
    result = {"stack": run_stack(args.requests), "store": run_store(args.jobs, args.runners),
              "loadavg_before": [round(x, 2) for x in load]}
    with contextlib.suppress(Exception):
        s = result["stack"]
        print(f"job / sync (median of ratios): {s['job_over_sync_median_ratio']}; 202 median "
              f"{s['accepted_202']['median_s'] * 1000:.1f} ms")
    write_result("jobs", result, f"python -m bench.jobs --requests {args.requests} --jobs {args.jobs} "
                                 f"--runners {args.runners}")


if __name__ == "__main__":
    main()
