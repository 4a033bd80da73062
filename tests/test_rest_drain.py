"""The REST front on SIGTERM (issue 32), as a real process over a scripted gateway: it stops taking connections,
lets the request in flight finish and answer, and exits 0; --drain-seconds bounds that wait, so a request that
would not end does not hold the process past it."""
from __future__ import annotations

import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.support.fake_gateway import FakeGateway, FakeServer, serve_fake
from tests.support.waiting import until

# The bounded drain: 1 s, and the process gone within 10x that on a loaded machine (interpreter exit included).
DRAIN_S = 1.0
EXIT_BOUND_S = 10 * DRAIN_S


class HoldingGateway(FakeGateway):
    """GenerateImages with the prompt "hold" answers only once ``release`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.release = threading.Event()

    def GenerateImages(self, request, context):
        if request.prompt == "hold":
            self.entered.set()
            self.release.wait(60)
            request.prompt = "held"
        return super().GenerateImages(request, context)


@pytest.fixture
def gateway() -> Iterator[tuple[FakeServer, HoldingGateway]]:
    servicer = HoldingGateway()
    with serve_fake(servicer=servicer) as fake:
        try:
            yield fake, servicer
        finally:
            servicer.release.set()


def _front(tmp_path: Path, gateway: str, *flags: str, pass_fds: tuple[int, ...] = (),
           name: str = "rest") -> tuple[subprocess.Popen, str, Path]:
    port_file, log = tmp_path / f"{name}.port", tmp_path / f"{name}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "rest", "--port", "0", "--port-file", str(port_file),
                                 "--gateway-address", gateway, *flags], stdout=out, stderr=subprocess.STDOUT,
                                pass_fds=pass_fds)
    until(lambda: port_file.exists() or proc.poll() is not None, 60, "the REST front's port", step=0.05)
    assert proc.poll() is None, log.read_text()
    return proc, f"127.0.0.1:{port_file.read_text()}", log


def _post(rest: str, prompt: str) -> httpx.Response:
    return httpx.post(f"http://{rest}/v1/images/generations", json={"prompt": prompt, "size": "256x256"}, timeout=60)


def test_sigterm_lets_the_request_in_flight_finish(tmp_path: Path, gateway) -> None:
    fake, servicer = gateway
    proc, rest, log = _front(tmp_path, fake.address)
    try:
        with ThreadPoolExecutor(1) as pool:
            inflight: Future = pool.submit(_post, rest, "hold")
            assert servicer.entered.wait(30), log.read_text()
            proc.terminate()
            until(lambda: "Waiting for connections to close" in log.read_text(), 30, "the front's graceful shutdown")
            with pytest.raises(httpx.ConnectError):  # it takes no new connection meanwhile
                _post(rest, "new")
            assert proc.poll() is None  # still there for the one in flight
            servicer.release.set()
            reply = inflight.result(30)
        assert reply.status_code == 200 and len(reply.json()["data"]) == 1, reply.text
        # Said, so that a client keeping the connection does not send its next request into a closed socket.
        assert reply.headers["connection"] == "close"
        assert proc.wait(30) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_drain_seconds_bounds_the_wait(tmp_path: Path, gateway) -> None:
    fake, servicer = gateway
    proc, rest, log = _front(tmp_path, fake.address, "--drain-seconds", str(DRAIN_S))
    try:
        with ThreadPoolExecutor(1) as pool:
            inflight: Future = pool.submit(_post, rest, "hold")
            assert servicer.entered.wait(30), log.read_text()
            proc.terminate()
            assert proc.wait(EXIT_BOUND_S) == 0, log.read_text()  # gone though the request never ended
            try:  # cut at the bound: uvicorn answers 500 for it, or the connection closes
                assert inflight.result(30).status_code >= 500
            except httpx.HTTPError:
                pass
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_connection_made_between_two_fronts_on_one_inherited_socket_is_answered(tmp_path: Path, gateway) -> None:
    """--listen-fd, as the launcher runs the front: the socket outlives each process, so a client connecting while
    the front restarts waits in its backlog and is answered by the next process, instead of being refused."""
    fake, _ = gateway
    listener = socket.create_server(("127.0.0.1", 0))
    fd = str(listener.fileno())
    first, rest, log = _front(tmp_path, fake.address, "--listen-fd", fd, pass_fds=(listener.fileno(),))
    second = None
    try:
        assert rest == f"127.0.0.1:{listener.getsockname()[1]}"  # the port reported is the inherited socket's
        assert _post(rest, "before").status_code == 200
        first.terminate()
        assert first.wait(30) == 0, log.read_text()
        with ThreadPoolExecutor(1) as pool:
            between: Future = pool.submit(_post, rest, "between")  # nobody accepts now: it waits, not refused
            second, _, log2 = _front(tmp_path, fake.address, "--listen-fd", fd, pass_fds=(listener.fileno(),),
                                     name="rest-2")
            reply = between.result(60)
        assert reply.status_code == 200, reply.text
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        listener.close()


def test_listen_fd_that_is_no_listening_socket_is_refused_in_one_line(tmp_path: Path) -> None:
    with open(tmp_path / "f", "wb") as f:
        done = subprocess.run([sys.executable, "-m", "rest", "--listen-fd", str(f.fileno()),
                               "--gateway-address", "127.0.0.1:1"], pass_fds=(f.fileno(),), capture_output=True,
                              text=True, timeout=60)
    assert done.returncode != 0 and "--listen-fd" in done.stderr and "Traceback" not in done.stderr, done.stderr
