"""`python -m services.stack` (what `make run` starts): the whole suite on one machine, one process per server.

AR server, denoisers, GatewayService and the REST front each run in their own process. The launcher starts
them in dependency order, waits for each to report SERVING, prints the addresses, and on Ctrl-C or SIGTERM
stops them all. Children also get SIGKILL from the kernel if the launcher itself dies, so none is orphaned.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import secrets
import shutil
import signal
import sys
import tempfile
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.runtime.logs import configure_logging

log = logging.getLogger("services.stack")

@dataclass
class Child:
    name: str
    argv: list[str]
    port_file: Path
    health_service: str | None  # None: an HTTP server, checked on /health
    process: asyncio.subprocess.Process | None = None
    port: int = 0
    extra: dict = field(default_factory=dict)
    metrics_port: int | None = None  # the --metrics-port it was given (the REST front: its own port)
    env: dict[str, str] = field(default_factory=dict)  # added to the launcher's environment

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


class StackError(RuntimeError):
    pass


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--rest-port", type=int, default=8000)
    p.add_argument("--gateway-port", type=int, default=50050)
    p.add_argument("--ar-port", type=int, default=50051)
    p.add_argument("--denoiser-ports", default="50061,50062",
                   help="comma-separated; one denoiser process per port (0 = pick a free port)")
    p.add_argument("--ar-metrics-port", type=int, default=None,
                   help="the AR's Prometheus /metrics port (0 = pick a free port); off when unset")
    p.add_argument("--denoiser-metrics-ports", default=None,
                   help="comma-separated, one per --denoiser-ports entry (0 = pick a free port; denoisers beyond the "
                        "list pick one too, extra entries are unused); off when unset")
    p.add_argument("--gateway-metrics-port", type=int, default=None,
                   help="the gateway's Prometheus /metrics port (0 = pick a free port); off when unset "
                        "(the REST front always serves /metrics on its own port)")
    p.add_argument("--model-path", default=None, help="GLM-Image checkpoint; default: the embedded tiny model")
    p.add_argument("--device", default="auto")
    p.add_argument("--torch-threads", type=int, default=1,
                   help="torch threads per model process (default 1: several processes share the cores)")
    p.add_argument("--ready-file", type=Path, default=None,
                   help="write a JSON map of role -> address here once everything is SERVING")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--gateway-arg", action="append", default=[], help="extra flag passed to the gateway")
    p.add_argument("--rest-arg", action="append", default=[], help="extra flag passed to the REST front")
    p.add_argument("--internal-token", action="store_true",
                   help="make AR and denoisers require a random token made for this run, which the gateway "
                        "presents (through the environment, $GLMIMAGE_INTERNAL_TOKEN); off by default, so the "
                        "README's grpcurl calls straight to the AR and denoisers work without a header")
    return p.parse_args(argv)


def _metrics_port(port: int | str | None) -> int | None:
    """The port to give a server's --metrics-port: 0 is resolved here, because the servers do not report the
    port they bound for /metrics (there is a short window in which another process could take it)."""
    if port is None:
        return None
    port = int(port)
    if port:
        return port
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def _wait_port(child: Child, deadline: float) -> None:
    loop = asyncio.get_running_loop()
    while not child.port_file.exists():
        if child.process.returncode is not None:
            raise StackError(f"{child.name} exited with code {child.process.returncode} during start-up")
        if loop.time() > deadline:
            raise StackError(f"{child.name} did not bind a port in time")
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
    raise StackError(f"{child.name} never became SERVING")


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
            raise StackError(f"{child.name} exited with code {child.process.returncode} during start-up")
        if loop.time() > deadline:
            raise StackError(f"{child.name} did not become healthy in time")
        await asyncio.sleep(0.1)


class Stack:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.children: list[Child] = []
        self.run_dir = Path(tempfile.mkdtemp(prefix="glmimage-stack-"))

    def _child(self, name: str, module: str, port: int, flags: list[str], health: str | None,
               env: dict[str, str] | None = None, metrics_port: int | None = None) -> Child:
        port_file = self.run_dir / f"{name}.port"
        argv = [sys.executable, "-m", module, "--host", self.args.host, "--port", str(port),
                "--port-file", str(port_file), "--log-level", self.args.log_level, *flags]
        if metrics_port is not None:
            argv += ["--metrics-port", str(metrics_port)]
        child = Child(name=name, argv=argv, port_file=port_file, health_service=health, env=dict(env or {}))
        child.metrics_port = metrics_port
        self.children.append(child)
        return child

    async def _spawn(self, child: Child) -> None:
        log.info("starting %s", child.name)
        # Through the die_with_parent trampoline, so no child outlives the launcher (see that module for why not
        # a preexec_fn).
        child.process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "services.runtime.die_with_parent", str(os.getpid()), "--", *child.argv,
            env={**os.environ, **child.env})

    async def start(self) -> dict[str, str]:
        a = self.args
        loop = asyncio.get_running_loop()
        deadline = loop.time() + a.startup_timeout
        model_flags = ["--device", a.device, "--torch-threads", str(a.torch_threads)]
        if a.model_path:
            model_flags += ["--model-path", a.model_path]
        else:
            # Build the tiny checkpoint once, up front, rather than have every server race for the lock.
            from services.model.tiny import ensure_tiny_checkpoint

            await asyncio.to_thread(ensure_tiny_checkpoint)
        # The token goes through the environment, not argv, so `ps` does not show it.
        token_env = {"GLMIMAGE_INTERNAL_TOKEN": secrets.token_urlsafe(32)} if a.internal_token else {}
        ar = self._child("ar", "services.ar", a.ar_port, model_flags, "glmimage.v1.ArService", token_env,
                         _metrics_port(a.ar_metrics_port))
        ports = a.denoiser_ports.split(",")
        # `make run DENOISER_PORTS=a,b,c` must work with the default two metrics ports: a denoiser beyond the list
        # gets a free one (printed in the banner), and unused entries are ignored.
        metrics_ports: list[str | None] = [None] * len(ports)
        if a.denoiser_metrics_ports is not None:
            given = a.denoiser_metrics_ports.split(",")
            metrics_ports = [given[i] if i < len(given) else "0" for i in range(len(ports))]
        denoisers = [self._child(f"denoiser-{i}", "services.denoiser", int(p), model_flags,
                                 "glmimage.v1.DenoiserService", token_env, _metrics_port(m))
                     for i, (p, m) in enumerate(zip(ports, metrics_ports, strict=True))]
        model_children = [ar, *denoisers]
        await asyncio.gather(*(self._spawn(c) for c in model_children))
        await asyncio.gather(*(_wait_port(c, deadline) for c in model_children))
        await asyncio.gather(*(_wait_serving(c, deadline) for c in model_children))

        gw_flags = ["--ar", ar.address, *[f"--denoiser={d.address}" for d in denoisers], *a.gateway_arg]
        gateway = self._child("gateway", "gateway", a.gateway_port, gw_flags, "glmimage.v1.GatewayService",
                              token_env, _metrics_port(a.gateway_metrics_port))
        await self._spawn(gateway)
        await _wait_port(gateway, deadline)
        await _wait_serving(gateway, deadline)

        rest = self._child("rest", "gateway.rest", a.rest_port, ["--gateway-address", gateway.address,
                                                                 *a.rest_arg], None)
        await self._spawn(rest)
        await _wait_port(rest, deadline)
        await _wait_http_health(rest, deadline)
        rest.metrics_port = rest.port
        return {c.name: c.address for c in self.children}

    def metrics_urls(self) -> dict[str, str]:
        """`<name>-metrics` -> the /metrics URL of each server that serves one (the REST front always does)."""
        return {f"{c.name}-metrics": f"http://{self.args.host}:{c.metrics_port}/metrics"
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


async def run(args: argparse.Namespace) -> int:
    stack = Stack(args)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    code = 0
    try:
        starting = asyncio.ensure_future(stack.start())
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            starting.cancel()
            return 130
        stopping.cancel()
        addresses = starting.result()
        rest = addresses["rest"]
        lines = [f"  {name:<12} {addr}" for name, addr in addresses.items()]
        # After the address lines, which stay as they were (tools parse them): one line per /metrics endpoint.
        metrics = stack.metrics_urls()
        lines += [f"  {name:<20} {url}" for name, url in metrics.items()]
        if args.ready_file:
            args.ready_file.write_text(json.dumps({**addresses, **metrics}))
        print("GLM-Image stack is up:\n" + "\n".join(lines) +
              f"\n\n  try: curl -s http://{rest}/v1/images/generations -H 'Content-Type: application/json' "
              "-d '{\"prompt\":\"a red \\\"STOP\\\" sign\",\"n\":1,\"size\":\"256x256\"}'\n"
              "  Ctrl-C stops everything.", flush=True)
        exited = asyncio.ensure_future(stack.wait_any_exit())
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait({exited, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if exited.done():
            child = exited.result()
            log.error("%s exited unexpectedly with code %s; stopping the stack", child.name,
                      child.process.returncode)
            code = 1
        else:
            exited.cancel()
    except StackError as exc:
        log.error("%s", exc)
        code = 1
    finally:
        log.info("stopping the stack")
        await stack.stop()
    return code


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    configure_logging(args.log_level)
    sys.exit(asyncio.run(run(args)))


if __name__ == "__main__":
    main()
