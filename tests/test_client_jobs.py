"""The SDK's jobs (submit_job, get_job, wait, cancel_job, list_jobs) against the scripted JobService
(tests/support/fake_jobs.py): what goes on the wire, what comes back, and a wait that outlives its connection."""
from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from glmimage import AsyncClient, Client, GlmImageError, ImageFetchError, Job, JobWaitTimeout
from glmimage.client import NO_RETRY, RetryPolicy
from glmimage.v1 import common_pb2, gateway_service_pb2
from tests.support.fake_gateway import fake_image
from tests.support.fake_jobs import (
    CREATED_AT,
    FakeJobService,
    FakeJobsServer,
    serve_fake_jobs,
    tcp_proxy,
    wait_watching,
)

FAST = RetryPolicy(max_attempts=4, initial_backoff=0.05, max_backoff=0.2)


@pytest.fixture(scope="module")
def jobs_server() -> Iterator[FakeJobsServer]:
    with serve_fake_jobs() as srv:
        yield srv


@pytest.fixture()
def jobs(jobs_server: FakeJobsServer) -> FakeJobsServer:
    jobs_server.servicer.reset()
    jobs_server.files.requests.clear()
    jobs_server.files.expired.clear()
    return jobs_server


def drive(servicer: FakeJobService, job_id: str, steps: int = 3, *, end: str = "complete") -> threading.Thread:
    """Once a client watches, run the job through a queue position, its steps and its end, from another thread."""
    def run() -> None:
        wait_watching(servicer)
        for change in [lambda: servicer.queue_position(job_id, 0), lambda: servicer.start(job_id, steps),
                       *[lambda k=k: servicer.step(job_id, k) for k in range(1, steps + 1)]]:
            servicer.wait_sent(job_id)  # the client sees each state
            change()
        servicer.wait_sent(job_id)
        if end == "complete":
            servicer.complete(job_id)
        else:
            servicer.fail_job(job_id, "INVALID_ARGUMENT", "the prompt is refused", "prompt")

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_submit_job_sends_the_generation_and_answers_the_queued_job(jobs: FakeJobsServer, tmp_path: Path) -> None:
    ref = tmp_path / "ref.png"
    ref.write_bytes(b"\x89PNG-reference")
    with Client(jobs.address, api_key="sk-alpha", timeout=10) as client:
        job = client.submit_job("a red sign", n=2, size="512x256", seed=7, output_format="webp", steps=5,
                                loras=["tiny-style:0.5"], priority="batch", webhook_url="https://hooks.example/x",
                                idempotency_key="order-17", request_id="rid-mine")
        edit = client.submit_job("make it blue", size=(64, 64), images=[ref, b"second"])
    assert isinstance(job, Job) and job.id.startswith("job_") and len(job.id) == 36
    assert (job.status, job.n, job.edit, job.webhook_url, job.request_id) == (
        "queued", 2, False, "https://hooks.example/x", "rid-mine")
    assert (job.created_at, job.started_at, job.finished_at, job.expires_at) == (CREATED_AT + 1, None, None, None)
    assert job.progress.queue_position == 1 and not job.done and not job.ok and job.error is None
    assert job.images == [] and job.usage is None
    first, second = jobs.servicer.calls
    assert first.metadata["authorization"] == "Bearer sk-alpha" and first.metadata["x-request-id"] == "rid-mine"
    r = first.request.request
    assert (r.prompt, r.n, r.width, r.height, r.seed, r.num_inference_steps) == ("a red sign", 2, 512, 256, 7, 5)
    assert r.output_format == common_pb2.IMAGE_FORMAT_WEBP and r.priority == gateway_service_pb2.PRIORITY_BATCH
    assert [(lr.name, lr.scale) for lr in r.loras] == [("tiny-style", 0.5)]
    assert (first.request.webhook_url, first.request.idempotency_key) == ("https://hooks.example/x", "order-17")
    assert edit.edit and [ref.data for ref in second.request.request.reference_images] == [
        b"\x89PNG-reference", b"second"]
    assert second.request.webhook_url == ""


def test_a_retried_submit_carries_the_same_idempotency_key(jobs: FakeJobsServer) -> None:
    # The SDK names a key of its own when the caller gives none: a retry after an answer lost (UNAVAILABLE) then
    # finds the job the first call wrote instead of making a second one.
    jobs.servicer.fail["SubmitJob"] = [grpc.StatusCode.UNAVAILABLE]
    with Client(jobs.address, retry=FAST, timeout=10) as client:
        job = client.submit_job("once")
        other = client.submit_job("once")
        again = client.submit_job("twice", idempotency_key="k1")
        same = client.submit_job("twice", idempotency_key="k1")
    keys = [c.request.idempotency_key for c in jobs.servicer.calls]
    assert len(keys) == 5 and keys[0] == keys[1] and keys[0].startswith("sdk-")
    assert len({keys[0], keys[2], "k1"}) == 3, "each call its own key"
    assert job.id != other.id and again.id == same.id
    assert len(jobs.servicer.entries) == 3


