"""Real processes for the job durability tests (issue 31's done-when: tests/test_jobs_durability.py,
tests/test_jobs_postgres_e2e.py): the launcher's stack with its job store, SIGKILLed whole or in part and started
again, a REST client that counts what it sends, and the store read directly (SQLite with sqlite3, PostgreSQL with
asyncpg) to show each job recorded once.

The launcher runs in a session of its own, so that "every process of the stack" is one process group: SIGKILL to
the group, and to every PID its --ready-file names, leaves nothing of it running to finish a job or write a row.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from glmimage.v1 import gateway_service_pb2 as pb
from tests.support.cluster import reap
from tests.support.waiting import until

# Importing torch in four or five processes at once on a loaded 2-core machine: a minute or more.
START_TIMEOUT_S = 240.0
GENERATIONS = "/v1/images/generations"
JOBS = "/v1/images/jobs"
ASYNC = {"Prefer": "respond-async"}
# A dead runner's jobs are taken over once their lease runs out: 3 s rather than 30, so takeovers come quickly.
LEASE_S = 3


def alive(pid: int) -> bool:
    """Running (a zombie is gone for this purpose: only its parent's reaping is left)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@dataclass
class Stack:
    """One `python -m services.launcher` run; ``argv`` starts the same stack again."""
    argv: list[str]
    run_dir: Path
    proc: subprocess.Popen
    log: Path

    @property
    def ready_file(self) -> Path:
        return self.run_dir / "ready.json"

    @property
    def addresses(self) -> dict:
        """The ready file as it is now (the launcher rewrites it with the new PID when it restarts a child)."""
        return json.loads(self.ready_file.read_text())

    @property
    def pids(self) -> dict[str, int]:
        return self.addresses["pids"]

    def rest(self) -> str:
        return f"http://{self.addresses['rest']}"

    def log_tail(self, chars: int = 6000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def kill_everything(self) -> list[int]:
        """SIGKILL to every process of the stack at once (the launcher's process group and each PID of its ready
        file); returns once none of them is running. The PIDs killed."""
        pids = [self.proc.pid, *(self.pids.values() if self.ready_file.exists() else ())]
        pids += [p.pid for p in _descendants(self.proc.pid)]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(30)
        until(lambda: not any(alive(pid) for pid in pids), 30, "every process of the stack to be gone", step=0.05)
        return sorted(set(pids))

    def stop(self) -> int:
        """SIGTERM, as Ctrl-C: the launcher stops every child; its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return reap(self.proc, 60)


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def launcher_argv(run_dir: Path, jobs_dir: Path, rest_port: int, *extra: str, denoisers: int = 1) -> list[str]:
    """The launcher's command line: ephemeral ports but the REST front's, fixed as make run's is, so that the stack
    started again answers where the client polls; the gateway's /metrics on; job leases of LEASE_S."""
    return [sys.executable, "-m", "services.launcher", "--rest-port", str(rest_port), "--gateway-port", "0",
            "--gateway-metrics-port", "0", "--ar-port", "0", "--denoiser-ports", ",".join(["0"] * denoisers),
            "--ready-file", str(run_dir / "ready.json"), "--log-level", "INFO", "--jobs-dir", str(jobs_dir),
            f"--gateway-arg=--job-lease={LEASE_S}", *extra]


def start(argv: list[str], run_dir: Path) -> Stack:
    """``argv`` (a launcher_argv) started in a session of its own, returned once its ready file is written (every
    server SERVING). Its log, every child's included, is appended to run_dir/launcher.log."""
    ready, log = run_dir / "ready.json", run_dir / "launcher.log"
    ready.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("GLMIMAGE_API_KEYS", "GLMIMAGE_ADMIN_KEYS")}
    with log.open("ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    stack = Stack(argv, run_dir, proc, log)
    try:
        until(lambda: ready.exists() or proc.poll() is not None, START_TIMEOUT_S, "the launcher's ready file",
              step=0.1)
        assert proc.poll() is None, f"the launcher exited with {proc.returncode}:\n{stack.log_tail()}"
    except BaseException:
        stack.kill_everything()
        raise
    return stack


@contextlib.contextmanager
def running(argv: list[str], run_dir: Path) -> Iterator[Stack]:
    """start(), and on the way out a clean stop (SIGTERM; the test checks its exit code), then SIGKILL to anything
    of its process group still there."""
    stack = start(argv, run_dir)
    try:
        yield stack
    finally:
        if stack.proc.poll() is None:
            stack.proc.send_signal(signal.SIGCONT)  # a stopped launcher cannot act on SIGTERM
            stack.stop()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(stack.proc.pid, signal.SIGKILL)


# ---- the client ------------------------------------------------------------------------------------------------

@dataclass
class JobClient:
    """REST calls to one or more fronts, counting every request sent by method: the test shows that no job was
    submitted twice (no POST beyond the submissions)."""
    timeout: float = 30.0
    sent: Counter = field(default_factory=Counter)

    def __post_init__(self) -> None:
        def count(request: httpx.Request) -> None:
            self.sent[request.method] += 1

        self._http = httpx.Client(timeout=self.timeout, event_hooks={"request": [count]})

    def close(self) -> None:
        self._http.close()

    def submit(self, base: str, body: dict) -> str:
        """POST with Prefer: respond-async: 202, the job queued, its Location; the job's id."""
        r = self._http.post(base + GENERATIONS, json=body, headers=ASYNC)
        assert r.status_code == 202, (r.status_code, r.text)
        job = r.json()
        assert r.headers["location"] == f"{JOBS}/{job['id']}" and job["status"] == "queued", (r.headers, job)
        return job["id"]

    def jobs(self, base: str) -> dict[str, dict]:
        """Every job of the caller's tenant, by id (GET /v1/images/jobs, every page)."""
        found: dict[str, dict] = {}
        after = None
        while True:
            r = self._http.get(base + JOBS, params={"limit": 100, **({"after": after} if after else {})})
            assert r.status_code == 200, (r.status_code, r.text)
            page = r.json()
            found.update((job["id"], job) for job in page["data"])
            if not page["has_more"]:
                return found
            after = page["last_id"]

    def job(self, base: str, job_id: str) -> dict:
        r = self._http.get(f"{base}{JOBS}/{job_id}")
        assert r.status_code == 200, (r.status_code, r.text)
        return r.json()

    def get(self, url: str) -> httpx.Response:
        return self._http.get(url)

    def wait_all_completed(self, base_of, ids: Iterable[str], timeout: float) -> dict[str, dict]:
        """Poll the job list until every job in ``ids`` is completed (one failed or cancelled fails at once);
        ``base_of()`` names the front to ask each time (it may be down a while: a restart). The jobs."""
        ids = set(ids)
        seen: dict[str, dict] = {}

        def done() -> bool:
            try:
                listed = self.jobs(base_of())
            except (httpx.TransportError, AssertionError, OSError, ValueError):
                return False  # the front or its gateway is down (being restarted): ask again
            seen.update(listed)
            ended = {i: listed[i]["status"] for i in ids & listed.keys()
                     if listed[i]["status"] in ("failed", "cancelled")}
            assert not ended, f"jobs ended otherwise than completed: {ended}: {[listed[i] for i in ended]}"
            return all(listed.get(i, {}).get("status") == "completed" for i in ids)

        try:
            until(done, timeout, "every job to complete", step=0.25)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; last seen: {Counter(j['status'] for j in seen.values())}") from None
        return {i: seen[i] for i in ids}


def body(seed: int, n: int, steps: int, size: int = 256) -> dict:
    return {"prompt": f"durable job {seed}", "n": n, "size": f"{size}x{size}", "num_inference_steps": steps,
            "seed": seed}


# ---- the store, read directly ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Row:
    id: str
    status: str
    n: int
    attempts: int
    lease_owner: str | None
    step: int
    total_steps: int
    result_keys: tuple[str, ...]  # the object keys the recorded result names (GeneratedImage.url)

    def owner_pid(self) -> int | None:
        """The PID in the lease owner (runner ids are HOST:PID:NONCE), if the job is leased."""
        return int(self.lease_owner.rsplit(":", 2)[1]) if self.lease_owner else None

    @property
    def denoising(self) -> bool:
        """In progress and partway through its steps (progress the runner wrote with a renewal)."""
        return self.status == "in_progress" and 0 < self.step < self.total_steps


@dataclass(frozen=True)
class StoreView:
    jobs: dict[str, Row]
    objects: list[tuple[str, str | None]]  # (key, job_id), every row of the objects table

    def statuses(self) -> Counter:
        return Counter(r.status for r in self.jobs.values())


def _row(id_: str, status: str, n: int, attempts: int, owner: str | None, step: int, total: int,
         result: bytes | None) -> Row:
    keys = tuple(img.url for img in pb.GenerateImagesResponse.FromString(result).images) if result else ()
    return Row(id_, status, n, attempts, owner, step, total, keys)


_JOBS_SQL = "SELECT id, status, n, attempts, lease_owner, step, total_steps, result FROM jobs"
_OBJECTS_SQL = "SELECT key, job_id FROM objects"


def read_sqlite(path: Path) -> StoreView:
    """The SQLite job store's jobs and objects tables, read with sqlite3 (read-only; WAL lets the gateway write
    meanwhile)."""
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)) as db:
        jobs = {r[0]: _row(*r) for r in db.execute(_JOBS_SQL)}
        objects = [(k, j) for k, j in db.execute(_OBJECTS_SQL)]
    return StoreView(jobs, objects)


