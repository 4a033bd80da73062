"""Model servers for the tests, forked from one process that has already imported torch, transformers and diffusers.

Most of an AR's or a denoiser's start is importing those libraries (about 4.5 of its 6 CPU-seconds, a third of it
torch._dynamo, which diffusers imports unconditionally), and the suite starts well over a hundred such processes on
a 2-core machine. So each pytest worker keeps one fork server: a plain `python -m tests.support.forkserver` that
imports the libraries once, before any thread or gRPC state exists, and forks a child per start. The child is still
a real process of its own (its own pid, signals, SIGSTOP, SIGKILL and exit status) that runs the server's module as
`python -m` would; only its parent is the fork server rather than the test, so `spawn` hands back a `Forked`, a
`subprocess.Popen` look-alike whose exit status the fork server reports.

A start the fork server could not reproduce exactly runs as a plain subprocess instead: anything but
`sys.executable -m MODULE ...` in this directory, or an environment that differs from the fork server's in
anything but GLMIMAGE_* settings (the interpreter and the libraries read the others while they start).
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import json
import os
import runpy
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_ENVIRONMENT = dict(os.environ)  # the test process's, before any test changed it: what the fork server runs with
PR_SET_PDEATHSIG = 1
# The servers that import the model libraries anyway. A gateway or REST front forked from here would hold torch's
# pages, which they never import: they keep starting as themselves.
FORKED = frozenset({"services.ar", "services.denoiser", "tests.support.no_step_cache_denoiser",
                    "tests.support.forked_child"})


def _preload() -> None:
    """What every AR and denoiser imports and nothing of this project's: its modules are imported afresh in each
    child, so that what they read or register while importing (logging, prometheus_client) is the child's own."""
    import grpc  # noqa: F401
    import numpy  # noqa: F401
    import PIL.Image  # noqa: F401
    import torch  # noqa: F401
    from diffusers import (  # noqa: F401
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        GlmImagePipeline,
        GlmImageTransformer2DModel,
    )
    from transformers import (  # noqa: F401
        ByT5Tokenizer,
        GlmImageForConditionalGeneration,
        GlmImageProcessor,
        T5EncoderModel,
    )


def _exit_code(exc: SystemExit) -> int:
    """The status the interpreter exits with for `exc`, printing a message as it does."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1


def _acceptable(request: dict, own_env: dict[str, str]) -> str | None:
    """Why a fork would not reproduce the request's `python -m` exactly, or None (see the module's docstring)."""
    argv, env = request["argv"], request["env"]
    if len(argv) < 3 or argv[0] != sys.executable or argv[1] != "-m":
        return "not this interpreter's python -m"
    if argv[2] not in FORKED:
        return "not a model server"
    if Path(request["cwd"]).resolve() != REPO:
        return "another directory"
    differ = sorted(k for k in set(env) | set(own_env) if env.get(k) != own_env.get(k)
                    and not k.startswith("GLMIMAGE_") and k != "PYTEST_CURRENT_TEST")
    return f"another environment ({', '.join(differ)})" if differ else None


def _run_child(request: dict, stdout: int, stderr: int, inherited: list[int]) -> None:
    """In the forked child: become `python -m MODULE ARGS` with the request's environment and output. Never
    returns."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in inherited:
            os.close(fd)
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # no server outlives the fork server
        os.chdir(request["cwd"])
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(stdout, 1)
        os.dup2(stderr, 2)
        for fd in {null, stdout, stderr} - {0, 1, 2}:
            os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        module, args = request["argv"][2], request["argv"][3:]
        sys.argv = [module, *args]
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            code = _exit_code(exc)
        except KeyboardInterrupt:  # the interpreter dies of the SIGINT, so its parent sees the signal
            code = -signal.SIGINT
        except BaseException:
            traceback.print_exc()
            code = 1
        with contextlib.suppress(BaseException):
            threading._shutdown()  # type: ignore[attr-defined]  # joins non-daemon threads, as at interpreter exit
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        if code == -signal.SIGINT:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(code)


def _send(conn: socket.socket, message: dict) -> None:
    with contextlib.suppress(OSError):  # a client gone: its children are killed when its EOF is read
        conn.send(json.dumps(message).encode())


