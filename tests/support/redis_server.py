"""A real redis-server (Debian's package, which `make tools` installs) on a free 127.0.0.1 port, for the quota store's
tests: no persistence, its files in a temporary directory, ready once it answers PING. Missing: the test fails and
says how to install it, as tests/test_promtool.py does for promtool."""
from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.support.net import free_port

START_TIMEOUT = 30.0
DEBIAN_PATH = Path("/usr/bin/redis-server")  # where the package puts it, for a PATH without /usr/bin


def redis_server_binary() -> str:
    found = shutil.which("redis-server") or (str(DEBIAN_PATH) if DEBIAN_PATH.is_file() else None)
    if found is None:
        pytest.fail("redis-server not found. It comes from the Debian package `redis-server`: `make tools` installs "
                    "it (as root), or `apt-get install -y redis-server`")
    return found


def pings(port: int, timeout: float = 0.5) -> bool:
    """Whether a Redis on ``port`` answers PING now."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@dataclass
class RedisServer:
    """One redis-server process; ``restart`` starts a new one on the same port and directory."""

    port: int
    dir: Path
    proc: subprocess.Popen = field(repr=False)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def signal(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # a SIGSTOPped one too
        self.proc.wait(timeout=10)

    def restart(self) -> None:
        self.stop()
        self.proc = _spawn(self.port, self.dir)


def _spawn(port: int, directory: Path) -> subprocess.Popen:
    with open(directory / "redis.log", "ab") as log:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(
            [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(directory)],
            stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + START_TIMEOUT
    while not pings(port):
        if proc.poll() is not None:
            tail = (directory / "redis.log").read_text(errors="replace")[-2000:]
            pytest.fail(f"redis-server exited with {proc.returncode} before answering PING:\n{tail}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"redis-server on port {port} did not answer PING within {START_TIMEOUT}s")
        time.sleep(0.01)
    return proc


@contextmanager
def redis_server(directory: Path, port: int | None = None) -> Iterator[RedisServer]:
    """A redis-server on ``port`` (a free one if None), killed on the way out."""
    port = port or free_port()
    server = RedisServer(port, directory, _spawn(port, directory))
    try:
        yield server
    finally:
        server.stop()