def test_wait_follows_the_job_to_its_images(jobs: FakeJobsServer, tmp_path: Path) -> None:
    seen: list[Job] = []
    with Client(jobs.address, api_key="sk-alpha", timeout=20) as client:
        job = client.submit_job("a cat", n=2, seed=3)
        driver = drive(jobs.servicer, job.id)
        done = client.wait(job, on_update=seen.append)
        driver.join()
        again = client.wait(done)  # an ended job: answered as it is, without a call
        full = client.get_job(job.id, include_images=True)
    assert done.ok and done.done and again is done
    assert [j.status for j in seen][-1] == "completed"
    # Each state once, in order (the driver changes the job only once the watch has sent it as it was).
    assert [(j.status, j.progress.queue_position, j.progress.step) for j in seen] == [
        ("queued", 0, 0), *[("in_progress", 0, k) for k in range(4)], ("completed", 0, 3)]
    assert (done.started_at, done.finished_at, done.expires_at) == (
        job.created_at + 1, job.created_at + 2, job.created_at + 2 + 86_400)
    assert done.attempts == 1 and done.seeds == [3, 4] and [im.index for im in done.images] == [0, 1]
    assert (done.width, done.height, done.output_format, done.extension) == (256, 256, "png", "png")
    assert done.usage is not None and done.usage.total_tokens == 24
    assert all(im.data is None and im.url.startswith(jobs.files.base_url) for im in done.images)
    expected = [fake_image("a cat", i, 3 + i) for i in range(2)]
    assert done.fetch_images() == expected
    # Signed URLs are the capability: no key travels to the file server (an S3 presigned URL would refuse one).
    assert [p for p, _ in jobs.files.requests] == ["/files/" + f"{job.id}/{i}?sig=secret-{i}" for i in range(2)]
    assert all("authorization" not in {k.lower() for k in h} for _, h in jobs.files.requests)
    assert [im.data for im in full.images] == expected
    paths = full.download(tmp_path / "out", "cat")
    assert [p.name for p in paths] == ["cat-0.png", "cat-1.png"] and [p.read_bytes() for p in paths] == expected
    assert len(jobs.files.requests) == 2, "bytes the job carries are not fetched again"
    with pytest.raises(FileExistsError):
        full.download(tmp_path / "out", "cat", overwrite=False)


def test_wait_watches_again_when_the_stream_breaks(jobs: FakeJobsServer) -> None:
    # The first watch breaks after two messages, the next two at once: the job goes on, and so does the wait.
    jobs.servicer.watch_breaks[:] = [2, 0, 0]
    with Client(jobs.address, retry=FAST, timeout=20) as client:
        job = client.submit_job("on and off", seed=1)
        jobs.servicer.start(job.id, 2)
        threading.Thread(target=lambda: (wait_watching(jobs.servicer), jobs.servicer.step(job.id, 1),
                                         [wait_watching(jobs.servicer) for _ in range(3)],
                                         jobs.servicer.complete(job.id)), daemon=True).start()
        done = client.wait(job.id)
    assert done.ok and done.seeds == [1]
    assert jobs.servicer.methods().count("WatchJob") == 4


def test_wait_survives_a_dropped_connection(jobs: FakeJobsServer) -> None:
    # A real cut: every TCP connection through the proxy closed mid-watch (a load balancer's idle timeout). The
    # channel reconnects through the proxy, and the wait watches again.
    seen: list[str] = []
    with tcp_proxy(jobs.address) as proxy, Client(proxy.address, retry=FAST, timeout=30) as client:
        job = client.submit_job("through a proxy")
        jobs.servicer.start(job.id, 4)
        ready = threading.Event()

        def cut_then_finish() -> None:
            wait_watching(jobs.servicer)
            jobs.servicer.step(job.id, 1)
            ready.wait(10)
            assert proxy.drop() >= 2
            wait_watching(jobs.servicer)  # the second watch, over a new connection
            jobs.servicer.complete(job.id)

        thread = threading.Thread(target=cut_then_finish, daemon=True)
        thread.start()

        def update(j: Job) -> None:
            seen.append(f"{j.status}:{j.progress.step}")
            if j.progress.step == 1:
                ready.set()

        done = client.wait(job, on_update=update)
        thread.join(10)
        assert proxy.accepted >= 2
    assert done.ok and seen[-1] == "completed:4" and "in_progress:1" in seen


