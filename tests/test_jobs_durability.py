"""Nothing accepted is lost (issue 31's done-when), on real processes with the tiny model and the embedded SQLite
job store: 16 jobs accepted, then every process of the stack SIGKILLed mid-work and the same launcher command run
again: all 16 complete, each recorded once, and the client sent nothing twice. The same with the gateway (the
process running jobs) SIGKILLed alone, three times, under the launcher that restarts it.

"Recorded once" is read in the store itself (sqlite3 on the file): one row per job, completed, one result naming n
images, the objects table exactly those images; a job ended before a kill keeps the result it had; the restarted
gateway's glmimage_jobs_finished_total counts exactly the ends that were still missing.

Last, in-process on the real store and runner: a job given back for a failure that heals is tried again up to its
deadline, not aborted once its give-backs reach --job-max-attempts (they are no runner dying under it).
"""
from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from gateway.jobs.execute import Failure
from gateway.jobs.housekeeping import Housekeeping, HousekeepingConfig
from gateway.jobs.images import open_image_store
from gateway.jobs.keeper import ImageKeeper
from gateway.jobs.model import COMPLETED, TERMINAL, NewJob, new_job_id
from gateway.jobs.outcomes import Finisher
from gateway.jobs.render import job_json
from gateway.jobs.runner import Runner, RunnerConfig
from gateway.jobs.store import open_store
from gateway.jobs.urls import UrlSigner
from glmimage.v1 import gateway_service_pb2
from runtime.errors import ErrorKind
from tests.support.cluster import wait_serving
from tests.support.jobs_stack import (
    JobClient,
    StoreView,
    alive,
    assert_recorded_once,
    body,
    launcher_argv,
    read_sqlite,
    running,
    start,
)
from tests.support.net import free_port
from tests.support.tenants_stack import sample
from tests.support.waiting import until

# About a second a job (its AR, then under half a second an image at 64x64 on one denoiser): a kill finds jobs
# queued, denoising and done.
STEPS, SIZE = 40, 64
PNG = b"\x89PNG\r\n\x1a\n"
# Four runner slots: of 16 jobs, some wait queued in the store while others run.
CONCURRENCY = "--gateway-arg=--job-concurrency=4"


def _mid_work(view: StoreView) -> bool:
    statuses = view.statuses()
    return (statuses["completed"] >= 2 and statuses["queued"] >= 2
            and any(r.denoising for r in view.jobs.values()))


def _check_images(client: JobClient, jobs: dict[str, dict], view: StoreView, images: Path) -> None:
    """Each job's links, as its JSON names them: n of them, each answering its stored PNG's bytes."""
    for job_id, job in jobs.items():
        urls = [item["url"] for item in job["result"]["data"]]
        keys = view.jobs[job_id].result_keys
        assert len(urls) == job["n"] == len(keys), job
        for url, key in zip(urls, keys, strict=True):
            assert f"/v1/images/files/{key}?" in url, (url, key)
            r = client.get(url)
            assert r.status_code == 200 and r.headers["content-type"] == "image/png", (r.status_code, r.text[:200])
            assert r.content.startswith(PNG) and r.content == (images / key).read_bytes()


