"""The job runner (gateway/jobs/runner.py) on a real SQLite store and a real disk image store, with a scripted
executor in place of the gateway's scheduler (what a job's run answers is the point here, not how the pool makes
it; tests/test_jobs_e2e.py runs jobs on real workers).

What is checked: a job runs and ends once, its images stored and recorded with it; progress reaches the store; a
cancel asked for through the store stops the run and ends the job cancelled; a failure that heals gives the job back
and it is taken again; one that does not is the job's end with its code and field; a runner whose lease was taken
over records nothing; a runner that stops gives its jobs back at once; a runner waits for ready workers."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from gateway.jobs.convert import job_proto
from gateway.jobs.execute import Failure
from gateway.jobs.images import DiskImageStore
from gateway.jobs.keeper import ImageKeeper
from gateway.jobs.model import CANCELLED, COMPLETED, FAILED, IN_PROGRESS, QUEUED, NewJob, new_job_id
from gateway.jobs.outcomes import Finisher
from gateway.jobs.render import job_json
from gateway.jobs.runner import Runner, RunnerConfig
from gateway.jobs.store import JobStore, open_store
from gateway.jobs.urls import UrlSigner
from glmimage.v1 import common_pb2, gateway_service_pb2
from runtime.errors import ErrorKind

DEADLINE_S = 30.0  # every wait below: far above what each takes on a loaded machine


class Script:
    """Stands in for JobExecutor: each run waits on its gate, reports progress, then answers what it is told."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.gate.set()
        self.answers: list[object] = []
        self.started = asyncio.Event()
        self.cancelled = 0
        self.runs = 0
        self.is_ready = True

    def ready(self) -> bool:
        return self.is_ready

    async def run(self, request, tenant, timeout, progress):
        self.runs += 1
        self.started.set()
        try:
            progress(1, 4)
            await self.gate.wait()
            progress(4, 4)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        answer = self.answers.pop(0) if self.answers else None
        if answer is not None:
            return answer
        return gateway_service_pb2.GenerateImagesResponse(
            images=[gateway_service_pb2.GeneratedImage(index=i, image=b"\x89PNG-" + bytes([i]) * 64, seed=i)
                    for i in range(request.n or 1)],
            height=256, width=256, output_format=common_pb2.IMAGE_FORMAT_PNG, request_id=request.request_id)


@pytest.fixture()
async def parts(tmp_path: Path) -> AsyncIterator[tuple[JobStore, ImageKeeper, Finisher, DiskImageStore]]:
    store = open_store(f"sqlite:///{tmp_path / 'jobs.sqlite3'}")
    await store.connect()
    images = DiskImageStore(tmp_path / "images", UrlSigner(b"k" * 32, 3600.0))
    keeper = ImageKeeper(images, store, 86400.0, 1 << 30)
    yield store, keeper, Finisher(keeper, job_json, 86400.0, 3600.0), images
    await store.close()


def runner(parts, script: Script, **config) -> Runner:
    store, keeper, finisher, _ = parts
    cfg = RunnerConfig(**{"lease_s": 30.0, "poll_s": 0.05, "backoff_s": 0.05, "max_backoff_s": 0.1,
                          "progress_every_s": 0.05, "renew_every_s": 0.1, **config})
    return Runner(store, script, keeper, finisher, cfg)


async def submit(store: JobStore, n: int = 2, webhook: str = "") -> str:
    now = time.time()
    request = gateway_service_pb2.GenerateImagesRequest(prompt="p", n=n, request_id="r")
    record, _ = await store.insert(NewJob(id=new_job_id(), tenant="alpha", request=request.SerializeToString(), n=n,
                                          priority=1, created_at=now, deadline=now + 600, webhook_url=webhook))
    return record.id


