"""The job clients (SDK, CLI, Node) against the real stack of `make run` (services.launcher: AR, a denoiser, a
gateway running jobs from its SQLite store, the REST front serving the image links), with a tenants file: submit,
wait, the images fetched from their URLs, cancel, pagination, another tenant's NOT_FOUND, and a wait that outlives
its connection (a cut through a proxy, then the gateway itself SIGKILLed and restarted by the launcher)."""
from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from glmimage import Client, GlmImageError, Job
from tests.support.cluster import launcher_child, running_stack
from tests.support.fake_jobs import tcp_proxy
from tests.support.net import free_port
from tests.support.programs import glmimage

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]
JOBS_JS = REPO / "clients" / "node" / "jobs.js"
TENANTS = """
[tenants.alpha]
keys = ["sk-alpha"]
[tenants.beta]
keys = ["sk-beta"]
[tenants.lister]
keys = ["sk-lister"]
"""
SIZE = "64x64"


@dataclass
class Stack:
    gateway: str
    rest: str
    launcher: subprocess.Popen

    def client(self, key: str = "sk-alpha", address: str | None = None, **kw) -> Client:
        return Client(address or self.gateway, api_key=key, timeout=120, **kw)


@pytest.fixture(scope="module")
def stack(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    run_dir = tmp_path_factory.mktemp("jobs-clients")
    tenants = run_dir / "tenants.toml"
    tenants.write_text(TENANTS)
    # A fixed REST port: the gateway's --public-url (the base of its absolute image links) names it. A short lease,
    # so a job whose gateway was killed is taken again within seconds.
    extra = ("--rest-port", str(free_port()), "--jobs-dir", str(run_dir / "jobs"), "--tenants", str(tenants),
             "--gateway-arg=--job-lease=2")
    with running_stack(run_dir, denoisers=1, extra_args=extra) as run:
        yield Stack(run.addresses["gateway"], run.addresses["rest"], run.proc)


def _png(data: bytes) -> tuple[str, tuple[int, int]]:
    from PIL import Image

    image = Image.open(io.BytesIO(data))
    image.load()
    return image.format, image.size


def test_submit_wait_and_the_urls_bytes_equal_the_synchronous_answer(stack: Stack, tmp_path: Path) -> None:
    seen: list[Job] = []
    with stack.client() as client:
        job = client.submit_job("a red STOP sign", n=2, size=SIZE, seed=11, steps=4)
        assert job.status == "queued" and job.id.startswith("job_") and job.n == 2
        done = client.wait(job, on_update=seen.append)
        sync = client.generate("a red STOP sign", n=2, size=SIZE, seed=11, steps=4)
        full = client.get_job(job.id, include_images=True)
    assert done.ok, done.error
    assert [j.status for j in seen][-1] == "completed"
    assert all(a.status != "completed" for a in seen[:-1])
    assert done.seeds == [11, 12] == sync.seeds and (done.width, done.height) == (64, 64)
    assert done.started_at and done.finished_at and done.expires_at and done.finished_at >= done.started_at
    assert done.usage is not None and done.usage.completion_tokens == sync.usage.completion_tokens
    # The links are absolute (the launcher gives the gateway --public-url) and served by the REST front.
    assert all(im.url.startswith(f"http://{stack.rest}/v1/images/files/") for im in done.images)
    fetched = done.fetch_images()
    assert fetched == sync.images == [im.data for im in full.images]
    assert [_png(b) for b in fetched] == [("PNG", (64, 64))] * 2
    paths = done.download(tmp_path)
    assert [p.read_bytes() for p in paths] == sync.images


def test_another_tenant_gets_not_found(stack: Stack) -> None:
    with stack.client("sk-alpha") as alpha, stack.client("sk-beta") as beta:
        job = alpha.submit_job("mine alone", size=SIZE, seed=1, steps=2)
        for call in (beta.get_job, beta.wait, beta.cancel_job):
            with pytest.raises(GlmImageError) as caught:
                call(job.id)
            assert caught.value.code == grpc.StatusCode.NOT_FOUND, call
        assert job.id not in {j.id for j in beta.iter_jobs()}
        assert alpha.wait(job).ok, "another tenant's cancel did nothing"
    cli = glmimage("jobs", "get", job.id, "--address", stack.gateway, cwd=REPO, env={"GLMIMAGE_API_KEY": "sk-beta"})
    assert cli.returncode == 1 and f"no such job (or not yours): {job.id}" in cli.stderr


def test_cancel_a_job(stack: Stack) -> None:
    with stack.client() as client:
        # Many steps, so it cannot end before the cancel: ended at once when queued, by its runner when running.
        job = client.submit_job("never mind", n=2, size=SIZE, seed=3, steps=200)
        after = client.cancel_job(job.id)
        assert after.status in ("cancelled", "in_progress"), after
        done = client.wait(job)
        assert done.status == "cancelled" and done.done and not done.ok and done.images == []
        assert client.cancel_job(job.id) == client.get_job(job.id), "an ended job is left as it is"


def test_list_pages_through_every_job(stack: Stack) -> None:
    with stack.client("sk-lister") as client:
        ids = [client.submit_job(f"page {i}", size=SIZE, seed=i, steps=2).id for i in range(5)]
        first = client.list_jobs(limit=2)
        assert [j.id for j in first.jobs] == ids[:-3:-1] and first.has_more
        second = client.list_jobs(limit=2, after=first.next_after)
        assert [j.id for j in second.jobs] == [ids[2], ids[1]] and second.has_more
        last = client.list_jobs(limit=2, after=second.next_after)
        assert [j.id for j in last.jobs] == [ids[0]] and not last.has_more
        assert [j.id for j in client.iter_jobs(page_size=2)] == list(reversed(ids))
        for job_id in ids:
            assert client.wait(job_id).ok
        assert [j.id for j in client.iter_jobs(status="completed", page_size=3)] == list(reversed(ids))
        assert client.list_jobs(status="queued").jobs == []


def test_wait_survives_a_cut_connection(stack: Stack) -> None:
    statuses: list[str] = []
    with tcp_proxy(stack.gateway) as proxy, stack.client(address=proxy.address) as client:
        job = client.submit_job("through a proxy", n=2, size=SIZE, seed=5, steps=150)
        cut = threading.Event()

        def update(j: Job) -> None:
            statuses.append(j.status)
            if j.status == "in_progress" and not cut.is_set():
                cut.set()
                assert proxy.drop() >= 2  # every connection of the channel, mid-watch

        done = client.wait(job, on_update=update)
        assert cut.is_set() and proxy.accepted >= 2, "the wait reconnected through the proxy"
    assert done.ok and statuses[-1] == "completed"


def test_wait_outlives_a_gateway_killed_and_restarted(stack: Stack) -> None:
    # The gateway holding both the watch and the job's lease SIGKILLed in the first half of the job: the launcher
    # restarts it on its port, its runner takes the job again once the (2 s) lease has lapsed, and the same wait,
    # watching again through the outage, sees it complete.
    killed: list[int] = []
    with stack.client() as client:
        job = client.submit_job("outlives its gateway", n=4, size=SIZE, seed=9, steps=200)

        def update(j: Job) -> None:
            p = j.progress
            if j.status == "in_progress" and 0 < p.step < p.total_steps // 2 and not killed:
                pid = launcher_child(stack.launcher.pid, "gateway")
                assert pid is not None
                os.kill(pid, signal.SIGKILL)
                killed.append(p.step)

        done = client.wait(job, on_update=update)
    assert killed, "the job went past half way before a watch saw it"
    assert done.ok and done.attempts >= 2, done
    assert [_png(b) for b in done.fetch_images()] == [("PNG", (64, 64))] * 4


def test_cli_submit_wait_writes_the_images(stack: Stack, tmp_path: Path) -> None:
    env = {"GLMIMAGE_API_KEY": "sk-alpha"}
    out = glmimage("jobs", "submit", "a cat", "-n", "2", "--size", SIZE, "--seed", "21", "--steps", "4", "--wait",
                   "-o", "out", "--address", stack.gateway, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr
    job_id = out.stdout.split()[0]
    assert out.stdout.startswith(f"{job_id} completed\nwrote out/image-0.png  (64x64, seed 21)")
    files = sorted((tmp_path / "out").iterdir())
    assert [_png(f.read_bytes()) for f in files] == [("PNG", (64, 64))] * 2
    listed = glmimage("jobs", "list", "--limit", "1", "--address", stack.gateway, cwd=tmp_path, env=env)
    assert listed.returncode == 0 and listed.stdout.splitlines()[1].split()[:2] == [job_id, "completed"]
    shown = glmimage("jobs", "get", job_id, "--json", "--address", stack.gateway, cwd=tmp_path, env=env)
    doc = json.loads(shown.stdout)
    assert doc["status"] == "completed" and len(doc["images"]) == 2
    with stack.client() as client:
        assert [f.read_bytes() for f in files] == client.get_job(job_id).fetch_images()


def test_node_submit_wait_gives_the_sdks_images(node: str, stack: Stack, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GLMIMAGE_")} | {"GLMIMAGE_API_KEY": "sk-alpha"}
    done = subprocess.run([node, str(JOBS_JS), "submit", "--prompt", "a fox", "--size", SIZE, "--seed", "4",
                           "--steps", "4", "--wait", "--out", str(tmp_path), "--address", stack.gateway],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["status"] == "completed" and report["files"] == [str(tmp_path / "image-0.png")]
    with stack.client() as client:
        sync = client.generate("a fox", size=SIZE, seed=4, steps=4)
        sdk = client.get_job(report["id"]).as_dict()

    def unsigned(doc: dict) -> dict:  # the links are signed anew at each call
        return {**doc, "images": [{k: v for k, v in im.items() if not k.startswith("url")} for im in doc["images"]]}

    assert unsigned({k: v for k, v in report.items() if k != "files"}) == unsigned(sdk)
    assert Path(report["files"][0]).read_bytes() == sync.images[0]
