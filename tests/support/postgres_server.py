"""A real PostgreSQL server (Debian's package, which `make tools` installs) for the job store's tests: a fresh cluster
in a temporary directory on a free 127.0.0.1 port, its unix socket in that directory too, fsync off (nothing in it
outlives the test), ready once pg_isready says it accepts connections. Missing binaries: the test fails and says how
to install them, as tests/support/redis_server.py does for redis-server.

PostgreSQL refuses to run as root, so as root the cluster belongs to the `postgres` user the Debian package creates
(or `nobody`), and initdb and postgres run as that user. TCP connections authenticate with a password (scram), so the
DSN carries one, as a production DSN does; the local socket trusts.
"""
from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.support.net import free_port

START_TIMEOUT = 60.0
STOP_TIMEOUT = 15.0
USER, PASSWORD = "glmimage", "test-pw-not-secret"
INSTALL_HINT = ("PostgreSQL's server binaries (initdb, postgres, pg_isready) not found. They come from the Debian "
                "package `postgresql`: `make tools` installs it (as root), or `apt-get install -y postgresql`")


def postgres_bin_dir() -> Path:
    """The newest /usr/lib/postgresql/VERSION/bin (Debian keeps them off PATH), else the directory of PATH's initdb."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    initdb = found[-1] if found else shutil.which("initdb")
    if initdb is None:
        pytest.fail(INSTALL_HINT)
    bin_dir = Path(initdb).parent
    for tool in ("postgres", "pg_isready"):
        if not (bin_dir / tool).is_file():
            pytest.fail(f"{INSTALL_HINT} ({bin_dir / tool} is missing)")
    return bin_dir


def _run_as() -> pwd.struct_passwd | None:
    """The user to run the server as: None (ourselves) unless we are root."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    pytest.fail("running as root, and neither a `postgres` nor a `nobody` user exists to run PostgreSQL as")


@dataclass
class PostgresServer:
    port: int
    dir: Path
    bin_dir: Path
    proc: subprocess.Popen = field(repr=False)
    user: pwd.struct_passwd | None = field(repr=False, default=None)

    @property
    def socket_dir(self) -> Path:
        return self.dir / "socket"

    def dsn(self, database: str = "postgres") -> str:
        return f"postgresql://{USER}:{urllib.parse.quote(PASSWORD)}@127.0.0.1:{self.port}/{database}"

    def ready(self) -> bool:
        done = subprocess.run([str(self.bin_dir / "pg_isready"), "-q", "-h", "127.0.0.1", "-p", str(self.port),
                               "-U", USER, "-d", "postgres", "-t", "2"], check=False, capture_output=True)
        return done.returncode == 0

    def log_tail(self) -> str:
        return (self.dir / "postgres.log").read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # "fast" shutdown: ends sessions, checkpoints, exits
            try:
                self.proc.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=STOP_TIMEOUT)


def _as_user(user: pwd.struct_passwd | None) -> dict:
    if user is None:
        return {}
    return {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}


@contextmanager
def running_postgres() -> Iterator[PostgresServer]:
    """A fresh PostgreSQL cluster and server, stopped and deleted on the way out."""
    bin_dir = postgres_bin_dir()
    user = _run_as()
    # Not pytest's tmp_path: as root that lies under a 0700 directory the server's user cannot enter.
    directory = Path(tempfile.mkdtemp(prefix="glmimage-pg-"))
    try:
        data, socket_dir = directory / "data", directory / "socket"
        socket_dir.mkdir()
        (directory / "pwfile").write_text(PASSWORD + "\n")
        if user is not None:
            for p in (directory, socket_dir, directory / "pwfile"):
                os.chown(p, user.pw_uid, user.pw_gid)
        env = {**os.environ, "LC_ALL": "C"}
        init = subprocess.run(
            [str(bin_dir / "initdb"), "-D", str(data), "-U", USER, "--pwfile", str(directory / "pwfile"),
             "--auth-local", "trust", "--auth-host", "scram-sha-256", "-E", "UTF8", "--locale", "C", "--no-sync"],
            cwd=directory, env=env, capture_output=True, text=True, check=False, timeout=START_TIMEOUT,
            **_as_user(user))
        if init.returncode != 0:
            pytest.fail(f"initdb exited with {init.returncode}:\n{init.stdout[-2000:]}\n{init.stderr[-2000:]}")
        port = free_port()
        with open(directory / "postgres.log", "ab") as log:  # the child keeps its own copy of the descriptor
            proc = subprocess.Popen(
                [str(bin_dir / "postgres"), "-D", str(data), "-p", str(port), "-c", "listen_addresses=127.0.0.1",
                 "-c", f"unix_socket_directories={socket_dir}", "-c", "fsync=off", "-c", "synchronous_commit=off",
                 "-c", "full_page_writes=off", "-c", "max_connections=100", "-c", "shared_buffers=32MB"],
                cwd=directory, env=env, stdout=log, stderr=subprocess.STDOUT, **_as_user(user))
        server = PostgresServer(port, directory, bin_dir, proc, user)
        try:
            deadline = time.monotonic() + START_TIMEOUT
            while not server.ready():
                if proc.poll() is not None:
                    pytest.fail(f"postgres exited with {proc.returncode} before accepting connections:\n"
                                f"{server.log_tail()}")
                if time.monotonic() > deadline:
                    pytest.fail(f"postgres on port {port} did not accept connections within {START_TIMEOUT}s:\n"
                                f"{server.log_tail()}")
                time.sleep(0.05)
            yield server
        finally:
            server.stop()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
