"""`glmimage jobs submit|get|wait|cancel|list`, run as a real subprocess against the scripted JobService
(tests/support/fake_jobs.py), which moves each job only when the test says."""
from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from glmimage.cli_jobs import format_jobs, job_progress
from glmimage.jobs import Job, JobError, JobImage, JobProgress
from glmimage.v1 import common_pb2, gateway_service_pb2
from tests.support.fake_gateway import fake_image
from tests.support.fake_jobs import CREATED_AT, FakeJobService, FakeJobsServer, serve_fake_jobs, wait_watching
from tests.support.programs import glmimage

ALPHA = {"GLMIMAGE_API_KEY": "sk-alpha"}


@pytest.fixture(scope="module")
def jobs_server() -> Iterator[FakeJobsServer]:
    with serve_fake_jobs() as srv:
        yield srv


@pytest.fixture()
def jobs(jobs_server: FakeJobsServer) -> FakeJobsServer:
    jobs_server.servicer.reset()
    return jobs_server


def run(jobs: FakeJobsServer, *args: str, cwd: Path, env: dict[str, str] | None = None):
    return glmimage("jobs", *args, "--address", jobs.address, cwd=cwd, env=ALPHA if env is None else env)


def drive_when_watched(servicer: FakeJobService, steps: int = 2, end: str = "complete",
                       job_id: str | None = None) -> threading.Thread:
    """Once the CLI watches, run its job (the last submitted, unless named) through the queue, steps and end."""
    def go() -> None:
        wait_watching(servicer)
        target = job_id or servicer.last_job_id()
        for change in [lambda: servicer.queue_position(target, 2), lambda: servicer.start(target, steps),
                       *[lambda k=k: servicer.step(target, k) for k in range(1, steps + 1)]]:
            servicer.wait_sent(target)  # the client sees each state
            change()
        servicer.wait_sent(target)
        if end == "complete":
            servicer.complete(target)
        elif end == "fail":
            servicer.fail_job(target, "INVALID_ARGUMENT", "the prompt is refused", "prompt")
        else:
            servicer.cancel(target)

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    return thread