WAIT_S = 0.5


def test_wait_times_out_with_the_job_as_it_stood(jobs: FakeJobsServer) -> None:
    with Client(jobs.address, timeout=30) as client:
        job = client.submit_job("slow")
        jobs.servicer.start(job.id, 10)
        jobs.servicer.step(job.id, 3)
        t0 = time.monotonic()
        with pytest.raises(JobWaitTimeout) as caught:
            client.wait(job.id, timeout=WAIT_S)
        # Ends at its own timeout, not at the client's 30 s: 10x what it asked for (above the 3x margin of a loaded
        # 2-core machine; the watch's one call and its cancel are all that is added).
        assert time.monotonic() - t0 < 10 * WAIT_S
        assert isinstance(caught.value, TimeoutError)
        assert caught.value.job is not None and caught.value.job.progress.step == 3
        assert f"job {job.id} still in_progress (step 3/10) after {WAIT_S}s" in str(caught.value)
        # The job goes on: it is there to wait for again.
        assert client.get_job(job.id).status == "in_progress"


def test_wait_gives_up_at_once_on_what_a_retry_cannot_change(jobs: FakeJobsServer) -> None:
    other = jobs.servicer.add("beta")
    with Client(jobs.address, api_key="sk-alpha", retry=FAST, timeout=10) as client:
        with pytest.raises(GlmImageError) as caught:
            client.wait(other)
        assert caught.value.code == grpc.StatusCode.NOT_FOUND
    assert jobs.servicer.methods() == ["WatchJob"]
    # With retries off, a broken stream is final too.
    job = jobs.servicer.add("anonymous")
    jobs.servicer.watch_breaks[:] = [1]
    with Client(jobs.address, retry=NO_RETRY, timeout=10) as client:
        with pytest.raises(GlmImageError) as caught:
            client.wait(job)
        assert caught.value.code == grpc.StatusCode.UNAVAILABLE


def test_a_failed_job_carries_its_error(jobs: FakeJobsServer) -> None:
    with Client(jobs.address, timeout=20) as client:
        job = client.submit_job("refused")
        drive(jobs.servicer, job.id, end="fail")
        done = client.wait(job)
    assert done.done and not done.ok and done.status == "failed" and done.images == []
    assert done.error is not None and (done.error.code, done.error.field) == ("INVALID_ARGUMENT", "prompt")
    assert str(done.error) == "INVALID_ARGUMENT: prompt: the prompt is refused"
    with pytest.raises(ValueError, match="is failed: it has no images"):
        done.fetch_images()


def test_another_tenants_job_is_not_found(jobs: FakeJobsServer) -> None:
    with Client(jobs.address, api_key="sk-alpha", timeout=10) as alpha, \
            Client(jobs.address, api_key="sk-beta", timeout=10) as beta:
        job = alpha.submit_job("mine")
        assert alpha.get_job(job.id).id == job.id
        never = "job_" + "f" * 32
        for call, job_id in ((beta.get_job, job.id), (beta.cancel_job, job.id), (alpha.get_job, never)):
            with pytest.raises(GlmImageError) as caught:
                call(job_id)
            assert caught.value.code == grpc.StatusCode.NOT_FOUND
        assert alpha.get_job(job.id).status == "queued", "another tenant's cancel did nothing"
    with pytest.raises(ValueError, match="a job id is required"):
        Client(jobs.address).get_job("")


def test_cancel_job_answers_the_job_after_the_call(jobs: FakeJobsServer) -> None:
    with Client(jobs.address, timeout=10) as client:
        job = client.submit_job("never mind")
        cancelled = client.cancel_job(job.id)
        assert cancelled.status == "cancelled" and cancelled.done and cancelled.finished_at is not None
        assert client.cancel_job(job.id) == cancelled, "an ended job is left as it is"
        assert client.wait(job.id).status == "cancelled"


