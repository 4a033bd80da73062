"""The client side of a fork server: a process that has imported a server's libraries once and forks a child per
server start, so that a start costs the server's own work and not the imports (about 4.5 of a model server's 6
CPU-seconds; about 1 of a gateway's or a REST front's 1.5). The test suite runs two per pytest worker
(tests/support/forkserver.py, where the protocol is described): one with the model libraries for the ARs and
denoisers, one with the web and gRPC libraries (and no torch) for gateways and REST fronts. The launcher uses them
when GLMIMAGE_TEST_FORKSERVER_SOCKET (and GLMIMAGE_TEST_FORKSERVER_LIGHT_SOCKET) name them
(services/supervisor.py), as the tests' launchers do, and never otherwise: production starts are plain processes.

A forked child is a real process of its own (its own pid, signals, SIGSTOP, SIGKILL and exit status) whose parent
is the fork server, so ``Client.spawn`` hands back a ``Forked``, the part of ``subprocess.Popen`` that callers use,
with the exit status the fork server reports; ``AsyncForked`` is the same for asyncio's Process. A client's
children are SIGKILLed by the fork server when its connection closes (the client died), as die_with_parent does for
a launcher's children. Stdlib only.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
from collections.abc import Callable

# The fork servers' sockets, for the launchers a test starts; unset or empty: those starts are plain processes.
ENV_SOCKET = "GLMIMAGE_TEST_FORKSERVER_SOCKET"  # the model servers'
ENV_LIGHT_SOCKET = "GLMIMAGE_TEST_FORKSERVER_LIGHT_SOCKET"  # the gateways' and REST fronts'
# The servers a launcher asks the first to fork: those that import the model libraries.
MODEL_SERVERS = frozenset({"services.ar", "services.denoiser"})
# Those it asks the second: they never import torch, so they are not forked from a process that has (they would
# hold its pages, and torch in their sys.modules).
LIGHT_SERVERS = frozenset({"gateway", "rest"})


def socket_env(argv: list[str]) -> str | None:
    """The variable naming the fork server a launcher asks for ``argv`` (which may still refuse it: another
    environment, ...), or None: a plain process."""
    module = argv[2] if argv[1:2] == ["-m"] and len(argv) > 2 else None
    if module in MODEL_SERVERS:
        return ENV_SOCKET
    if module in LIGHT_SERVERS:
        return ENV_LIGHT_SOCKET
    return None


class Forked:
    """A child of the fork server, with the part of `subprocess.Popen` the tests use."""

    def __init__(self, pid: int, args: list[str]) -> None:
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self._exited = threading.Event()
        self._callbacks: list[Callable[[], None]] = []

    def _set_status(self, status: int) -> None:
        self.returncode = os.waitstatus_to_exitcode(status)
        self._exited.set()
        for callback in self._callbacks:
            callback()

    def on_exit(self, callback: Callable[[], None]) -> None:
        """Call `callback` (from the reply thread) once the child has exited."""
        self._callbacks.append(callback)
        if self._exited.is_set():
            callback()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)  # type: ignore[arg-type]
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:  # as Popen: never signal a pid that may have been reused
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Client:
    """One connection to the fork server: sends starts, and reads the replies on a thread."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._lock = threading.Lock()
        self._next = 0
        self._replies: dict[int, dict] = {}
        self._answered: dict[int, threading.Event] = {}
        self._children: dict[int, Forked] = {}
        self._early: dict[int, int] = {}  # exits read before their start's reply was handled
        self.refused: list[str] = []  # what ran as a plain subprocess instead, and why
        threading.Thread(target=self._read, name="forkserver-replies", daemon=True).start()

    def spawn(self, argv: list[str], env: dict[str, str], stdout: int, stderr: int,
              pass_fds: tuple[int, ...] = (), cwd: str | os.PathLike | None = None) -> Forked | None:
        """`argv` forked in ``cwd`` (default this process's), with `stdout` and `stderr` as its fds 1 and 2 and each
        of ``pass_fds`` under its own number (as subprocess's pass_fds); None if the fork server refused it."""
        with self._lock:
            self._next += 1
            request_id = self._next
            answered = self._answered[request_id] = threading.Event()
            message = {"id": request_id, "argv": argv, "env": env, "cwd": os.fspath(cwd or os.getcwd()),
                       "fds": list(pass_fds)}
            socket.send_fds(self._sock, [json.dumps(message).encode()], [stdout, stderr, *pass_fds])
        if not answered.wait(60):
            raise RuntimeError("the fork server did not answer")
        with self._lock:
            reply = self._replies.pop(request_id)
            if "pid" not in reply:
                self.refused.append(f"{' '.join(argv[1:3])}: {reply['refused']}")
                return None
            child = self._children[reply["pid"]] = Forked(reply["pid"], argv)
            status = self._early.pop(child.pid, None)
        if status is not None:
            child._set_status(status)
        return child

    def _read(self) -> None:
        while True:
            try:
                message = self._sock.recv(1 << 16)
            except OSError:  # closed by `close`
                return
            if not message:
                return
            reply = json.loads(message)
            with self._lock:
                if "id" in reply:
                    self._replies[reply["id"]] = reply
                    self._answered.pop(reply["id"]).set()
                    continue
                child = self._children.pop(reply["exit"], None)
                if child is None:
                    self._early[reply["exit"]] = reply["status"]
            if child is not None:
                child._set_status(reply["status"])

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()


def connect(path: str) -> Client:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.connect(path)
    return Client(sock)


class AsyncForked:
    """A ``Forked`` child as the part of ``asyncio.subprocess.Process`` the supervisor uses."""

    def __init__(self, child: Forked, loop: asyncio.AbstractEventLoop) -> None:
        self._child = child
        self.pid = child.pid
        self._exited = asyncio.Event()
        child.on_exit(lambda: loop.call_soon_threadsafe(self._exited.set))

    @property
    def returncode(self) -> int | None:
        return self._child.returncode if self._exited.is_set() else None

    async def wait(self) -> int:
        await self._exited.wait()
        assert self._child.returncode is not None
        return self._child.returncode

    def send_signal(self, sig: int) -> None:
        self._child.send_signal(sig)

    def terminate(self) -> None:
        self._child.terminate()

    def kill(self) -> None:
        self._child.kill()
