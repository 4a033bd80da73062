"""Servers for the tests, forked from processes that have already imported their libraries: torch, transformers and
diffusers for the model servers, gRPC, aiohttp, FastAPI and the like (and no torch) for gateways and REST fronts.

Most of an AR's or a denoiser's start is importing those libraries (about 4.5 of its 6 CPU-seconds, a third of it
torch._dynamo, which diffusers imports unconditionally), and of a gateway's or a REST front's about 1 of 1.5; the
suite starts well over a hundred of each on a 2-core machine. So each pytest worker keeps two fork servers (`model`
and `light`): each a plain `python -m tests.support.forkserver` that imports its libraries once, before any thread
or gRPC state exists, and forks a child per start. The child is still
a real process of its own (its own pid, signals, SIGSTOP, SIGKILL and exit status) that runs the server's module as
`python -m` would; only its parent is the fork server rather than the test, so `spawn` hands back a `Forked`, a
`subprocess.Popen` look-alike whose exit status the fork server reports.

A start the fork server could not reproduce exactly runs as a plain subprocess instead: anything but
`sys.executable -m MODULE ...` (in any directory, with any PYTHONPATH: the child's sys.path is built from them as
the interpreter would), or an environment that differs from the fork server's in anything but GLMIMAGE_* and
OTEL_BSP_* settings (the interpreter and the libraries read the others while they start;
OpenTelemetry reads OTEL_BSP_* when a server builds its span processor).
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import fcntl
import gc
import json
import os
import runpy
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path

from runtime.forkclient import ENV_LIGHT_SOCKET, ENV_SOCKET, LIGHT_SERVERS, MODEL_SERVERS, Client, Forked

REPO = Path(__file__).resolve().parents[2]
_ENVIRONMENT = dict(os.environ)  # the test process's, before any test changed it: what the fork server runs with
PR_SET_PDEATHSIG = 1
MAX_FDS = 8  # a start's: its stdout, its stderr and what it passes (a REST front its listening socket)
# What each fork server forks: the servers that import its libraries anyway (runtime.forkclient's, what launchers ask
# for) and the tests' own. A gateway or REST front forked from the model server would hold torch's pages, which it
# never imports: it has the light one.
FORKED = {
    "model": MODEL_SERVERS | {"tests.support.no_step_cache_denoiser", "tests.support.forked_child"},
    "light": LIGHT_SERVERS | {"tests.support.forked_child"},
}
# Settings that may differ between a start and its fork server, since nothing reads them before the child does: this
# project's own, OpenTelemetry's span processor's (read when a server builds it), and for the light one torch's (its
# children never import torch; a test process that has, carries what torch set, such as TORCHINDUCTOR_CACHE_DIR).
UNREAD_AT_START = {"model": ("GLMIMAGE_", "OTEL_BSP_"), "light": ("GLMIMAGE_", "OTEL_BSP_", "TORCH")}
# This project's packages: a child imports them afresh (see _preload), so the fork server's own are dropped.
OWN_PACKAGES = frozenset({"runtime", "services", "gateway", "rest", "glmimage", "tests"})


def _preload(kind: str) -> None:
    """What every server of ``kind`` imports and nothing of this project's: its modules are imported afresh in each
    child, so that what they read or register while importing (logging, prometheus_client, the protobuf descriptor
    pool) is the child's own."""
    if kind == "light":
        _preload_light()
    else:
        _preload_model()


def _preload_light() -> None:
    """The libraries of a gateway and a REST front (most of their import time; their own modules are the rest)."""
    import aiohttp  # noqa: F401
    import fastapi  # noqa: F401
    import grpc  # noqa: F401
    import grpc.aio  # noqa: F401
    import opentelemetry.trace  # noqa: F401
    import prometheus_client  # noqa: F401
    import pydantic  # noqa: F401
    import standardwebhooks  # noqa: F401
    import uvicorn  # noqa: F401
    from grpc_health.v1 import health  # noqa: F401
    from grpc_reflection.v1alpha import reflection  # noqa: F401
    from grpc_status import rpc_status  # noqa: F401


def _preload_model() -> None:
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
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    # transformers builds every model type's weight-renaming rules (about a thousand regular expressions) at a
    # process's first from_pretrained and keeps them: half a CPU-second of each AR's and denoiser's start, once here.
    get_checkpoint_conversion_mapping("glm_image")


