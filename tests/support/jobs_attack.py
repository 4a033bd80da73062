"""Real processes for the attacker tests of jobs (tests/test_jobs_attack.py): the simulated workers of
bench/sim_backends.py, a `python -m gateway` with jobs on, a `python -m rest` in front of it, and a
PostgreSQL job store that can be hung (SIGSTOP), killed (SIGKILL) and started again on the same port and data.

No model anywhere: the simulated workers answer with a tiny PNG after a sleep from their cost model, so a gateway
and its front start in a few seconds and a job takes milliseconds (or seconds, with a larger ``scale``).
Everything waits on a port file, a health status or a condition; nothing sleeps for correctness.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from tests.support.cluster import reap, wait_serving
from tests.support.postgres_server import START_TIMEOUT, PostgresServer, _as_user, running_postgres
from tests.support.waiting import until

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 120.0  # a fresh interpreter importing grpc (and FastAPI) on a loaded 2-core machine
JOB_SERVICE = "glmimage.v1.JobService"


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    # Keys from the developer's shell must not turn auth on (or off) behind the test's back.
    env = {k: v for k, v in os.environ.items()
           if k not in ("GLMIMAGE_API_KEYS", "GLMIMAGE_ADMIN_KEYS", "GLMIMAGE_STATUS_KEYS", "GLMIMAGE_JOBS_DB")}
    return {**env, **(extra or {})}


@dataclass
class Process:
    """A server process of the test's: its log file, its address once bound, stopped on the way out."""
    name: str
    popen: subprocess.Popen
    log: Path
    port: int = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
        reap(self.popen, 30)


def _spawn(name: str, argv: list[str], run_dir: Path, env: dict[str, str] | None = None) -> Process:
    log = run_dir / f"{name}.log"
    with log.open("ab") as out:  # the child keeps its own copy of the descriptor
        popen = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 env=_env(env))
    return Process(name, popen, log)


def _wait_file(proc: Process, path: Path) -> str:
    until(lambda: path.exists() or proc.popen.poll() is not None, START_TIMEOUT_S, f"{proc.name}'s {path.name}",
          step=0.05)
    assert proc.popen.poll() is None, f"{proc.name} exited with {proc.popen.returncode}:\n{proc.log_text()[-4000:]}"
    return path.read_text()


@dataclass
class SimWorkers:
    process: Process
    ar: list[str]
    denoisers: list[str]

    @property
    def addresses(self) -> list[str]:
        return [*self.ar, *self.denoisers]


@contextlib.contextmanager
def sim_workers(run_dir: Path, name: str = "sim", denoisers: int = 2, scale: float = 0.001) -> Iterator[SimWorkers]:
    """One simulated AR and ``denoisers`` simulated denoisers in one process (``scale`` times the reference
    costs: 0.001 is a job of a few tens of milliseconds, 0.1 one of about three seconds)."""
    ready = run_dir / f"{name}.json"
    ready.unlink(missing_ok=True)
    proc = _spawn(name, [sys.executable, "-m", "bench.sim_backends", "--ar", "1", "--denoisers", str(denoisers),
                         "--scale", str(scale), "--ready-file", str(ready)], run_dir)
    try:
        found = json.loads(_wait_file(proc, ready))
        yield SimWorkers(proc, found["ar"], found["denoisers"])
    finally:
        proc.stop()


@dataclass
class GatewayFiles:
    """What a jobs gateway and its REST front share: the image store and the URL secret (and the webhook master
    secret, the gateway's alone)."""
    images: Path
    url_secret: Path
    webhook_secret: Path

    @classmethod
    def make(cls, run_dir: Path) -> GatewayFiles:
        files = cls(run_dir / "images", run_dir / "url-secret", run_dir / "webhook-secret")
        files.url_secret.write_text(os.urandom(32).hex() + "\n")
        files.webhook_secret.write_text(os.urandom(32).hex() + "\n")
        files.url_secret.chmod(0o600)
        files.webhook_secret.chmod(0o600)
        return files


@contextlib.contextmanager
def jobs_gateway(run_dir: Path, name: str, workers: SimWorkers, jobs_db: str, files: GatewayFiles,
                 *flags: str, env: dict[str, str] | None = None) -> Iterator[Process]:
    """``python -m gateway`` over ``workers`` with jobs in ``jobs_db``, yielded once JobService is SERVING (its
    runner started, every worker answered a first health check)."""
    port_file = run_dir / f"{name}.port"
    port_file.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "gateway", "--port", "0", "--port-file", str(port_file), "--log-level", "INFO",
            *(f"--ar={a}" for a in workers.ar), *(f"--denoiser={d}" for d in workers.denoisers),
            "--jobs-db", jobs_db, "--image-store", str(files.images), "--url-secret-file", str(files.url_secret),
            "--webhook-secret-file", str(files.webhook_secret), "--drain-seconds", "2", *flags]
    proc = _spawn(name, argv, run_dir, env)
    try:
        proc.port = int(_wait_file(proc, port_file))
        wait_serving(proc.address, JOB_SERVICE, START_TIMEOUT_S)
        yield proc
    finally:
        proc.stop()