def serve(control: socket.socket, listener: socket.socket) -> None:
    """The fork server's loop. Clients (the test process on `control`, a launcher on `listener`) send one message
    per start: JSON with the argv, environment and directory, and the child's stdout and stderr as passed fds. The
    reply is the child's pid (or why it was refused), and later its wait status. A client's EOF SIGKILLs its
    children (as the launcher's die_with_parent does); the control's ends the fork server too."""
    own_env = dict(os.environ)
    _preload()
    gc.freeze()  # the children share these pages instead of copying them when the collector touches them
    # What the libraries set while importing (torch: TORCHINDUCTOR_CACHE_DIR): a fresh process would set it too.
    added = {k: v for k, v in os.environ.items() if k not in own_env}
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    clients: dict[socket.socket, set[int]] = {control: set()}
    owner: dict[int, socket.socket] = {}
    _send(control, {"ready": listener.getsockname()})
    while True:
        readable, _, _ = select.select([*clients, listener, wake_r], [], [])
        if wake_r in readable:
            with contextlib.suppress(BlockingIOError):
                while os.read(wake_r, 512):
                    pass
        while owner:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = owner.pop(pid)
            clients[conn].discard(pid)
            _send(conn, {"exit": pid, "status": status})
        if listener in readable:
            conn, _ = listener.accept()
            clients[conn] = set()
        for conn in [c for c in readable if c in clients]:
            try:
                data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 2)
            except OSError:
                data, fds = b"", []
            if not data:
                for pid in clients.pop(conn):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                conn.close()
                if conn is control:
                    return
                continue
            request = json.loads(data)
            refused = _acceptable(request, own_env) if len(fds) == 2 else "no stdout and stderr"
            if refused:
                _send(conn, {"id": request["id"], "refused": refused})
            else:
                inherited = [listener.fileno(), wake_r, wake_w, *(c.fileno() for c in clients)]
                pid = os.fork()
                if pid == 0:
                    request["env"] = added | request["env"]
                    _run_child(request, fds[0], fds[1], inherited)
                clients[conn].add(pid)
                owner[pid] = conn
                _send(conn, {"id": request["id"], "pid": pid})
            for fd in fds:
                os.close(fd)


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

    def spawn(self, argv: list[str], env: dict[str, str], stdout: int, stderr: int) -> Forked | None:
        """`argv` forked, with `stdout` and `stderr` as its fds 1 and 2; None if the fork server refused it."""
        with self._lock:
            self._next += 1
            request_id = self._next
            answered = self._answered[request_id] = threading.Event()
            message = {"id": request_id, "argv": argv, "env": env, "cwd": os.getcwd()}
            socket.send_fds(self._sock, [json.dumps(message).encode()], [stdout, stderr])
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


class ForkServer:
    """The fork server of one test process, and that process's connection to it. Launchers the tests start reach
    it on `path` (GLMIMAGE_TEST_FORKSERVER_SOCKET) through `connect`."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.path = Path(tempfile.mkdtemp(prefix="glmimage-forkserver-")) / "socket"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(str(self.path))
        listener.listen(16)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.forkserver", str(theirs.fileno()), str(listener.fileno())],
            pass_fds=[theirs.fileno(), listener.fileno()], cwd=REPO, env=_ENVIRONMENT, stdin=subprocess.DEVNULL)
        theirs.close()
        listener.close()
        if not ours.recv(1 << 16):
            raise RuntimeError(f"the fork server did not start (exit code {self._proc.wait()})")
        self.client = Client(ours)

    def close(self) -> None:
        self.client.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(30)
        shutil.rmtree(self.path.parent, ignore_errors=True)


def connect(path: str) -> Client:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.connect(path)
    return Client(sock)


_server: ForkServer | None = None
_server_lock = threading.Lock()


def server() -> ForkServer:
    """This test process's fork server, started on first use."""
    global _server
    with _server_lock:
        if _server is None:
            _server = ForkServer()
            atexit.register(_server.close)
        return _server


def enabled() -> bool:
    return os.environ.get("GLMIMAGE_TEST_FORKSERVER", "1") != "0"


def spawn(argv: list[str], log: Path, env: dict[str, str]) -> Forked | subprocess.Popen:
    """`argv` as a child of the fork server when a fork reproduces it (see the module's docstring), else as a
    subprocess; stdout and stderr appended to `log`. GLMIMAGE_TEST_FORKSERVER=0 turns the fork server off."""
    with open(log, "ab") as out:
        if enabled() and argv[1:2] == ["-m"]:
            child = server().client.spawn(argv, env, out.fileno(), out.fileno())
            if child is not None:
                return child
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)


if __name__ == "__main__":
    serve(socket.socket(fileno=int(sys.argv[1])), socket.socket(fileno=int(sys.argv[2])))