def _exit_code(exc: SystemExit) -> int:
    """The status the interpreter exits with for `exc`, printing a message as it does."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1


def _acceptable(request: dict, kind: str, own_env: dict[str, str], added: dict[str, str]) -> str | None:
    """Why a fork would not reproduce the request's `python -m` exactly, or None (see the module's docstring).
    ``added``: what the libraries set in the environment while the fork server imported them; a client that has
    imported them too has the same, one that has not lacks it, and neither is another environment."""
    argv, env = request["argv"], request["env"]
    if len(argv) < 3 or argv[0] != sys.executable or argv[1] != "-m":
        return "not this interpreter's python -m"
    if argv[2] not in FORKED[kind]:
        return f"not a server the {kind} fork server starts"
    differ = sorted(k for k in set(env) | set(own_env) if env.get(k) != own_env.get(k)
                    and not k.startswith(UNREAD_AT_START[kind]) and k not in ("PYTEST_CURRENT_TEST", "PYTHONPATH")
                    and not (k in added and env.get(k, added[k]) == added[k]))
    return f"another environment ({', '.join(differ)})" if differ else None


def _place_fds(sources: list[int], targets: list[int]) -> None:
    """dup2 each of ``sources`` onto the same place in ``targets`` (inheritable, as pass_fds makes them) and close
    the sources; by way of copies above every number in play, so that no target overwrites a source not yet moved."""
    floor = max([*sources, *targets, 2]) + 1
    copies = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, floor) for fd in sources]
    for fd in set(sources) - set(targets):
        os.close(fd)
    for copy, target in zip(copies, targets, strict=True):
        os.dup2(copy, target)  # inheritable unless the target is 0-2, which dup2 makes inheritable anyway
        os.close(copy)


def _python_path(env: dict[str, str]) -> list[str]:
    return [entry for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry]


def _run_child(request: dict, fds: list[int], inherited: list[int], library_path: list[str]) -> None:
    """In the forked child: become `python -m MODULE ARGS` with the request's directory, environment, output
    (``fds``' first two) and passed fds (the rest, under the numbers the request names); its sys.path as `python -m`
    there would build it: the directory, the request's PYTHONPATH, then ``library_path`` (the interpreter's own).
    Never returns."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in inherited:
            os.close(fd)
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # no server outlives the fork server
        os.chdir(request["cwd"])
        _place_fds([os.open(os.devnull, os.O_RDONLY), *fds], [0, 1, 2, *request.get("fds", [])])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.path[:] = [os.getcwd(), *_python_path(request["env"]), *library_path]
        for name in [m for m in sys.modules if m.split(".")[0] in OWN_PACKAGES]:
            del sys.modules[name]
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


def serve(control: socket.socket, listener: socket.socket, kind: str) -> None:
    """The fork server's loop. Clients (the test process on `control`, a launcher on `listener`) send one message
    per start: JSON with the argv, environment and directory, and the child's stdout and stderr as passed fds. The
    reply is the child's pid (or why it was refused), and later its wait status. A client's EOF SIGKILLs its
    children (as the launcher's die_with_parent does); the control's ends the fork server too. Each running child's
    command line and client pid are kept in `records` (see `started_by`), since its /proc cmdline is the fork
    server's."""
    own_env = dict(os.environ)
    # What `python -m` put before the interpreter's own entries: this directory, then PYTHONPATH's.
    library_path = sys.path[1 + len(_python_path(own_env)):]
    _preload(kind)
    gc.freeze()  # the children share these pages instead of copying them when the collector touches them
    # What the libraries set while importing (torch: TORCHINDUCTOR_CACHE_DIR): a fresh process would set it too, and
    # a client that has imported them since it started has it already, which is no other environment.
    added = {k: v for k, v in os.environ.items() if k not in own_env}
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    clients: dict[socket.socket, set[int]] = {control: set()}
    owner: dict[int, socket.socket] = {}
    peer_pid = {control: os.getppid()}
    records = Path(listener.getsockname()).parent / "children"
    records.mkdir(exist_ok=True)
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
            (records / f"{pid}.json").unlink(missing_ok=True)
            conn = owner.pop(pid)
            if conn in clients:  # else gone, its children killed
                clients[conn].discard(pid)
                _send(conn, {"exit": pid, "status": status})
        if listener in readable:
            conn, _ = listener.accept()
            clients[conn] = set()
            peer_pid[conn] = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                 struct.calcsize("3i")))[0]
        for conn in [c for c in readable if c in clients]:
            try:
                data, fds, _, _ = socket.recv_fds(conn, 1 << 20, MAX_FDS)
            except OSError:
                data, fds = b"", []
            if not data:
                for pid in clients.pop(conn):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                peer_pid.pop(conn, None)
                conn.close()
                if conn is control:
                    return
                continue
            request = json.loads(data)
            refused = (_acceptable(request, kind, own_env, added) if len(fds) == 2 + len(request.get("fds", []))
                       else "not stdout, stderr and the fds named")
            if refused:
                _send(conn, {"id": request["id"], "refused": refused})
            else:
                inherited = [listener.fileno(), wake_r, wake_w, *(c.fileno() for c in clients)]
                pid = os.fork()
                if pid == 0:
                    request["env"] = added | request["env"]
                    _run_child(request, fds, inherited, library_path)
                clients[conn].add(pid)
                owner[pid] = conn
                (records / f"{pid}.json").write_text(json.dumps({"argv": request["argv"], "client": peer_pid[conn]}))
                _send(conn, {"id": request["id"], "pid": pid})
            for fd in fds:
                os.close(fd)


