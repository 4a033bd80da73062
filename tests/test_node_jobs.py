"""The Node client's jobs (clients/node/jobs.js) against the scripted JobService (tests/support/fake_jobs.py): the
same verbs and the same job JSON as the Python SDK, and a wait that watches again after a broken stream or a cut
connection."""
from __future__ import annotations

import json
import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from glmimage import Client
from glmimage.v1 import gateway_service_pb2
from tests.support.fake_gateway import fake_image
from tests.support.fake_jobs import FakeJobService, FakeJobsServer, serve_fake_jobs, tcp_proxy, wait_watching

JOBS_JS = Path(__file__).resolve().parents[1] / "clients" / "node" / "jobs.js"


@pytest.fixture(scope="module")
def jobs_server() -> Iterator[FakeJobsServer]:
    with serve_fake_jobs() as srv:
        yield srv


@pytest.fixture()
def jobs(jobs_server: FakeJobsServer) -> FakeJobsServer:
    jobs_server.servicer.reset()
    return jobs_server


def node_jobs(node: str, address: str, *args: str, key: str | None = "sk-alpha",
              cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GLMIMAGE_")}
    if key:
        env["GLMIMAGE_API_KEY"] = key
    # Bytes, decoded here: text mode would turn the progress line's carriage returns into newlines.
    done = subprocess.run([node, str(JOBS_JS), *args, "--address", address], capture_output=True, timeout=120,
                          env=env, cwd=cwd)
    return subprocess.CompletedProcess(done.args, done.returncode, done.stdout.decode(), done.stderr.decode())


def drive(servicer: FakeJobService, steps: int = 2, end: str = "complete", watches: int = 1) -> threading.Thread:
    """Once the client has begun ``watches`` WatchJob calls, run the last job through its steps to its end, each
    state sent before the next is made."""
    def go() -> None:
        for _ in range(watches):
            wait_watching(servicer)
        job_id = servicer.last_job_id()
        for change in [lambda: servicer.start(job_id, steps),
                       *[lambda k=k: servicer.step(job_id, k) for k in range(1, steps + 1)]]:
            servicer.wait_sent(job_id)
            change()
        servicer.wait_sent(job_id)
        if end == "complete":
            servicer.complete(job_id)
        else:
            servicer.fail_job(job_id, "INVALID_ARGUMENT", "the prompt is refused", "prompt")

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    return thread


def test_submit_sends_the_generation_and_prints_the_sdks_job(node: str, jobs: FakeJobsServer, tmp_path: Path) -> None:
    (tmp_path / "ref.png").write_bytes(b"reference")
    done = node_jobs(node, jobs.address, "submit", "--prompt", "a red sign", "-n", "2", "--size", "512x256",
                     "--seed", "4", "--priority", "batch", "--lora", "tiny-style:0.5", "--image", "ref.png",
                     "--webhook-url", "https://hooks.example/x", "--idempotency-key", "k-1", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout)
    (call,) = jobs.servicer.calls
    assert call.metadata["authorization"] == "Bearer sk-alpha"
    r = call.request.request
    assert (r.prompt, r.n, r.width, r.height, r.seed) == ("a red sign", 2, 512, 256, 4)
    assert r.priority == gateway_service_pb2.PRIORITY_BATCH and [lr.name for lr in r.loras] == ["tiny-style"]
    assert [ref.data for ref in r.reference_images] == [b"reference"]
    assert (call.request.webhook_url, call.request.idempotency_key) == ("https://hooks.example/x", "k-1")
    with Client(jobs.address, api_key="sk-alpha", timeout=10) as client:
        assert printed == client.get_job(printed["id"]).as_dict()  # the same JSON as the Python SDK's
        jobs.servicer.start(printed["id"])
        jobs.servicer.complete(printed["id"])
        completed = node_jobs(node, jobs.address, "get", printed["id"])
        assert json.loads(completed.stdout) == client.get_job(printed["id"]).as_dict()
    again = node_jobs(node, jobs.address, "submit", "--prompt", "plain")
    assert jobs.servicer.calls[-1].request.idempotency_key.startswith("node-"), again.stderr


def test_submit_wait_writes_the_images_and_draws_progress(node: str, jobs: FakeJobsServer, tmp_path: Path) -> None:
    driver = drive(jobs.servicer, steps=2)
    done = node_jobs(node, jobs.address, "submit", "--prompt", "a cat", "-n", "2", "--seed", "3", "--wait",
                     "--out", str(tmp_path / "out"))
    driver.join()
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["status"] == "completed" and report["files"] == [str(tmp_path / "out" / f"image-{i}.png")
                                                                    for i in range(2)]
    assert [Path(f).read_bytes() for f in report["files"]] == [fake_image("a cat", i, 3 + i) for i in range(2)]
    frames = [f.rstrip() for f in done.stderr.split("\n", 1)[1].split("\r") if f.strip()]
    job_id = report["id"]
    assert frames[0] == f"{job_id} queued, queue position 1"
    assert "[###############---------------]  50%  1/2 steps" in frames
    assert frames[-1] == f"{job_id} completed"


def test_wait_watches_again_after_a_broken_stream_and_a_cut(node: str, jobs: FakeJobsServer) -> None:
    job_id = jobs.servicer.add("alpha", "on and off")
    jobs.servicer.watch_breaks[:] = [1]  # the first watch breaks after one message

    def go() -> None:
        wait_watching(jobs.servicer)
        wait_watching(jobs.servicer)  # watched again
        jobs.servicer.start(job_id, 2)
        jobs.servicer.wait_sent(job_id)
        assert proxy.drop() >= 2  # and a real cut of the connection under the second watch
        wait_watching(jobs.servicer)
        jobs.servicer.complete(job_id)

    with tcp_proxy(jobs.address) as proxy:
        thread = threading.Thread(target=go, daemon=True)
        thread.start()
        done = node_jobs(node, proxy.address, "wait", job_id)
        thread.join(10)
        assert proxy.accepted >= 2
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["status"] == "completed"
    assert jobs.servicer.methods().count("WatchJob") == 3
    assert done.stderr.count("watching again") == 2


def test_a_failed_job_and_a_timeout_exit_1(node: str, jobs: FakeJobsServer) -> None:
    driver = drive(jobs.servicer, end="fail")
    done = node_jobs(node, jobs.address, "submit", "--prompt", "refused", "--wait")
    driver.join()
    assert done.returncode == 1
    assert "job_" in done.stderr and "failed: INVALID_ARGUMENT: prompt: the prompt is refused" in done.stderr
    assert json.loads(done.stdout)["error"]["field"] == "prompt"
    slow = jobs.servicer.add("alpha", "slow")
    jobs.servicer.start(slow, 9)
    timed = node_jobs(node, jobs.address, "wait", slow, "--timeout", "0.5")
    assert timed.returncode == 1 and f"jobs.js: job {slow} still in_progress after 0.5s; it goes on" in timed.stderr


def test_another_tenants_job_is_no_such_job(node: str, jobs: FakeJobsServer) -> None:
    theirs = jobs.servicer.add("beta")
    for verb in ("get", "wait", "cancel"):
        done = node_jobs(node, jobs.address, verb, theirs)
        assert done.returncode == 1 and done.stderr.strip().endswith(f"no such job (or not yours): {theirs}"), verb
    assert jobs.servicer.job(theirs).status == 1, "still queued"


def test_cancel_list_and_the_webhook_secret(node: str, jobs: FakeJobsServer) -> None:
    ids = [jobs.servicer.add("alpha", f"p{i}") for i in range(3)]
    jobs.servicer.add("beta")
    cancelled = json.loads(node_jobs(node, jobs.address, "cancel", ids[0]).stdout)
    assert cancelled["status"] == "cancelled" and cancelled["finished_at"]
    page = json.loads(node_jobs(node, jobs.address, "list", "--limit", "2").stdout)
    assert [j["id"] for j in page["jobs"]] == [ids[2], ids[1]] and page["has_more"] is True
    rest = json.loads(node_jobs(node, jobs.address, "list", "--limit", "2", "--after", ids[1]).stdout)
    assert [j["id"] for j in rest["jobs"]] == [ids[0]] and rest["has_more"] is False
    every = json.loads(node_jobs(node, jobs.address, "list", "--limit", "1", "--all").stdout)
    assert [j["id"] for j in every["jobs"]] == list(reversed(ids)) and every["has_more"] is False
    only = json.loads(node_jobs(node, jobs.address, "list", "--status", "cancelled").stdout)
    assert [j["id"] for j in only["jobs"]] == [ids[0]]
    assert json.loads(node_jobs(node, jobs.address, "webhook-secret", key="sk-beta").stdout) == {
        "secret": "whsec_beta"}
    for bad in (["list", "--status", "running"], ["list", "--limit", "0"], ["get"], ["frobnicate"],
                ["submit", "--prompt", "p", "--priority", "urgent"]):
        refused = node_jobs(node, jobs.address, *bad)
        assert refused.returncode == 2, (bad, refused.stderr)