@pytest.mark.e2e
@pytest.mark.chaos
def test_sixteen_jobs_survive_sigkill_of_the_whole_stack(tiny_checkpoint: Path, tmp_path: Path) -> None:
    jobs_dir = tmp_path / "jobs"
    db, images = jobs_dir / "jobs.sqlite3", jobs_dir / "images"
    argv = launcher_argv(tmp_path, jobs_dir, free_port(), CONCURRENCY)
    client = JobClient()
    stack = start(argv, tmp_path)
    try:
        ids = [client.submit(stack.rest(), body(10 * i, 1 + i % 2, STEPS, SIZE)) for i in range(16)]
        until(lambda: _mid_work(read_sqlite(db)), 60, "jobs done, denoising and queued at once", step=0.05)
    finally:
        killed = stack.kill_everything()
    assert len(killed) >= 5  # the launcher, the AR, the denoiser, the gateway and the REST front
    at_kill = read_sqlite(db)  # nothing runs: the store as the kill left it
    done_before = {i: r for i, r in at_kill.jobs.items() if r.status == "completed"}
    running_at_kill = {i for i, r in at_kill.jobs.items() if r.status == "in_progress"}
    assert done_before and running_at_kill and at_kill.statuses()["queued"], at_kill.statuses()

    with running(argv, tmp_path) as again:  # the same command, the same --jobs-dir
        jobs = client.wait_all_completed(again.rest, ids, 120)
        view = read_sqlite(db)
        _check_images(client, jobs, view, images)
        metrics = again.addresses["gateway-metrics"]
        # The restarted gateway recorded exactly the ends the kill left missing, no more: none twice.
        finished = sample(metrics, "glmimage_jobs_finished_total", status="completed")
        assert finished == 16 - len(done_before), (finished, len(done_before))
        # The store-wide gauge, refreshed by housekeeping every few seconds.
        until(lambda: sample(metrics, "glmimage_jobs", status="completed") == 16, 30, "the jobs gauge to count 16",
              step=0.5)
        assert sample(metrics, "glmimage_job_takeovers_total") >= len(running_at_kill)
    assert again.proc.returncode == 0, again.log_tail()

    view = read_sqlite(db)
    assert_recorded_once(view, ids, images)
    for job_id, before in done_before.items():  # ended before the kill: never run again, its result kept
        assert view.jobs[job_id] == before
    for job_id in running_at_kill:  # killed under its runner: taken again
        assert view.jobs[job_id].attempts >= 2, view.jobs[job_id]
    assert {i: j["attempts"] for i, j in jobs.items()} == {i: r.attempts for i, r in view.jobs.items()}
    # Only the 16 submissions were POSTs: no job was sent again.
    assert client.sent["POST"] == 16 and set(client.sent) == {"POST", "GET"}, client.sent


KILLS, PER_ROUND = 3, 6


@pytest.mark.e2e
@pytest.mark.chaos
def test_the_gateway_killed_three_times_under_the_launcher(tiny_checkpoint: Path, tmp_path: Path) -> None:
    jobs_dir = tmp_path / "jobs"
    db, images = jobs_dir / "jobs.sqlite3", jobs_dir / "images"
    client = JobClient()
    ids: list[str] = []
    held: list[set[str]] = []  # at each kill, the jobs the gateway killed was running
    with running(launcher_argv(tmp_path, jobs_dir, free_port(), CONCURRENCY), tmp_path) as stack:
        address = stack.addresses["gateway"]
        for round_ in range(KILLS):
            victim = stack.pids["gateway"]
            # Fresh work each round, so every kill finds a job denoising under the gateway killed.
            ids += [client.submit(stack.rest(), body(1000 * round_ + 10 * i, 1 + i % 2, STEPS, SIZE))
                    for i in range(PER_ROUND)]
            until(lambda victim=victim: any(r.denoising and r.owner_pid() == victim
                                            for r in read_sqlite(db).jobs.values()),
                  60, f"round {round_}: a job denoising under gateway {victim}", step=0.05)
            # The launcher held still while the gateway dies and the store is read: what it shows is the dead
            # gateway's work, none of its replacement's yet. Then the launcher sees the death and restarts it.
            stack.proc.send_signal(signal.SIGSTOP)
            try:
                os.kill(victim, signal.SIGKILL)
                until(lambda victim=victim: not alive(victim), 30, "the gateway to be gone")
                at_kill = read_sqlite(db)
            finally:
                stack.proc.send_signal(signal.SIGCONT)
            held.append({i for i, r in at_kill.jobs.items() if r.status == "in_progress" and r.owner_pid() == victim})
            until(lambda victim=victim: stack.pids.get("gateway") not in (None, victim), 60,
                  "the launcher to restart the gateway", step=0.1)
            assert stack.addresses["gateway"] == address  # on the same port
            wait_serving(address, "glmimage.v1.GatewayService", 60)
            # The front's channel to the gateway is back too (a GET only: a POST would be a submission).
            until(lambda: _lists(client, stack.rest()), 30, "the REST front to reach the new gateway", step=0.1)
        jobs = client.wait_all_completed(stack.rest, ids, 120)
        view = read_sqlite(db)
        _check_images(client, jobs, view, images)
        # The last gateway recorded exactly the ends still missing at the last kill.
        finished = sample(stack.addresses["gateway-metrics"], "glmimage_jobs_finished_total", status="completed")
        assert finished == len(ids) - at_kill.statuses()["completed"], (finished, at_kill.statuses())
    assert stack.proc.returncode == 0, stack.log_tail()
    view = read_sqlite(db)
    assert_recorded_once(view, ids, images)
    assert all(held), held
    for job_id in set().union(*held):  # killed under its runner: taken again
        assert view.jobs[job_id].attempts >= 2, view.jobs[job_id]
    assert client.sent["POST"] == KILLS * PER_ROUND, client.sent