class ForkServer:
    """A fork server of one test process (``kind``: "model" or "light"), and that process's connection to it.
    Launchers the tests start reach it on `path` (runtime.forkclient's ENV_SOCKET or ENV_LIGHT_SOCKET, which
    `export` sets). Started at once; `client` waits until it has imported the libraries."""

    def __init__(self, kind: str) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.path = Path(tempfile.mkdtemp(prefix=f"glmimage-forkserver-{kind}-")) / "socket"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(str(self.path))
        listener.listen(64)  # a launcher that connects before the fork server's loop runs waits in the backlog
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.forkserver", str(theirs.fileno()), str(listener.fileno()), kind],
            pass_fds=[theirs.fileno(), listener.fileno()], cwd=REPO, env=_ENVIRONMENT, stdin=subprocess.DEVNULL)
        theirs.close()
        listener.close()
        self._ours = ours
        self._client: Client | None = None
        self._lock = threading.Lock()

    @property
    def client(self) -> Client:
        with self._lock:
            if self._client is None:
                if not self._ours.recv(1 << 16):
                    raise RuntimeError(f"the fork server did not start (exit code {self._proc.wait()})")
                self._client = Client(self._ours)
            return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
        else:
            self._ours.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(30)
        shutil.rmtree(self.path.parent, ignore_errors=True)


_servers: dict[str, ForkServer] = {}
_server_lock = threading.Lock()
KINDS = {"model": ENV_SOCKET, "light": ENV_LIGHT_SOCKET}  # each fork server, and the variable naming its socket


def server(kind: str = "model") -> ForkServer:
    """This test process's fork server of ``kind``, started on first use."""
    with _server_lock:
        if kind not in _servers:
            _servers[kind] = ForkServer(kind)
            atexit.register(_servers[kind].close)
        return _servers[kind]


def kind_of(argv: list[str]) -> str | None:
    """Which fork server would start ``argv``, if any would (it may still refuse: see the module's docstring)."""
    if argv[1:2] != ["-m"] or len(argv) < 3:
        return None
    return next((kind for kind, modules in FORKED.items() if argv[2] in modules), None)


def started_by(client: int) -> dict[int, list[str]]:
    """The running children that process ``client`` (a launcher) had forked by this test process's fork servers,
    by pid, with the command line each was started with."""
    found = {}
    for forks in list(_servers.values()):
        for record in (forks.path.parent / "children").glob("*.json"):
            with contextlib.suppress(FileNotFoundError, ValueError):  # it exited meanwhile
                data = json.loads(record.read_text())
                if data["client"] == client:
                    found[int(record.stem)] = data["argv"]
    return found


def without() -> dict[str, str]:
    """This process's environment for a launcher that must start its servers as plain processes."""
    return {k: v for k, v in os.environ.items() if k not in KINDS.values()}


def enabled() -> bool:
    return os.environ.get("GLMIMAGE_TEST_FORKSERVER", "1") != "0"


def export() -> None:
    """Start this test process's fork servers now (they import the libraries while the first tests run) and name
    their sockets in the environment, where the launchers the tests start find them (services/supervisor.py). A test
    whose launcher must start its servers as plain processes (it reads their command lines or environments, which a
    forked child inherits from its fork server) removes both from the launcher's environment (`without`)."""
    if enabled():
        for kind, variable in KINDS.items():
            os.environ[variable] = str(server(kind).path)


def spawn(argv: list[str], log: Path, env: dict[str, str], cwd: Path | None = None) -> Forked | subprocess.Popen:
    """`argv` (in ``cwd``, default this process's) as a child of a fork server when a fork reproduces it (see the
    module's docstring), else as a subprocess; stdout and stderr appended to `log`. GLMIMAGE_TEST_FORKSERVER=0 turns
    the fork servers off."""
    with open(log, "ab") as out:
        if enabled() and (kind := kind_of(argv)) is not None:
            child = server(kind).client.spawn(argv, env, out.fileno(), out.fileno(), cwd=cwd)
            if child is not None:
                return child
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd)


if __name__ == "__main__":
    serve(socket.socket(fileno=int(sys.argv[1])), socket.socket(fileno=int(sys.argv[2])), sys.argv[3])