@contextlib.contextmanager
def rest_front(run_dir: Path, gateway: Process, files: GatewayFiles, *flags: str) -> Iterator[Process]:
    """``python -m rest`` over ``gateway``, serving the same image store; yielded once it listens."""
    port_file = run_dir / "rest.port"
    port_file.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "rest", "--port", "0", "--port-file", str(port_file),
            "--gateway-address", gateway.address, "--image-store", str(files.images), "--url-secret-file",
            str(files.url_secret), "--log-level", "info", *flags]
    proc = _spawn("rest", argv, run_dir)
    try:
        proc.port = int(_wait_file(proc, port_file))
        yield proc
    finally:
        proc.stop()


# ---- a PostgreSQL that can be hung, killed and started again -------------------------------------------------

def _alive(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@dataclass
class Postgres:
    """A real PostgreSQL (tests/support/postgres_server.py's cluster) whose process tree the test signals. It runs
    with durable commits (synchronous_commit on): a submit the gateway answered must survive a SIGKILL of every
    server process, as it does in production (fsync stays off: the machine itself does not crash)."""
    server: PostgresServer
    processes: list[psutil.Process] = field(default_factory=list)

    def dsn(self) -> str:
        return self.server.dsn()

    def _start(self) -> None:
        s = self.server
        with open(s.dir / "postgres.log", "ab") as log:
            s.proc = subprocess.Popen(
                [str(s.bin_dir / "postgres"), "-D", str(s.dir / "data"), "-p", str(s.port), "-c",
                 "listen_addresses=127.0.0.1", "-c", f"unix_socket_directories={s.socket_dir}", "-c", "fsync=off",
                 "-c", "max_connections=100", "-c", "shared_buffers=32MB"],
                cwd=s.dir, env={**os.environ, "LC_ALL": "C"}, stdout=log, stderr=subprocess.STDOUT,
                **_as_user(s.user))
        until(lambda: s.ready() or s.proc.poll() is not None, START_TIMEOUT, "postgres to accept connections",
              step=0.05)
        assert s.proc.poll() is None, f"postgres exited with {s.proc.returncode}:\n{s.log_tail()}"

    def tree(self) -> list[psutil.Process]:
        """The postmaster and every backend and auxiliary process it forked."""
        root = psutil.Process(self.server.proc.pid)
        return [root, *root.children(recursive=True)]

    def _signal(self, sig: int, processes: Iterable[psutil.Process]) -> None:
        for p in processes:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(sig)

    def hang(self) -> None:
        """SIGSTOP to every server process: connections stay open, nothing answers (a hung host)."""
        self.processes = self.tree()
        self._signal(signal.SIGSTOP, self.processes)

    def kill(self) -> None:
        """SIGKILL to every server process (stopped ones too), returning once none is left."""
        victims = self.processes or self.tree()
        self._signal(signal.SIGKILL, victims)
        self._signal(signal.SIGCONT, victims)
        self.server.proc.wait(30)
        until(lambda: not any(_alive(p) for p in victims), 30, "every postgres process to be gone", step=0.05)
        self.processes = []

    def restart(self) -> None:
        """The server again on the same port and data directory (crash recovery replays the WAL)."""
        self._start()


@contextlib.contextmanager
def durable_postgres() -> Iterator[Postgres]:
    with running_postgres() as server:
        server.stop()  # started with synchronous_commit off: again with durable commits, same cluster and port
        pg = Postgres(server)
        pg._start()
        try:
            yield pg
        finally:
            if pg.processes:  # a failure left it stopped: a stopped server never stops by itself
                pg._signal(signal.SIGCONT, pg.processes)


# ---- what no answer may carry -------------------------------------------------------------------------------

_ADDRESS_RE = re.compile(r"(?:127\.0\.0\.1|localhost|\[::1\]):(\d+)")


def leaks(text: str, internal_ports: Iterable[int], paths: Iterable[Path | str] = ()) -> list[str]:
    """What ``text`` (an error message, a response body) gives away that a client must never see: a stack
    trace, a file-system path, an internal server's loopback address."""
    found = []
    if "Traceback" in text or 'File "' in text:
        found.append("a stack trace")
    for marker in (*(str(p) for p in paths), "/tmp/", "/root/", "/home/", "/work/", "/usr/", "site-packages",
                   ".py\"", ".py:", "sqlite3", "postgresql://"):
        if marker and marker in text:
            found.append(f"a path or DSN ({marker!r})")
    ports = set(internal_ports)
    found += [f"an internal address ({m.group(0)})" for m in _ADDRESS_RE.finditer(text) if int(m.group(1)) in ports]
    return found
