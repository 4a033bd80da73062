"""The real gateway in-process (driver, scheduler, servicer and the interceptor `python -m gateway` installs, on a
real gRPC server) over the simulated workers of bench/sim_backends.py (real gRPC servers with health).

A test can hold every denoise job after its first step (SimCluster.gate) and look at the gateway meanwhile; the
helpers wait on conditions, never a fixed time.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass

import grpc
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from bench.sim_backends import SimAr, SimCosts, SimDenoiser, serve_sim_ar, serve_sim_denoiser
from gateway.auth import GatewayAuth
from gateway.config import GatewayConfig
from gateway.driver import Driver
from gateway.membership import parse_allow_rule
from gateway.metrics import GatewayMetrics
from gateway.scheduler.types import SchedulerConfig
from gateway.servicer import GatewayServicer
from glmimage.v1 import gateway_service_pb2 as pb
from glmimage.v1 import gateway_service_pb2_grpc
from runtime.server import GrpcServer, start_server
from runtime.tenants import Tenant, TenantsFile, tenants_from_keys
from runtime.tls import ClientTls

GATEWAY = "glmimage.v1.GatewayService"
FAST = SimCosts(scale=0.001)  # AR ~20-33 ms, denoise ~12 ms
AVAILABLE, BUSY, DRAINING = pb.WORKER_STATE_AVAILABLE, pb.WORKER_STATE_BUSY, pb.WORKER_STATE_DRAINING
ADMIN_KEY = "admin-key-for-tests"
ADMIN = (("authorization", f"Bearer {ADMIN_KEY}"),)  # call metadata for the admin RPCs
LOOPBACK = (parse_allow_rule("127.0.0.0/8"),)  # what AddWorker may add in these tests


@dataclass
class SimCluster:
    ar: GrpcServer
    denoisers: list[GrpcServer]
    gate: asyncio.Event  # jobs hold after their first step until it is set

    def address(self, server: GrpcServer) -> str:
        return f"127.0.0.1:{server.port}"

    @property
    def sims(self) -> list[SimDenoiser]:
        return [d.servicer for d in self.denoisers]


@dataclass
class Gateway:
    stub: gateway_service_pb2_grpc.GatewayServiceStub
    driver: Driver
    channel: grpc.aio.Channel
    port: int
    # What status() presents: the admin key when the gateway has it, so the tests see every address and job id.
    status_metadata: tuple[tuple[str, str], ...] = ()

    async def status(self) -> pb.GetStatusResponse:
        return await self.stub.GetStatus(pb.GetStatusRequest(), metadata=self.status_metadata)

    async def workers(self) -> dict[str, pb.WorkerStatus]:
        return {w.address: w for w in (await self.status()).workers}

    async def until(self, predicate: Callable[[pb.GetStatusResponse], bool], timeout: float = 10.0
                    ) -> pb.GetStatusResponse:
        async with asyncio.timeout(timeout):
            while not predicate(status := await self.status()):
                await asyncio.sleep(0.005)
        return status


async def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.005)


@contextlib.asynccontextmanager
async def sim_cluster() -> AsyncIterator[SimCluster]:
    """One simulated AR and three simulated denoisers, SERVING."""
    gate = asyncio.Event()
    gate.set()
    ar = await serve_sim_ar(SimAr(FAST, cached_tokens=5))
    denoisers = [await serve_sim_denoiser(SimDenoiser(FAST, gate=gate)) for _ in range(3)]
    yield SimCluster(ar, denoisers, gate)
    gate.set()
    for server in (ar, *denoisers):
        await server.stop(None)


@contextlib.asynccontextmanager
async def running_gateway(ar: list[str], denoisers: list[str], *, metrics: GatewayMetrics | None = None,
                          api_keys: tuple[str, ...] = (), admin_keys: tuple[str, ...] = (ADMIN_KEY,),
                          worker_allow: tuple = LOOPBACK, max_workers: int = 256,
                          worker_metadata: tuple[tuple[str, str], ...] = (), wait_available: bool = True,
                          client_tls: ClientTls | None = None, config_fields: Mapping[str, object] | None = None,
                          tenants: TenantsFile | None = None, **scheduler: object) -> AsyncIterator[Gateway]:
    """The real gateway in-process, with the interceptor `python -m gateway` installs (gateway.auth).
    ``config_fields``: other GatewayConfig fields (health probe settings, ...); ``tenants``: a tenants file in
    place of the key flags; ``scheduler``: SchedulerConfig's."""
    config = GatewayConfig(ar_addresses=tuple(ar), denoiser_addresses=tuple(denoisers),
                           scheduler=SchedulerConfig(ar_batch_delay=0.0, **scheduler),  # type: ignore[arg-type]
                           request_timeout=30, api_keys=api_keys, admin_keys=admin_keys, worker_allow=worker_allow,
                           max_workers=max_workers, worker_metadata=worker_metadata,
                           client_tls=client_tls, **(config_fields or {}))  # type: ignore[arg-type]
    driver = Driver(config, metrics=metrics)
    tenants = tenants or TenantsFile(None, tenants_from_keys(api_keys, admin_keys))
    servicer = GatewayServicer(driver, config, tenants)
    interceptors = [GatewayAuth(tenants)]
    server = await start_server(lambda s: gateway_service_pb2_grpc.add_GatewayServiceServicer_to_server(servicer, s),
                                [GATEWAY], "127.0.0.1:0", interceptors=interceptors)
    await driver.start()
    await server.set_serving(True)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    admin = ADMIN_KEY in admin_keys or (tenants.current.lookup(ADMIN_KEY.encode()) or Tenant("")).role == "admin"
    gw = Gateway(gateway_service_pb2_grpc.GatewayServiceStub(channel), driver, channel, server.port,
                 ADMIN if admin else ())
    if wait_available:  # the health watchers have seen every worker SERVING
        n = len(ar) + len(denoisers)
        await wait_for(lambda: sum(w.state.value == "AVAILABLE" for w in driver.snapshot().workers) == n)
    try:
        yield gw
    finally:
        await channel.close()
        await server.stop(None)
        await driver.close()


def request(n: int = 1, **kw: object) -> pb.GenerateImagesRequest:
    return pb.GenerateImagesRequest(prompt='a blue "OPEN" sign', n=n, height=64, width=64, seed=7, **kw)


async def rpc_error(call: Awaitable[object]) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    return err.value


def scrape(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}