def read_postgres(dsn: str) -> StoreView:
    """The PostgreSQL job store's jobs and objects tables, read with asyncpg."""
    import asyncpg

    async def read() -> StoreView:
        conn = await asyncpg.connect(dsn)
        try:
            jobs = {r["id"]: _row(*r.values()) for r in await conn.fetch(_JOBS_SQL)}
            objects = [(r["key"], r["job_id"]) for r in await conn.fetch(_OBJECTS_SQL)]
        finally:
            await conn.close()
        return StoreView(jobs, objects)

    return asyncio.run(read())


def assert_recorded_once(view: StoreView, ids: Iterable[str], images_dir: Path) -> None:
    """Exactly these jobs in the store, each completed with one recorded result of n images, and the objects table
    holding exactly those images (each once, each of its job) whose files exist: no job lost, none recorded twice."""
    ids = set(ids)
    assert set(view.jobs) == ids, f"store rows {len(view.jobs)} != jobs submitted {len(ids)}"
    problems = {i: r for i, r in view.jobs.items()
                if r.status != "completed" or r.attempts < 1 or r.lease_owner is not None
                or len(r.result_keys) != r.n or len(set(r.result_keys)) != r.n}
    assert not problems, f"jobs not recorded once: {problems}"
    keys = [k for k, _ in view.objects]
    assert len(keys) == len(set(keys)), f"an object row twice: {[k for k, c in Counter(keys).items() if c > 1]}"
    recorded = {k: r.id for r in view.jobs.values() for k in r.result_keys}
    assert len(recorded) == sum(r.n for r in view.jobs.values()), "two jobs' results name the same image"
    assert dict(view.objects) == recorded, "the objects table is not exactly the recorded results' images"
    missing = [k for k in recorded if not (images_dir / k).is_file()]
    assert not missing, f"recorded images without their file: {missing}"