async def until(check, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def status_of(store: JobStore, job_id: str) -> str:
    return (await store.get(job_id, "alpha")).status


class Running:
    """A runner's loop as a task, stopped (its jobs given back) on the way out."""

    def __init__(self, r: Runner) -> None:
        self.runner, self.stop = r, asyncio.Event()

    async def __aenter__(self) -> Runner:
        self.task = asyncio.create_task(self.runner.run(self.stop))
        return self.runner

    async def __aexit__(self, *exc) -> None:
        self.stop.set()
        await asyncio.wait_for(self.task, DEADLINE_S)


async def test_a_job_runs_and_ends_once_with_its_images_and_webhook(parts) -> None:
    store, keeper, _, images = parts
    script = Script()
    job_id = await submit(store, n=2, webhook="https://hooks.example.com/x")
    async with Running(runner(parts, script)):
        await until(lambda: _ended(store, job_id), "the job's end")
    record = await store.get(job_id, "alpha")
    assert record.status == COMPLETED and record.attempts == 1 and record.lease_owner is None
    assert (record.step, record.total_steps) == (4, 4)
    stored = gateway_service_pb2.GenerateImagesResponse.FromString(record.result)
    assert [await images.get(img.url) for img in stored.images] == [b"\x89PNG-" + bytes([i]) * 64 for i in range(2)]
    assert await store.stored_bytes("alpha", time.time()) == 2 * 69
    assert (await store.delivery_counts()).get("pending") == 1  # its webhook is owed, written with its end
    assert script.runs == 1


async def _ended(store: JobStore, job_id: str) -> bool:
    return (await store.get(job_id, "alpha")).ended


async def test_a_cancel_through_the_store_stops_the_run(parts) -> None:
    store, *_ = parts
    script = Script()
    script.gate.clear()
    job_id = await submit(store)
    async with Running(runner(parts, script)):
        await asyncio.wait_for(script.started.wait(), DEADLINE_S)
        await until(lambda: _progress(store, job_id, (1, 4)), "the first progress write")
        await store.cancel(job_id, "alpha", time.time(), lambda job: None)  # a live lease: only the flag is set
        await until(lambda: _ended(store, job_id), "the cancel")
    assert await status_of(store, job_id) == CANCELLED
    assert script.cancelled == 1


async def _progress(store: JobStore, job_id: str, figures: tuple[int, int]) -> bool:
    record = await store.get(job_id, "alpha")
    return (record.step, record.total_steps) == figures


async def test_a_local_cancel_stops_the_run_at_once(parts) -> None:
    store, *_ = parts
    script = Script()
    script.gate.clear()
    job_id = await submit(store)
    async with Running(runner(parts, script, renew_every_s=5.0)) as r:
        await asyncio.wait_for(script.started.wait(), DEADLINE_S)
        await store.cancel(job_id, "alpha", time.time(), lambda job: None)
        r.cancel(job_id)  # what JobService does on the gateway that holds it
        await until(lambda: _ended(store, job_id), "the cancel")
    assert await status_of(store, job_id) == CANCELLED


async def test_a_failure_that_heals_is_tried_again(parts) -> None:
    store, *_ = parts
    script = Script()
    script.answers = [Failure(ErrorKind.UNAVAILABLE, "no ready denoiser")]
    job_id = await submit(store)
    async with Running(runner(parts, script)):
        await until(lambda: _ended(store, job_id), "the job's end")
    record = await store.get(job_id, "alpha")
    assert record.status == COMPLETED and record.attempts == 2 and script.runs == 2


async def test_a_failure_that_does_not_heal_is_the_end(parts) -> None:
    store, *_ = parts
    script = Script()
    script.answers = [Failure(ErrorKind.INVALID_ARGUMENT, "prompt: too long", "prompt")]
    job_id = await submit(store)
    async with Running(runner(parts, script)):
        await until(lambda: _ended(store, job_id), "the job's end")
    record = await store.get(job_id, "alpha")
    assert (record.status, record.error_code, record.error_field) == (FAILED, "INVALID_ARGUMENT", "prompt")
    assert job_json(_proto(record, parts))["error"] == {"message": "prompt: too long", "type": "invalid_request_error",
                                                        "param": "prompt", "code": "invalid_argument"}


def _proto(record, parts):
    return job_proto(record, parts[1], time.time())


async def test_a_runner_whose_lease_was_taken_over_records_nothing(parts) -> None:
    store, *_ = parts
    script = Script()
    script.gate.clear()
    job_id = await submit(store)
    async with Running(runner(parts, script, lease_s=30.0)):
        await asyncio.wait_for(script.started.wait(), DEADLINE_S)
        # Another runner, 31 s later as the store sees it: the first one's lease has run out, it takes the job.
        other = await store.claim("other-runner", time.time() + 31, 30.0, 10)
        assert other is not None and other.job.id == job_id and other.attempt == 2
        await until(lambda: _stopped(script), "the first runner to stop its run")
        script.gate.set()
    record = await store.get(job_id, "alpha")
    assert record.status == IN_PROGRESS and record.lease_owner == "other-runner" and record.result is None


async def _stopped(script: Script) -> bool:
    return script.cancelled == 1


async def test_a_stopping_runner_gives_its_jobs_back(parts) -> None:
    store, *_ = parts
    script = Script()
    script.gate.clear()
    ids = [await submit(store) for _ in range(3)]
    async with Running(runner(parts, script)):
        await until(lambda: _all(store, ids, IN_PROGRESS), "all three taken")
    assert [await status_of(store, i) for i in ids] == [QUEUED] * 3
    assert script.cancelled == 3
    # ... and the next runner takes them at once.
    script.gate.set()
    async with Running(runner(parts, script)):
        await until(lambda: _all(store, ids, COMPLETED), "all three done by the next runner")


async def _all(store: JobStore, ids: list[str], status: str) -> bool:
    return all([await status_of(store, i) == status for i in ids])


async def test_no_job_is_taken_before_workers_are_ready(parts) -> None:
    store, *_ = parts
    script = Script()
    script.is_ready = False
    job_id = await submit(store)
    async with Running(runner(parts, script)):
        await asyncio.sleep(0.3)  # several polls: none may take the job
        assert await status_of(store, job_id) == QUEUED and script.runs == 0
        script.is_ready = True
        await until(lambda: _ended(store, job_id), "the job's end once workers are ready")


async def test_a_draining_runner_takes_nothing_new_and_lets_its_jobs_end(parts) -> None:
    """SIGTERM of the gateway: its runner stops taking jobs (another gateway's takes them), and the jobs it holds
    run on to their end within the grace rather than being cut off."""
    store, *_ = parts
    script = Script()
    script.gate.clear()
    held = await submit(store)
    async with Running(runner(parts, script, concurrency=4)) as r:
        await asyncio.wait_for(script.started.wait(), DEADLINE_S)
        r.drain()
        later = await submit(store)
        r.wake()
        await asyncio.sleep(0.3)  # several polls: none may take the new job
        assert await status_of(store, later) == QUEUED and script.runs == 1
        script.gate.set()
        assert await r.finish_within(DEADLINE_S)
    assert await status_of(store, held) == COMPLETED and await status_of(store, later) == QUEUED
