"""Process supervision for the launcher (services/launcher.py): spawn servers, gate on their health, stop them all.

Every server module takes the same `--host/--port/--port-file/--log-level` flags, so a child is a module name plus
its own flags. Children run through the die_with_parent trampoline, so none outlives the supervisor. Once the stack
is up, `supervise` restarts a child that exits (same flags, same port, health-gated again) under a RestartPolicy;
one given up stays down until `retry_given_up` (the launcher's SIGUSR1) gives it a fresh budget. `stop_child` and
`start_child` (the launcher's `ctl stop|start NAME`) take one down on purpose, so it is not restarted, and back;
`restart_child` (`ctl restart NAME`) does both, draining it first.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from runtime.forkclient import ENV_LIGHT_SOCKET, ENV_SOCKET, AsyncForked, Client, connect, socket_env
from runtime.sockets import listen_socket

log = logging.getLogger("services.supervisor")


@dataclass
class Child:
    name: str
    argv: list[str]
    port_file: Path
    health_service: str | None  # None: an HTTP server, checked on /health
    process: asyncio.subprocess.Process | AsyncForked | None = None
    port: int = 0
    metrics_port: int | None = None  # its /metrics port, as it reported it (the REST front: its own port)
    metrics_port_file: Path | None = None  # where it reports that port (--metrics-port-file), when it serves one
    # An HTTP server's listening socket, held here and handed to each of its processes (--listen-fd): while one
    # drains and the next starts, connections wait in the socket's backlog instead of being refused.
    listener: socket.socket | None = None
    env: dict[str, str] = field(default_factory=dict)  # added to the supervisor's environment
    restarts: list[float] = field(default_factory=list)  # monotonic times of its restarts (within the window)
    given_up: bool = False  # crashed through its restart budget: left down
    held: bool = False  # stopped by the operator (stop_child): left down until start_child
    serving: bool = False  # passed its health gate, and has not exited since
    parked: bool = False  # held and down: _keep_up waits for start_child
    start_failed: bool = False  # its last restart did not come up (what start_child waits for, besides serving)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def pin_port(self) -> None:
        """Make a restart bind the port it got the first time (`--port 0` would pick a new one, and the gateway
        and REST front hold the first address in their flags)."""
        i = self.argv.index("--port")
        self.argv[i + 1] = str(self.port)
        if self.metrics_port is not None and "--metrics-port" in self.argv:  # its banner URL must stay true too
            i = self.argv.index("--metrics-port")
            self.argv[i + 1] = str(self.metrics_port)


@dataclass(frozen=True)
class RestartPolicy:
    """How `Supervisor.supervise` restarts a child that exits: after a backoff that doubles with each restart
    still inside `window` (from `initial_backoff` up to `max_backoff`), at most `max_restarts` times per `window`
    seconds; past that the child is given up (a crash loop is reported, not hidden by endless restarts)."""
    initial_backoff: float = 0.5
    max_backoff: float = 10.0
    max_restarts: int = 5
    window: float = 60.0
    startup_timeout: float = 120.0  # for each restart to bind its port and report healthy

    def backoff(self, recent: int) -> float:
        """The wait before a restart, given how many restarts already happened within the window."""
        return min(self.max_backoff, self.initial_backoff * 2 ** recent)


# The exit codes of a server stopped by SIGTERM or SIGINT: its graceful exit (0), the signal itself (-15, -2: no
# handler yet), or a shell's 128+N. Anything else, SIGKILL included, is a crash.
SIGNALLED_CODES = frozenset({0, -signal.SIGTERM, -signal.SIGINT, 128 + signal.SIGTERM, 128 + signal.SIGINT})


class StartupError(RuntimeError):
    """A child exited, or did not bind or become healthy in time, during start-up."""


async def _wait_port(child: Child, deadline: float) -> None:
    loop = asyncio.get_running_loop()
    while not child.port_file.exists():
        if child.process.returncode is not None:
            raise StartupError(f"{child.name} exited with code {child.process.returncode} during start-up")
        if loop.time() > deadline:
            raise StartupError(f"{child.name} did not bind a port in time")
        await asyncio.sleep(0.05)
    child.port = int(child.port_file.read_text())
    if child.metrics_port_file is not None:  # written before the port file (see --metrics-port-file)
        child.metrics_port = int(child.metrics_port_file.read_text())


async def _wait_serving(child: Child, deadline: float) -> None:
    """Block on grpc.health.v1 Watch until the server says SERVING (no polling)."""
    loop = asyncio.get_running_loop()
    async with grpc.aio.insecure_channel(child.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        call = stub.Watch(health_pb2.HealthCheckRequest(service=child.health_service),
                          timeout=max(1.0, deadline - loop.time()), wait_for_ready=True)
        async for reply in call:
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                call.cancel()
                return
    raise StartupError(f"{child.name} never became SERVING")


async def _wait_http_health(child: Child, deadline: float) -> None:
    loop = asyncio.get_running_loop()
    url = f"http://{child.address}/health"
    while True:
        try:
            status = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=2).status)
            if status == 200:
                return
        except OSError:
            pass
        if child.process.returncode is not None:
            raise StartupError(f"{child.name} exited with code {child.process.returncode} during start-up")
        if loop.time() > deadline:
            raise StartupError(f"{child.name} did not become healthy in time")
        await asyncio.sleep(0.1)


async def _gate(child: Child, deadline: float) -> None:
    """Its health check, cut short if the process exits meanwhile (the gRPC Watch would wait for the deadline)."""
    check = asyncio.ensure_future(_wait_serving(child, deadline) if child.health_service is not None
                                  else _wait_http_health(child, deadline))
    exited = asyncio.ensure_future(child.process.wait())
    try:
        done, _ = await asyncio.wait({check, exited}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        exited.cancel()
        if not check.done():
            check.cancel()
    if check not in done:
        raise StartupError(f"{child.name} exited with code {child.process.returncode} during start-up")
    try:
        check.result()
    except grpc.RpcError as exc:
        raise StartupError(f"{child.name} did not become SERVING in time ({exc.code().name})") from exc


async def _terminate(child: Child, grace: float) -> None:
    if child.process is None or child.process.returncode is not None:
        return
    child.process.send_signal(signal.SIGTERM)
    try:
        await asyncio.wait_for(child.process.wait(), grace)
    except TimeoutError:
        log.warning("%s did not stop in %.0fs; killing it", child.name, grace)
        child.process.kill()
        await child.process.wait()


class Supervisor:
    """The children in start order; `start` brings a group up together, `stop` takes them down in reverse."""

    def __init__(self, host: str, log_level: str, restart: RestartPolicy | None = None) -> None:
        self.host, self.log_level = host, log_level
        self.restart = restart or RestartPolicy()
        self.children: list[Child] = []
        self._groups: list[list[Child]] = []  # as first started together: they stop together too
        self.run_dir = Path(tempfile.mkdtemp(prefix="glmimage-stack-"))
        self._changed = asyncio.Event()  # set (then replaced) whenever a child's state changes: see _until
        self.on_restart: Callable[[], None] | None = None  # after a child is back (new PID) or stopped: the ready file
        # Only where a test names them (runtime.forkclient); production starts are plain processes.
        self._forks: dict[str, Client] = {}
        for name in (ENV_SOCKET, ENV_LIGHT_SOCKET):
            if path := os.environ.get(name):
                try:
                    self._forks[name] = connect(path)
                except OSError as exc:  # gone (its test ended): its starts are plain processes, as without one
                    log.warning("no fork server at %s (%s): starting its servers as plain processes", path, exc)

    def child(self, name: str, module: str, port: int, flags: list[str], health: str | None,
              env: dict[str, str] | None = None, metrics_port: int | None = None,
              listener: socket.socket | None = None) -> Child:
        """``listener`` (from `listen`): the socket an HTTP server accepts on, over all its restarts."""
        port_file = self.run_dir / f"{name}.port"
        argv = [sys.executable, "-m", module, "--host", self.host, "--port", str(port),
                "--port-file", str(port_file), "--log-level", self.log_level, *flags]
        if listener is not None:
            argv += ["--listen-fd", str(listener.fileno())]
        metrics_file = None
        if metrics_port is not None:  # 0: the server picks one and reports it, so no other process can take it first
            metrics_file = self.run_dir / f"{name}.metrics-port"
            argv += ["--metrics-port", str(metrics_port), "--metrics-port-file", str(metrics_file)]
        child = Child(name=name, argv=argv, port_file=port_file, health_service=health, env=dict(env or {}),
                      metrics_port=metrics_port, metrics_port_file=metrics_file, listener=listener)
        self.children.append(child)
        return child

    async def _spawn(self, child: Child) -> None:
        log.info("starting %s", child.name)
        env = {**os.environ, **child.env}
        pass_fds = (child.listener.fileno(),) if child.listener else ()
        which = socket_env(child.argv)
        if which is not None and (forks := self._forks.get(which)) is not None:
            # A test's fork server (runtime.forkclient): a forked child dies with this process's connection.
            try:
                forked = await asyncio.to_thread(forks.spawn, child.argv, env, sys.stdout.fileno(),
                                                 sys.stderr.fileno(), pass_fds)
            except (OSError, RuntimeError) as exc:  # it went away, or stopped answering: plain processes from now on
                log.warning("the fork server failed (%s): starting its servers as plain processes", exc)
                del self._forks[which]
                forked = None
            if forked is not None:
                child.process = AsyncForked(forked, asyncio.get_running_loop())
                return
        # Through the die_with_parent trampoline, so no child outlives the launcher (see that module for why not
        # a preexec_fn).
        child.process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "runtime.die_with_parent", str(os.getpid()), "--", *child.argv,
            env=env, pass_fds=pass_fds)

    async def start(self, group: list[Child], deadline: float) -> None:
        """Spawn `group` at once, then wait until every member has bound its port and reports healthy."""
        if not any(c in g for g in self._groups for c in group):  # a restart is no new group
            self._groups.append(list(group))
        for c in group:
            c.port_file.unlink(missing_ok=True)  # a restart must wait for the new process's port, not the old one's
            if c.metrics_port_file is not None:
                c.metrics_port_file.unlink(missing_ok=True)
        await asyncio.gather(*(self._spawn(c) for c in group))
        await asyncio.gather(*(_wait_port(c, deadline) for c in group))
        for c in group:
            c.pin_port()
        await asyncio.gather(*(_gate(c, deadline) for c in group))
        for c in group:
            c.serving = True

    def addresses(self) -> dict[str, str]:
        return {c.name: c.address for c in self.children}

    def pids(self) -> dict[str, int]:
        """Each running child's PID (the server itself: the trampoline execs it)."""
        return {c.name: c.process.pid for c in self.children
                if c.process is not None and c.process.returncode is None}

    def send(self, sig: int, which: Callable[[str], bool]) -> list[str]:
        """Send ``sig`` to each running child whose name ``which`` accepts (SIGHUP: reload the tenants file)."""
        sent = []
        for c in self.children:
            if which(c.name) and c.process is not None and c.process.returncode is None:
                c.process.send_signal(sig)
                sent.append(c.name)
        log.info("sent %s to %s", signal.Signals(sig).name, ", ".join(sent) or "no child")
        return sent

    def retry_given_up(self) -> list[str]:
        """Give every given-up child a fresh restart budget and restart it now; the names it retries."""
        given_up = [c for c in self.children if c.given_up]
        for c in given_up:
            c.given_up = False
            c.restarts.clear()  # a fresh budget: whatever made it crash may have been fixed meanwhile
        names = [c.name for c in given_up]
        if names:
            log.warning("retrying %s, as asked", ", ".join(names))
        else:
            log.warning("asked to retry given-up servers: none is given up")
        self._notify()
        return names

    def _notify(self) -> None:
        event, self._changed = self._changed, asyncio.Event()
        event.set()

    async def _until(self, predicate: Callable[[], bool]) -> None:
        while not predicate():
            await self._changed.wait()

    def find(self, name: str) -> Child | None:
        return next((c for c in self.children if c.name == name), None)

    async def stop_child(self, child: Child, grace: float = 20.0, again: bool = False) -> str:
        """Stop ``child`` on purpose (drained by SIGTERM, as the whole stack stops): it stays down, and is not
        restarted, until `start_child` (``again``: which follows at once, a restart). What happened, in words."""
        if child.held:
            return f"{child.name} is already stopped"
        child.held, child.given_up = True, False
        self._notify()
        running = child.process is not None and child.process.returncode is None
        if not again:
            log.warning("stopping %s, as asked; it stays down until started again", child.name)
        await _terminate(child, grace)
        # _keep_up logs the exit and rewrites the ready file; wait for that, so the reply comes after.
        await self._until(lambda: child.parked or not child.held)
        return f"{child.name} stopped (exit code {child.process.returncode})" if running else \
            f"{child.name} was not running; it stays down"

    async def start_child(self, child: Child) -> str:
        """Start ``child`` again (stopped, or given up: with a fresh budget, at once) and wait until it is healthy
        or has failed once; a running one is left alone. What happened, in words."""
        if not (child.held or child.given_up):
            return (f"{child.name} is already running (pid {child.process.pid})" if child.serving
                    else f"{child.name} is not stopped: it is being restarted")
        child.held, child.given_up = False, False
        child.restarts.clear()
        child.start_failed = False
        self._notify()
        await self._until(lambda: child.serving or child.held or child.given_up or child.start_failed)
        if child.serving:
            return f"{child.name} is back on {child.address} (pid {child.process.pid})"
        return f"{child.name} did not come back: see the launcher's log"

    async def restart_child(self, child: Child, grace: float = 90.0) -> str:
        """Restart ``child`` on purpose, the rolling way: SIGTERM, so it drains (NOT_SERVING first, its calls
        finish within its --drain-seconds, below ``grace``), then start it again on its port and wait until it is
        healthy. Not counted against its restart budget; one stopped or given up is only started. In words."""
        if child.held or child.given_up:
            return await self.start_child(child)
        if not child.serving:
            return f"{child.name} is not serving: it is being restarted already"
        log.warning("restarting %s, as asked: it drains first", child.name)
        stopped = await self.stop_child(child, grace, again=True)
        return f"{stopped}; {await self.start_child(child)}"

    def metrics_urls(self) -> dict[str, str]:
        """`<name>-metrics` -> the /metrics URL of each server that serves one (the REST front always does)."""
        return {f"{c.name}-metrics": f"http://{self.host}:{c.metrics_port}/metrics"
                for c in self.children if c.metrics_port is not None}

    async def stop(self, grace: float = 20.0) -> None:
        """SIGTERM group by group in reverse start order (the front first, so nothing new arrives; then the
        gateways, then the workers), the members of a group at once; SIGKILL any that outlasts ``grace``."""
        for group in reversed(self._groups):
            await asyncio.gather(*(_terminate(c, grace) for c in group))
        for c in self.children:
            if c.listener is not None:
                c.listener.close()
        shutil.rmtree(self.run_dir, ignore_errors=True)

    def listen(self, port: int) -> socket.socket:
        """A listening TCP socket on this supervisor's host (port 0: a free one, bound now, so no other process can
        take it before the server starts), for `child(listener=...)`."""
        return listen_socket(self.host, port)

    async def supervise(self) -> None:
        """Keep every started child running until cancelled (the launcher cancels it before `stop`); a child
        given up waits for `retry_given_up`, one held for `start_child`, so this returns only by raising."""
        await asyncio.gather(*(self._keep_up(c) for c in self.children if c.process is not None))

    async def _keep_up(self, child: Child) -> None:
        policy, loop = self.restart, asyncio.get_running_loop()
        while True:
            await child.process.wait()
            child.serving = False
            # A restart that fails to come up is a crash like any other: it counts against the same budget.
            while True:
                if child.held:
                    log.warning("%s stopped, as asked (exit code %s); it stays down until `python -m services."
                                "launcher ctl start %s` (or a restart starts it)", child.name,
                                child.process.returncode, child.name)
                    if self.on_restart is not None:
                        self.on_restart()  # the ready file drops its PID
                    child.parked = True
                    self._notify()
                    await self._until(lambda: not child.held)
                    child.parked = False
                    log.warning("starting %s again, as asked", child.name)
                else:
                    now = time.monotonic()
                    child.restarts = [t for t in child.restarts if now - t < policy.window]
                    code = child.process.returncode
                    if len(child.restarts) >= policy.max_restarts:
                        child.given_up = True
                        log.error("GIVING UP on %s: it exited (last code %s) %d times within %.0fs; it stays down, "
                                  "the rest of the stack keeps serving; kill -USR1 %d (the launcher) retries it",
                                  child.name, code, len(child.restarts) + 1, policy.window, os.getpid())
                        self._notify()
                        await self._until(lambda: not child.given_up or child.held)
                        continue  # retried (a fresh budget) or stopped on purpose meanwhile
                    delay = policy.backoff(len(child.restarts))
                    budget = (child.port, delay, len(child.restarts) + 1, policy.max_restarts, policy.window)
                    if code in SIGNALLED_CODES:
                        # Stopped from outside the supervisor (an operator's kill, a node's shutdown): restarted all
                        # the same, but it is no crash.
                        log.warning("%s stopped by a signal (exit code %s); restarting it on port %d in %.1fs "
                                    "(restart %d of %d within %.0fs)", child.name, code, *budget)
                    else:
                        log.error("%s exited unexpectedly with code %s; restarting it on port %d in %.1fs (restart "
                                  "%d of %d within %.0fs)", child.name, code, *budget)
                    with contextlib.suppress(TimeoutError):  # an operator's stop cuts the backoff short
                        await asyncio.wait_for(self._until(lambda: child.held), delay)
                    if child.held:
                        continue
                child.restarts.append(time.monotonic())
                try:
                    await self.start([child], loop.time() + policy.startup_timeout)
                except StartupError as exc:
                    log.error("restarting %s failed: %s", child.name, exc)
                    if child.process.returncode is None:  # bound but never healthy: do not leave it behind
                        child.process.kill()
                        await child.process.wait()
                    child.start_failed = True
                    self._notify()
                    continue
                log.warning("%s is back on %s (restart %d, pid %d)", child.name, child.address, len(child.restarts),
                            child.process.pid)
                if self.on_restart is not None:
                    self.on_restart()
                self._notify()
                break
