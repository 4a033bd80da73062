"""Real server processes on loopback for the chaos tests and the soak: start, kill, restart, wait for SERVING.

Each process binds port 0 and reports its port through --port-file; a restart reuses the same port, as a
Kubernetes pod behind a stable address would. Logs go to files next to the port files.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import psutil
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support import forkserver

SERVICES = {"ar": "glmimage.v1.ArService", "denoiser": "glmimage.v1.DenoiserService",
            "gateway": "glmimage.v1.GatewayService"}
MODULES = {"ar": "services.ar", "denoiser": "services.denoiser", "gateway": "gateway", "rest": "rest"}


@dataclass
class Proc:
    name: str
    role: str
    flags: list[str]
    port: int = 0
    popen: subprocess.Popen | forkserver.Forked | None = None
    metrics_port: int | None = None
    log: Path | None = None
    extra_env: dict[str, str] = field(default_factory=dict)
    module: str | None = None  # what `python -m` runs, when not the role's own (a test's variant of a server)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def rss(self) -> int:
        return psutil.Process(self.pid).memory_info().rss


class Cluster:
    def __init__(self, workdir: Path, torch_threads: int = 1) -> None:
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, Proc] = {}
        self.torch_threads = torch_threads

    # ---- processes -------------------------------------------------------------------------------------------

    def start(self, name: str, role: str, flags: list[str] | None = None, *, metrics: bool = False,
              wait: bool = True, env: dict[str, str] | None = None, module: str | None = None) -> Proc:
        proc = Proc(name=name, role=role, flags=list(flags or []), extra_env=dict(env or {}), module=module)
        if role in ("ar", "denoiser"):
            proc.flags += ["--torch-threads", str(self.torch_threads), "--device", "cpu"]
        if metrics:
            proc.metrics_port = 0  # the server picks one and reports it (a port picked here could be taken first)
        self.procs[name] = proc
        self._spawn(proc)
        if wait:
            self.wait_ready(name)
        return proc

    def _spawn(self, proc: Proc) -> None:
        port_file = self.dir / f"{proc.name}.port"
        port_file.unlink(missing_ok=True)
        proc.log = self.dir / f"{proc.name}.log"
        argv = [sys.executable, "-m", proc.module or MODULES[proc.role], "--host", "127.0.0.1", "--port",
                str(proc.port), "--port-file", str(port_file), *proc.flags]
        metrics_file = self.dir / f"{proc.name}.metrics-port"
        if proc.metrics_port is not None:  # a restart binds the port it reported the first time
            metrics_file.unlink(missing_ok=True)
            argv += ["--metrics-port", str(proc.metrics_port), "--metrics-port-file", str(metrics_file)]
        proc.popen = forkserver.spawn(argv, proc.log, {**os.environ, **proc.extra_env})
        deadline = time.monotonic() + 120
        while not port_file.exists():  # the child writes it atomically once bound
            if proc.popen.poll() is not None:
                raise RuntimeError(f"{proc.name} exited ({proc.popen.returncode}); log: {self.tail(proc.name)}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{proc.name} did not bind a port")
            time.sleep(0.02)
        proc.port = int(port_file.read_text())
        if proc.metrics_port is not None:  # written before the port file
            proc.metrics_port = int(metrics_file.read_text())

    def wait_ready(self, name: str, timeout: float = 120) -> None:
        proc = self.procs[name]
        if proc.role == "rest":
            deadline = time.monotonic() + timeout
            while True:
                try:
                    urllib.request.urlopen(f"http://{proc.address}/health", timeout=2)
                    return
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
        wait_serving(proc.address, SERVICES[proc.role], timeout)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> int | None:
        proc = self.procs[name]
        assert proc.popen is not None
        proc.popen.send_signal(sig)
        if sig in (signal.SIGKILL, signal.SIGTERM):
            return proc.popen.wait(60)
        return None

    def restart(self, name: str, wait: bool = True) -> Proc:
        """Start the process again on the same port."""
        proc = self.procs[name]
        if proc.popen and proc.popen.poll() is None:
            self.kill(name)
        self._spawn(proc)
        if wait:
            self.wait_ready(name)
        return proc

    def tail(self, name: str, lines: int = 40) -> str:
        log = self.procs[name].log
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log and log.exists() else ""

    def close(self) -> None:
        for proc in reversed(list(self.procs.values())):
            if proc.popen and proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
                proc.popen.terminate()
        for proc in self.procs.values():
            if proc.popen:
                reap(proc.popen, 30)


def reap(popen: subprocess.Popen | forkserver.Forked, timeout: float) -> int:
    """Wait for a process told to stop; kill it if it is not gone within `timeout`. Its exit code."""
    try:
        return popen.wait(timeout)
    except subprocess.TimeoutExpired:
        popen.kill()
        return popen.wait()


def wait_serving(address: str, service: str, timeout: float = 120) -> None:
    """Block on grpc.health.v1 Watch until `service` is SERVING."""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for reply in stub.Watch(health_pb2.HealthCheckRequest(service=service), timeout=timeout,
                                wait_for_ready=True):
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return
    raise RuntimeError(f"{address} stopped before {service} was SERVING")


def launcher_children(launcher: int) -> dict[int, list[str]]:
    """The launcher's running children by pid, with their command lines: its own (what ps shows) and those the fork
    server forked for it (their /proc cmdline is the fork server's: tests.support.forkserver keeps theirs)."""
    found = forkserver.started_by(launcher)
    for proc in psutil.Process(launcher).children():
        with contextlib.suppress(psutil.NoSuchProcess):
            if proc.status() != "zombie":
                found[proc.pid] = proc.cmdline()
    return found


def launcher_tree(launcher: int) -> list[psutil.Process]:
    """Every process the launcher started and is running: its descendants and those forked for it."""
    procs = psutil.Process(launcher).children(recursive=True)
    for pid in forkserver.started_by(launcher):
        with contextlib.suppress(psutil.NoSuchProcess):
            procs.append(psutil.Process(pid))
    return procs


def launcher_child(launcher: int, name: str) -> int | None:
    """The pid of the launcher's child `name` (recognised by its --port-file), if one is running."""
    found = launcher_child_argv(launcher, name)
    return found[0] if found else None


def launcher_child_argv(launcher: int, name: str) -> tuple[int, list[str]] | None:
    """The pid and command line of the launcher's child `name`, if one is running (a forked child's /proc cmdline
    is its fork server's: this is the one it was started with)."""
    for pid, argv in launcher_children(launcher).items():
        if any(arg.endswith(f"/{name}.port") for arg in argv):
            return pid, argv
    return None


@dataclass
class StackRun:
    addresses: dict[str, str]  # role -> host:port
    proc: subprocess.Popen
    banner: list[str] = field(default_factory=list)  # the "GLM-Image stack is up" lines, up to "Ctrl-C ..."


@contextlib.contextmanager
def running_stack(run_dir: Path, denoisers: int = 2, extra_args: tuple[str, ...] = (),
                  gateways: int = 1, forked: bool = True) -> Iterator[StackRun]:
    """`python -m services.launcher` (what `make run` starts) on ephemeral ports, once every server is SERVING.
    ``forked=False``: its AR and denoisers are plain processes, not forked by the fork server (a test of what ps
    shows of them: their command lines and environments)."""
    ready = run_dir / "ready.json"
    # One gateway through the old single-port flag, which the launcher keeps; several through --gateway-ports.
    gateway_flags = ["--gateway-port", "0"] if gateways == 1 else ["--gateway-ports", ",".join(["0"] * gateways)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.launcher", "--rest-port", "0", *gateway_flags, "--ar-port", "0",
         "--denoiser-ports", ",".join(["0"] * denoisers), "--ready-file", str(ready), "--log-level", "WARNING",
         *extra_args],
        stdout=subprocess.PIPE, text=True, env=None if forked else forkserver.without())
    try:
        # The launcher prints its banner only once every server reports SERVING: block on that line.
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("GLM-Image stack is up"):
                break
        else:
            raise RuntimeError(f"the stack did not start (exit code {proc.wait()})")
        banner = [line.rstrip("\n")]
        for line in proc.stdout:  # the banner is printed (and flushed) in one piece: this does not block
            banner.append(line.rstrip("\n"))
            if "Ctrl-C stops everything" in line:
                break
        yield StackRun(addresses=json.loads(ready.read_text()), proc=proc, banner=banner)
    finally:
        if proc.poll() is None:
            proc.terminate()
            reap(proc, 60)
