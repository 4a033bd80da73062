"""TLS on every gRPC hop, with mutual TLS: a real AR, denoiser (tiny model) and gateway, certificates made at test
time (tests/support/certs.py)."""
from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from gateway.config import GatewayConfig
from gateway.driver import Driver
from gateway.scheduler.types import SchedulerConfig
from gateway.servicer import GatewayServicer
from glmimage.v1 import gateway_service_pb2, gateway_service_pb2_grpc
from runtime.executor import SerialExecutor
from runtime.server import common_server_args, start_server
from runtime.tls import (
    ClientTls,
    ServerTls,
    client_tls_args,
    client_tls_from_args,
    make_channel,
    server_tls_from_args,
)
from tests.support.certs import Pki
from tests.support.servers import serve_ar, serve_denoiser


@pytest.fixture
async def mtls_gateway(pki: Pki, ar_engine, denoise_engine, denoiser_server) -> AsyncIterator[int]:
    server_tls = ServerTls(cert=pki.server_cert, key=pki.server_key, client_ca=pki.ca)
    ar = await serve_ar(ar_engine, SerialExecutor("tls-ar"), tls=server_tls)
    # The session denoiser's executor: one engine must never run two jobs at once.
    dn = await serve_denoiser(denoise_engine, denoiser_server.servicer.executor, tls=server_tls)
    config = GatewayConfig(ar_addresses=(f"127.0.0.1:{ar.port}",), denoiser_addresses=(f"127.0.0.1:{dn.port}",),
                           scheduler=SchedulerConfig(ar_batch_delay=0.0), request_timeout=60,
                           client_tls=ClientTls(ca=pki.ca, cert=pki.client_cert, key=pki.client_key))
    driver = Driver(config)
    servicer = GatewayServicer(driver, config)
    gw = await start_server(lambda s: gateway_service_pb2_grpc.add_GatewayServiceServicer_to_server(servicer, s),
                            ["glmimage.v1.GatewayService"], "127.0.0.1:0", tls=server_tls)
    await driver.start()
    await gw.set_serving(True)
    yield gw.port
    for server in (gw, ar, dn):
        await server.stop(None)
    await driver.close()


async def test_mutual_tls_end_to_end_and_refusals(pki: Pki, mtls_gateway: int) -> None:
    address = f"127.0.0.1:{mtls_gateway}"
    request = gateway_service_pb2.GenerateImagesRequest(prompt='a "TLS" sign', height=64, width=64, seed=3)
    async with make_channel(address, ClientTls(ca=pki.ca, cert=pki.client_cert, key=pki.client_key)) as channel:
        stub = gateway_service_pb2_grpc.GatewayServiceStub(channel)
        # wait_for_ready rides out the gateway's first health checks of its (TLS) workers.
        resp = await stub.GenerateImages(request, timeout=60, wait_for_ready=True)
        assert resp.images[0].image.startswith(b"\x89PNG") and resp.usage.completion_tokens > 0
    refused = [ClientTls(ca=pki.ca),  # no client certificate
               ClientTls(ca=pki.ca, cert=pki.rogue_cert, key=pki.rogue_key),  # one from another CA
               None]  # plaintext
    for tls in refused:
        async with make_channel(address, tls) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await gateway_service_pb2_grpc.GatewayServiceStub(channel).GetStatus(
                    gateway_service_pb2.GetStatusRequest(), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, tls


async def test_one_denoiser_on_tls_beside_plaintext_ones(pki: Pki, ar_server, denoiser_server, denoise_engine,
                                                         second_denoiser_server) -> None:
    """A pool moving to TLS one worker at a time: the gateway dials each upstream as its address says."""
    tls_dn = await serve_denoiser(denoise_engine, denoiser_server.servicer.executor,
                                  tls=ServerTls(pki.server_cert, pki.server_key, pki.ca))
    tls_address = f"tls://127.0.0.1:{tls_dn.port}"
    config = GatewayConfig(ar_addresses=(f"127.0.0.1:{ar_server.port}",),
                           denoiser_addresses=(tls_address, f"127.0.0.1:{second_denoiser_server.port}"),
                           scheduler=SchedulerConfig(ar_batch_delay=0.0), request_timeout=60,
                           client_tls=ClientTls(ca=pki.ca, cert=pki.client_cert, key=pki.client_key,
                                                only_marked=True))
    driver = Driver(config)
    gw = await start_server(lambda s: gateway_service_pb2_grpc.add_GatewayServiceServicer_to_server(
        GatewayServicer(driver, config), s), ["glmimage.v1.GatewayService"], "127.0.0.1:0")
    await driver.start()
    await gw.set_serving(True)
    try:
        async with make_channel(f"127.0.0.1:{gw.port}") as channel:
            stub = gateway_service_pb2_grpc.GatewayServiceStub(channel)
            for _ in range(600):  # the health watches see both denoisers SERVING, the TLS one over TLS
                status = await stub.GetStatus(gateway_service_pb2.GetStatusRequest())
                if sum(w.state == gateway_service_pb2.WORKER_STATE_AVAILABLE for w in status.workers) == 3:
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError(f"workers not all available: {status}")
            resp = await stub.GenerateImages(gateway_service_pb2.GenerateImagesRequest(
                prompt='a "TLS" sign', n=2, height=64, width=64, seed=3), timeout=60)
            assert len(resp.images) == 2
            assert tls_dn.servicer.last_job is not None  # the TLS denoiser ran one of the two
    finally:
        for server in (gw, tls_dn):
            await server.stop(None)
        await driver.close()


def test_tls_flags(pki: Pki) -> None:
    server = argparse.ArgumentParser(parents=[common_server_args(1)])
    args = server.parse_args(["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
                              "--tls-client-ca", str(pki.ca)])
    assert server_tls_from_args(args) == ServerTls(pki.server_cert, pki.server_key, pki.ca)
    assert server_tls_from_args(server.parse_args([])) is None
    for bad in (["--tls-cert", "c.pem"], ["--tls-client-ca", "ca.pem"]):
        with pytest.raises(SystemExit):
            server_tls_from_args(server.parse_args(bad))
    client = argparse.ArgumentParser(parents=[client_tls_args()])
    assert client_tls_from_args(client.parse_args([])) is None
    assert client_tls_from_args(client.parse_args(["--tls-ca", "ca.pem"])) == ClientTls(ca=Path("ca.pem"))
    assert client_tls_from_args(client.parse_args(["--tls-ca", "ca.pem", "--tls-only-marked"])).only_marked
    with pytest.raises(SystemExit):
        client_tls_from_args(client.parse_args(["--tls-client-cert", "c.pem"]))