def test_submit_prints_the_job_id_and_sends_the_generation(jobs: FakeJobsServer, tmp_path: Path) -> None:
    (tmp_path / "ref.png").write_bytes(b"reference")
    out = run(jobs, "submit", "a red sign", "-n", "2", "--size", "512x256", "--seed", "4", "--format", "jpeg",
              "--lora", "tiny-style:0.8", "--priority", "batch", "--image", "ref.png",
              "--webhook-url", "https://hooks.example/done", "--idempotency-key", "order-1", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    (job_id,) = out.stdout.split()
    assert job_id == jobs.servicer.last_job_id()
    (call,) = jobs.servicer.calls
    assert call.metadata["authorization"] == "Bearer sk-alpha"
    r = call.request.request
    assert (r.prompt, r.n, r.width, r.height, r.seed) == ("a red sign", 2, 512, 256, 4)
    assert r.output_format == common_pb2.IMAGE_FORMAT_JPEG and r.priority == gateway_service_pb2.PRIORITY_BATCH
    assert [ref.data for ref in r.reference_images] == [b"reference"] and r.loras[0].name == "tiny-style"
    assert (call.request.webhook_url, call.request.idempotency_key) == ("https://hooks.example/done", "order-1")
    doc = json.loads(run(jobs, "submit", "again", "--json", cwd=tmp_path).stdout)
    assert doc["status"] == "queued" and doc["id"] == jobs.servicer.last_job_id() and doc["progress"] == {
        "queue_position": 1, "step": 0, "total_steps": 0}
    assert jobs.servicer.calls[-1].request.idempotency_key.startswith("sdk-")


def test_submit_wait_draws_progress_and_writes_the_images(jobs: FakeJobsServer, tmp_path: Path) -> None:
    driver = drive_when_watched(jobs.servicer, steps=4)
    out = run(jobs, "submit", "a cat", "-n", "2", "--seed", "3", "--wait", "-o", "out", cwd=tmp_path)
    driver.join()
    assert out.returncode == 0, out.stderr
    job_id = jobs.servicer.last_job_id()
    assert out.stderr.startswith(f"glmimage: submitted {job_id}\n")
    frames = [f.rstrip() for f in out.stderr.split("\n", 1)[1].split("\r") if f.strip()]
    assert frames[0] == f"{job_id} queued, queue position 1" and frames[1] == f"{job_id} queued, queue position 2"
    assert frames[-2].startswith("[" + "#" * 30 + "] 100%") and "4/4 steps" in frames[-2]
    assert frames[-1] == f"{job_id} completed"
    assert any(re.search(r"\] +50%  2/4 steps", f) for f in frames)
    files = sorted((tmp_path / "out").iterdir())
    assert [f.name for f in files] == ["image-0.png", "image-1.png"]
    assert [f.read_bytes() for f in files] == [fake_image("a cat", i, 3 + i) for i in range(2)]
    lines = out.stdout.splitlines()
    assert lines[0] == f"{job_id} completed"
    assert lines[1:3] == ["wrote out/image-0.png  (256x256, seed 3)", "wrote out/image-1.png  (256x256, seed 4)"]
    assert lines[3].startswith("usage: prompt_tokens=4 completion_tokens=20 total_tokens=24")
    # The bytes came over gRPC (GetJob include_images), the same key and channel, not from the file server.
    assert jobs.servicer.methods()[-1] == "GetJob" and jobs.servicer.calls[-1].request.include_images
    assert jobs.files.requests == []


def test_submit_refuses_to_overwrite_before_submitting(jobs: FakeJobsServer, tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "image-0.png").write_bytes(b"kept")
    out = run(jobs, "submit", "a cat", "-o", "out", cwd=tmp_path)
    assert out.returncode == 1 and "out/image-0.png exists; --force overwrites" in out.stderr
    assert jobs.servicer.calls == [] and (tmp_path / "out" / "image-0.png").read_bytes() == b"kept"


def test_wait_prints_the_image_urls(jobs: FakeJobsServer, tmp_path: Path) -> None:
    job_id = jobs.servicer.add("alpha", "done", n=2, status="completed")
    out = run(jobs, "wait", job_id, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[:3] == [
        f"{job_id} completed",
        f"image 0: {jobs.files.base_url}/files/{job_id}/0?sig=secret-0  (seed 1000)",
        f"image 1: {jobs.files.base_url}/files/{job_id}/1?sig=secret-1  (seed 1001)"]
    doc = json.loads(run(jobs, "wait", job_id, "--json", cwd=tmp_path).stdout)
    assert doc["status"] == "completed" and doc["files"] == []
    assert [im["url"] for im in doc["images"]] == [f"{jobs.files.base_url}/files/{job_id}/{i}?sig=secret-{i}"
                                                   for i in range(2)]
    assert doc["usage"]["total_tokens"] == 24 and doc["error"] is None


def test_wait_survives_a_broken_stream_and_fails_with_the_job(jobs: FakeJobsServer, tmp_path: Path) -> None:
    job_id = jobs.servicer.add("alpha", "refused")
    jobs.servicer.watch_breaks[:] = [1]  # the first watch breaks after one message: the CLI watches again

    def go() -> None:
        wait_watching(jobs.servicer)
        wait_watching(jobs.servicer)
        jobs.servicer.start(job_id, 2)
        jobs.servicer.fail_job(job_id, "INVALID_ARGUMENT", "the prompt is refused", "prompt")

    threading.Thread(target=go, daemon=True).start()
    out = run(jobs, "wait", job_id, "-o", "out", cwd=tmp_path)
    assert out.returncode == 1
    assert f"glmimage: error: job {job_id} failed: INVALID_ARGUMENT: prompt: the prompt is refused" in out.stderr
    assert jobs.servicer.methods().count("WatchJob") == 2 and not (tmp_path / "out").exists()


def test_a_cancelled_job_exits_1(jobs: FakeJobsServer, tmp_path: Path) -> None:
    driver = drive_when_watched(jobs.servicer, end="cancel")
    out = run(jobs, "submit", "never mind", "--wait", cwd=tmp_path)
    driver.join()
    assert out.returncode == 1 and f"job {jobs.servicer.last_job_id()} was cancelled" in out.stderr


def test_wait_timeout_says_the_job_goes_on(jobs: FakeJobsServer, tmp_path: Path) -> None:
    job_id = jobs.servicer.add("alpha", "slow")
    jobs.servicer.start(job_id, 10)
    jobs.servicer.step(job_id, 3)
    out = run(jobs, "wait", job_id, "--timeout", "0.5", cwd=tmp_path)
    assert out.returncode == 1
    assert f"glmimage: error: job {job_id} still in_progress (step 3/10) after 0.5s; it goes on" in out.stderr
    assert "3/10 steps" in out.stderr  # the progress drawn before it gave up


def test_get_shows_the_job(jobs: FakeJobsServer, tmp_path: Path) -> None:
    job_id = jobs.servicer.add("alpha", "shown", status="completed")
    out = run(jobs, "get", job_id, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    rows = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in out.stdout.splitlines())
    assert rows["id"] == job_id and rows["status"] == "completed" and rows["progress"] == "1 image"
    assert rows["created"] == "2023-11-14T22:13:21Z" and rows["attempts"] == "1" and rows["webhook"] == "-"
    assert rows["size"] == "256x256 png"
    assert rows["image 0"] == f"{jobs.files.base_url}/files/{job_id}/0?sig=secret-0  (seed 1000)"
    doc = json.loads(run(jobs, "get", job_id, "--json", cwd=tmp_path).stdout)
    assert (doc["id"], doc["created_at"], doc["finished_at"]) == (job_id, CREATED_AT + 1, CREATED_AT + 3)
    failed = jobs.servicer.add("alpha", "bad", status="failed")
    rows = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in run(jobs, "get", failed, cwd=tmp_path)
                .stdout.splitlines())
    assert rows["error"] == "INVALID_ARGUMENT: prompt: no" and rows["progress"] == "INVALID_ARGUMENT"


def test_relative_urls_are_shown_against_the_base_url(tmp_path: Path) -> None:
    with serve_fake_jobs(absolute_urls=False) as srv:
        job_id = srv.servicer.add("alpha", "rel", status="completed")
        out = glmimage("jobs", "get", job_id, "--address", srv.address, cwd=tmp_path, env=ALPHA)
        assert f"/files/{job_id}/0?sig=secret-0  (seed 1000)" in out.stdout and "http" not in out.stdout
        out = glmimage("jobs", "get", job_id, "--address", srv.address, cwd=tmp_path,
                       env={**ALPHA, "GLMIMAGE_BASE_URL": "http://front.example:8000"})
        assert f"http://front.example:8000/files/{job_id}/0?sig=secret-0" in out.stdout


def test_another_tenants_job_is_no_such_job(jobs: FakeJobsServer, tmp_path: Path) -> None:
    theirs = jobs.servicer.add("beta")
    for verb in ("get", "wait", "cancel"):
        out = run(jobs, verb, theirs, cwd=tmp_path)
        assert out.returncode == 1, out.stdout
        assert out.stderr.strip().splitlines()[-1] == f"glmimage: error: no such job (or not yours): {theirs}"
    assert jobs.servicer.job(theirs).status == 1, "still queued"


def test_cancel_prints_the_job_after_the_call(jobs: FakeJobsServer, tmp_path: Path) -> None:
    job_id = jobs.servicer.add("alpha")
    out = run(jobs, "cancel", job_id, cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == f"{job_id} cancelled"
    assert json.loads(run(jobs, "cancel", job_id, "--json", cwd=tmp_path).stdout)["status"] == "cancelled"


def test_list_prints_a_table_a_page_at_a_time(jobs: FakeJobsServer, tmp_path: Path) -> None:
    ids = [jobs.servicer.add("alpha", f"p{i}") for i in range(3)]
    jobs.servicer.add("beta")
    running = jobs.servicer.add("alpha", "running", status="in_progress")
    jobs.servicer.step(running, 2)
    done = jobs.servicer.add("alpha", "done", n=2, status="completed")
    out = run(jobs, "list", "--limit", "3", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["ID", "STATUS", "CREATED", "PROGRESS"]
    rows = [re.split(r"\s{2,}", line) for line in lines[1:]]
    assert [r[:2] for r in rows] == [[done, "completed"], [running, "in_progress"], [ids[2], "queued"]]
    assert [r[3] for r in rows] == ["2 images", "2/4 steps", "queue 1"]
    assert rows[0][2] == "2023-11-14T22:13:26Z"
    assert out.stderr.strip() == f"glmimage: more: glmimage jobs list --after {ids[2]}"
    rest = run(jobs, "list", "--limit", "3", "--after", ids[2], cwd=tmp_path)
    assert [ln.split()[0] for ln in rest.stdout.splitlines()[1:]] == [ids[1], ids[0]] and rest.stderr == ""
    every = run(jobs, "list", "--limit", "2", "--all", cwd=tmp_path)
    assert [ln.split()[0] for ln in every.stdout.splitlines()[1:]] == [done, running, *reversed(ids)]
    doc = json.loads(run(jobs, "list", "--status", "completed", "--json", cwd=tmp_path).stdout)
    assert [j["id"] for j in doc["jobs"]] == [done] and doc["has_more"] is False
    assert run(jobs, "list", cwd=tmp_path, env={"GLMIMAGE_API_KEY": "sk-beta"}).stdout.count("job_") == 1
    bad = run(jobs, "list", "--status", "running", cwd=tmp_path)
    assert bad.returncode == 2 and "--status" in bad.stderr
    assert run(jobs, "list", "--limit", "500", cwd=tmp_path).returncode == 1


def test_progress_column() -> None:
    def job(status: str, **kw) -> Job:
        return Job(id="job_x", status=status, created_at=0, **kw)

    assert [job_progress(j) for j in [
        job("queued", progress=JobProgress(queue_position=3)), job("queued"), job("in_progress"),
        job("in_progress", progress=JobProgress(step=1, total_steps=8)),
        job("completed", images=[JobImage(0, 1, "u")]),
        job("failed", error=JobError("DEADLINE_EXCEEDED", "too slow")), job("cancelled")]] == [
        "queue 3", "queued", "starting", "1/8 steps", "1 image", "DEADLINE_EXCEEDED", "-"]
    assert format_jobs([]) == "no jobs"
