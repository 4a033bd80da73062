"""Process supervision for the launcher (services/launcher.py): spawn servers, gate on their health, stop them all.

Every server module takes the same `--host/--port/--port-file/--log-level` flags, so a child is a module name plus
its own flags. Children run through the die_with_parent trampoline, so none outlives the supervisor.
"""
from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import sys
import tempfile
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

log = logging.getLogger("services.supervisor")


@dataclass
class Child:
    name: str
    argv: list[str]
    port_file: Path
    health_service: str | None  # None: an HTTP server, checked on /health
    process: asyncio.subprocess.Process | None = None
    port: int = 0
    metrics_port: int | None = None  # the --metrics-port it was given (the REST front: its own port)
    env: dict[str, str] = field(default_factory=dict)  # added to the supervisor's environment

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


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


class Supervisor:
    """The children in start order; `start` brings a group up together, `stop` takes them down in reverse."""

    def __init__(self, host: str, log_level: str) -> None:
        self.host, self.log_level = host, log_level
        self.children: list[Child] = []
        self.run_dir = Path(tempfile.mkdtemp(prefix="glmimage-stack-"))

    def child(self, name: str, module: str, port: int, flags: list[str], health: str | None,
              env: dict[str, str] | None = None, metrics_port: int | None = None) -> Child:
        port_file = self.run_dir / f"{name}.port"
        argv = [sys.executable, "-m", module, "--host", self.host, "--port", str(port),
                "--port-file", str(port_file), "--log-level", self.log_level, *flags]
        if metrics_port is not None:
            argv += ["--metrics-port", str(metrics_port)]
        child = Child(name=name, argv=argv, port_file=port_file, health_service=health, env=dict(env or {}),
                      metrics_port=metrics_port)
        self.children.append(child)
        return child

    async def _spawn(self, child: Child) -> None:
        log.info("starting %s", child.name)
        # Through the die_with_parent trampoline, so no child outlives the launcher (see that module for why not
        # a preexec_fn).
        child.process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "services.runtime.die_with_parent", str(os.getpid()), "--", *child.argv,
            env={**os.environ, **child.env})

    async def start(self, group: list[Child], deadline: float) -> None:
        """Spawn `group` at once, then wait until every member has bound its port and reports healthy."""
        await asyncio.gather(*(self._spawn(c) for c in group))
        await asyncio.gather(*(_wait_port(c, deadline) for c in group))
        await asyncio.gather(*(_wait_serving(c, deadline) if c.health_service is not None
                               else _wait_http_health(c, deadline) for c in group))

    def addresses(self) -> dict[str, str]:
        return {c.name: c.address for c in self.children}

    def metrics_urls(self) -> dict[str, str]:
        """`<name>-metrics` -> the /metrics URL of each server that serves one (the REST front always does)."""
        return {f"{c.name}-metrics": f"http://{self.host}:{c.metrics_port}/metrics"
                for c in self.children if c.metrics_port is not None}

    async def stop(self, grace: float = 20.0) -> None:
        """SIGTERM in reverse start order (front first, so nothing new arrives), then SIGKILL stragglers."""
        for child in reversed(self.children):
            if child.process and child.process.returncode is None:
                child.process.send_signal(signal.SIGTERM)
                try:
                    await asyncio.wait_for(child.process.wait(), grace)
                except TimeoutError:
                    log.warning("%s did not stop in %.0fs; killing it", child.name, grace)
                    child.process.kill()
                    await child.process.wait()
        shutil.rmtree(self.run_dir, ignore_errors=True)

    async def wait_any_exit(self) -> Child:
        waits = {asyncio.ensure_future(c.process.wait()): c for c in self.children}
        done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        return waits[next(iter(done))]