def test_list_jobs_pages_newest_first(jobs: FakeJobsServer) -> None:
    ids = [jobs.servicer.add("alpha", f"p{i}") for i in range(5)]
    jobs.servicer.add("beta")
    done = jobs.servicer.add("alpha", "finished", status="completed")
    with Client(jobs.address, api_key="sk-alpha", timeout=10) as client:
        first = client.list_jobs(limit=2)
        assert [j.id for j in first.jobs] == [done, ids[4]] and first.has_more and first.next_after == ids[4]
        second = client.list_jobs(limit=2, after=first.next_after)
        assert [j.id for j in second.jobs] == [ids[3], ids[2]] and second.has_more
        last = client.list_jobs(limit=2, after=second.next_after)
        assert [j.id for j in last.jobs] == [ids[1], ids[0]] and not last.has_more and last.next_after is None
        assert [j.id for j in client.iter_jobs(page_size=2)] == [done, *reversed(ids)]
        assert jobs.servicer.methods()[-4:] == ["ListJobs"] * 4
        (only,) = client.list_jobs(status="completed").jobs
        assert only.id == done and only.ok
        assert [j.id for j in client.iter_jobs(status="queued")] == list(reversed(ids))
        assert client.list_jobs().jobs[0].id == done  # default limit 20: all 6 in one page
        calls = len(jobs.servicer.calls)
        for bad in (dict(limit=0), dict(limit=101), dict(status="running")):
            with pytest.raises(ValueError, match="limit must be 1 to 100|status must be one of queued"):
                client.list_jobs(**bad)
        assert len(jobs.servicer.calls) == calls, "refused before any call"


def test_relative_image_urls_need_a_base(tmp_path: Path) -> None:
    with serve_fake_jobs(absolute_urls=False) as srv:
        with Client(srv.address, timeout=20) as client:
            job = client.submit_job("relative", n=1, seed=9)
            drive(srv.servicer, job.id)
            done = client.wait(job)
        assert done.images[0].url.startswith("/files/")
        with pytest.raises(ValueError, match="is relative: give base_url"):
            done.fetch_images()
        assert done.fetch_images(srv.files.base_url) == [fake_image("relative", 0, 9)]
        with Client(srv.address, timeout=20, base_url=srv.files.base_url + "/") as client:
            based = client.get_job(job.id)
        assert based.image_urls() == [f"{srv.files.base_url}/files/{job.id}/0?sig=secret-0"]
        assert based.download(tmp_path)[0].read_bytes() == fake_image("relative", 0, 9)
        with pytest.raises(ValueError, match="only http and https"):
            done.fetch_images("file:///etc/")


def test_an_expired_url_says_so_without_its_signature(jobs: FakeJobsServer) -> None:
    with Client(jobs.address, timeout=20) as client:
        job = client.submit_job("old")
        drive(jobs.servicer, job.id)
        done = client.wait(job)
    jobs.files.expired.add(f"{job.id}/0")
    with pytest.raises(ImageFetchError) as caught:
        done.fetch_images()
    message = str(caught.value)
    assert f"/files/{job.id}/0: HTTP 403 (url_expired)" in message and "sig" not in message
    assert isinstance(caught.value, OSError)


def test_webhook_secret(jobs: FakeJobsServer) -> None:
    with Client(jobs.address, api_key="sk-beta", timeout=10) as client:
        assert client.get_webhook_secret() == "whsec_beta"


async def test_async_client_jobs(jobs: FakeJobsServer) -> None:
    seen: list[str] = []

    async def update(j: Job) -> None:
        seen.append(j.status)

    async with AsyncClient(jobs.address, api_key="sk-alpha", retry=FAST, timeout=20) as client:
        job = await client.submit_job("async", n=2, seed=5, webhook_url="https://hooks.example/y")
        jobs.servicer.watch_breaks[:] = [1]  # the first watch breaks: the async wait watches again too
        driver = drive(jobs.servicer, job.id)
        done = await client.wait(job, on_update=update)
        await asyncio.to_thread(driver.join)
        assert done.ok and seen[-1] == "completed" and done.webhook_url == "https://hooks.example/y"
        assert await asyncio.to_thread(done.fetch_images) == [fake_image("async", i, 5 + i) for i in range(2)]
        full = await client.get_job(job.id, include_images=True)
        assert [im.data for im in full.images] == [fake_image("async", i, 5 + i) for i in range(2)]
        other = await client.submit_job("second")
        page = await client.list_jobs(limit=1)
        assert [j.id for j in page.jobs] == [other.id] and page.has_more
        assert [j.id async for j in client.iter_jobs(page_size=1)] == [other.id, job.id]
        assert (await client.cancel_job(other.id)).status == "cancelled"
        with pytest.raises(JobWaitTimeout):
            await client.wait((await client.submit_job("never")).id, timeout=0.3)
        assert await client.get_webhook_secret() == "whsec_alpha"
    assert jobs.servicer.methods().count("WatchJob") >= 3
