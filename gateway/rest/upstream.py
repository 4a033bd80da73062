"""The gateway connection: the channel (plaintext or TLS) and its stubs, the reconnect wait before a call, and
the call guard that cancels a gateway call when the HTTP client hangs up."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2_grpc
from starlette.types import Receive

from glmimage.channels import TlsConfig, aio_channel
from glmimage.v1 import gateway_service_pb2, gateway_service_pb2_grpc
from services.runtime import keepalive

from .errors import from_rpc_error
from .settings import RestSettings
from .translate import Generation

log = logging.getLogger("glmimage.rest")

# Ten 2048x2048 PNGs can exceed gRPC's 4 MiB default by far. glmimage.channels adds the shared keepalive and the
# short capped reconnect backoff (a restarted gateway is reached within about a second), as on every hop.
CHANNEL_OPTIONS = keepalive.message_size_options(256 * 1024 * 1024, 64 * 1024 * 1024)


def channel_credentials(settings: RestSettings) -> TlsConfig | None:
    """The TLS material for the gateway channel, or None for plaintext. Reads the PEM files now, so a bad path
    fails at start-up rather than on the first request."""
    if not settings.gateway_tls:
        return None
    return TlsConfig.from_files(settings.gateway_tls_ca, settings.gateway_tls_client_cert,
                                settings.gateway_tls_client_key, settings.gateway_tls_server_name)


@dataclass
class Gateway:
    channel: grpc.aio.Channel
    stub: gateway_service_pb2_grpc.GatewayServiceStub
    health: health_pb2_grpc.HealthStub
    reconnect_wait: float = keepalive.RECONNECT_WAIT_S

    async def connected(self) -> None:
        """Before a call: if the channel is reconnecting (the gateway restarted or is briefly away), give it up to
        ``reconnect_wait`` seconds to be READY. A call made in TRANSIENT_FAILURE fails at once, so a request that
        arrives just before the next reconnect attempt would get 503 although the gateway is back. If it is still
        not ready the call goes ahead and fails as before (503)."""
        state = self.channel.get_state(try_to_connect=True)
        if state not in (grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.CONNECTING):
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.reconnect_wait
        while state is not grpc.ChannelConnectivity.READY:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return
            try:
                await asyncio.wait_for(self.channel.wait_for_state_change(state), remaining)
            except TimeoutError:
                return
            state = self.channel.get_state(try_to_connect=True)


def open_gateway(settings: RestSettings, tls: TlsConfig | None) -> Gateway:
    """The channel to the gateway and its stubs. grpc.aio channels bind to the running loop: call this from the
    app's lifespan, not before."""
    channel = aio_channel(settings.gateway_address, tls, CHANNEL_OPTIONS)
    return Gateway(channel, gateway_service_pb2_grpc.GatewayServiceStub(channel), health_pb2_grpc.HealthStub(channel))


class CallGuard:
    """Cancels a gateway call when the HTTP client hangs up, and maps its failures to APIError.

    It waits on ASGI `receive` (which, once the body is read, only returns `http.disconnect`) instead of
    polling, so an idle request costs nothing. The cancellation reaches the AR and denoiser work downstream.
    """

    def __init__(self, call: grpc.aio.Call, receive: Receive, rid: str = "") -> None:
        self.call = call
        self.rid = rid
        self.gone = False
        self._watcher = asyncio.create_task(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.gone = True
        self.call.cancel()

    async def wait(self, step: Awaitable[Any]) -> Any:
        """Await one step of the call (the unary result, or one stream read); None if the client went away."""
        try:
            return await step
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self.gone and not (task and task.cancelling()):
                return None
            raise
        except grpc.aio.AioRpcError as err:
            if self.gone:
                return None
            raise from_rpc_error(err, self.rid) from err

    def close(self) -> None:
        self._watcher.cancel()
        if not self.call.done():
            self.call.cancel()


async def generate(
    gateway: Gateway, gen: Generation, timeout: float, receive: Receive
) -> gateway_service_pb2.GenerateImagesResponse | None:
    """Run GenerateImages; None if the HTTP client went away (the RPC is then cancelled)."""
    await gateway.connected()
    guard = CallGuard(gateway.stub.GenerateImages(gen.request, metadata=gen.metadata, timeout=timeout), receive,
                       gen.rid)
    try:
        return await guard.wait(guard.call)
    finally:
        guard.close()