def _lists(client: JobClient, base: str) -> bool:
    try:
        client.jobs(base)
        return True
    except Exception:  # noqa: BLE001 (down, or answering 503: ask again)
        return False


# ---- a job given back for a failure that heals ------------------------------------------------------------------

async def test_a_job_given_back_for_a_failure_that_heals_is_not_aborted(tmp_path: Path) -> None:
    """The runner gives a job back to be tried again later, up to its deadline, when the failure heals (the tenant's
    in-flight bound is full, a queue is full, no worker is ready): those give-backs are no runner dying under the
    job, and must not spend its --job-max-attempts. The real SQLite store, runner and housekeeping; the executor
    answers RESOURCE_EXHAUSTED (what the tenant's in-flight bound answers) for its first runs."""
    store = open_store(f"sqlite:///{tmp_path / 'jobs.sqlite3'}")
    await store.connect()
    images = open_image_store(str(tmp_path / "images"), UrlSigner(b"k" * 32, 3600))
    keeper = ImageKeeper(images, store, 86400, 1 << 30)
    finisher = Finisher(keeper, job_json, 86400, 3600)
    max_attempts = 3
    executor = _BusyTenant(busy_runs=max_attempts)
    runner = Runner(store, executor, keeper, finisher, RunnerConfig(
        concurrency=1, lease_s=3, max_attempts=max_attempts, poll_s=0.01, backoff_s=0.01, max_backoff_s=0.02))
    housekeeping = Housekeeping(store, images, finisher, HousekeepingConfig(max_attempts=max_attempts))
    now = time.time()
    request = gateway_service_pb2.GenerateImagesRequest(prompt="busy", n=1, request_id="req-busy")
    job = NewJob(id=new_job_id(), tenant="t", request=request.SerializeToString(), n=1, priority=1,
                 created_at=now, deadline=now + 3600, request_id="req-busy")
    await store.insert(job)
    stop = asyncio.Event()
    running_ = asyncio.create_task(runner.run(stop))
    try:
        for _ in range(400):  # at most 20 s; the job needs four runs, some hundredths of a second apart
            await housekeeping.once()  # (what every gateway runs every few seconds: it reaps)
            record = await store.get(job.id, None)
            if record.status in TERMINAL:
                break
            await asyncio.sleep(0.05)
    finally:
        stop.set()
        await running_
        await store.close()
    assert (record.status, record.error_code, record.error_message) == (COMPLETED, "", ""), (
        f"{record.status} after {executor.runs} runs, attempts {record.attempts}: {record.error_code} "
        f"{record.error_message}")


class _BusyTenant:
    """Stands in for JobExecutor: the tenant's in-flight bound is full for the first ``busy_runs`` runs, then the
    job runs (one 1x1 PNG)."""

    def __init__(self, busy_runs: int) -> None:
        self.busy_runs = busy_runs
        self.runs = 0

    def ready(self) -> bool:
        return True

    async def run(self, request, tenant: str, timeout: float, progress):
        self.runs += 1
        if self.runs <= self.busy_runs:
            return Failure(ErrorKind.RESOURCE_EXHAUSTED, f"tenant {tenant!r} has its images in flight already")
        return gateway_service_pb2.GenerateImagesResponse(
            images=[gateway_service_pb2.GeneratedImage(index=0, image=PNG + b"...")], width=1, height=1)
