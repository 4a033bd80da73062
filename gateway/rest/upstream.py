"""The gateway connections: one channel (plaintext or TLS) and its stubs per gateway address, the round robin over
them and the resubmission to the next one when a gateway is gone, the reconnect wait before a call, and the call
guard that cancels a gateway call when the HTTP client hangs up."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2_grpc
from starlette.types import Receive

from glmimage.channels import TlsConfig, aio_channel, balanced_target
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


def open_gateway(settings: RestSettings, tls: TlsConfig | None, address: str | None = None) -> Gateway:
    """The channel to one gateway (``address``, default the first of the settings') and its stubs. grpc.aio
    channels bind to the running loop: call this from the app's lifespan, not before."""
    # A dns:/// name gets grpc's round_robin over what it resolves to; a plain host:port stays as it was.
    target, lb = balanced_target(address or settings.gateway_addresses[0])
    channel = aio_channel(target, tls, [*CHANNEL_OPTIONS, *lb])
    return Gateway(channel, gateway_service_pb2_grpc.GatewayServiceStub(channel), health_pb2_grpc.HealthStub(channel))


@dataclass
class Gateways:
    """Every gateway this front may call, taken in turn. One per address; with one address, just that one."""

    members: list[Gateway]
    _next: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        if not self.members:
            raise ValueError("no gateway")

    @property
    def first(self) -> Gateway:
        return self.members[0]

    def attempts(self) -> list[Gateway]:
        """The order to try them in for one request: round robin from the next one, each once, and those whose
        channel is down (TRANSIENT_FAILURE) last, so a dead gateway costs a request neither a failed call nor
        the reconnect wait while another one serves."""
        start, count = self._next, len(self.members)
        self._next = (start + 1) % count
        turn = [self.members[(start + i) % count] for i in range(count)]
        if count == 1:
            return turn
        return sorted(turn, key=lambda g: g.channel.get_state(try_to_connect=True)
                      is grpc.ChannelConnectivity.TRANSIENT_FAILURE)

    def __iter__(self) -> Iterator[Gateway]:
        return iter(self.members)

    async def close(self) -> None:
        await asyncio.gather(*(g.channel.close() for g in self.members))


def open_gateways(settings: RestSettings, tls: TlsConfig | None) -> Gateways:
    return Gateways([open_gateway(settings, tls, a) for a in settings.gateway_addresses])


class GatewayGone(Exception):
    """A call failed UNAVAILABLE before any answer was relayed, and another gateway is left to resubmit to."""

    def __init__(self, err: grpc.aio.AioRpcError) -> None:
        super().__init__(err.details())
        self.err = err


class CallGuard:
    """Cancels a gateway call when the HTTP client hangs up, and maps its failures to APIError.

    It waits on ASGI `receive` (which, once the body is read, only returns `http.disconnect`) instead of
    polling, so an idle request costs nothing. The cancellation reaches the AR and denoiser work downstream.
    """

    def __init__(self, call: grpc.aio.Call, receive: Receive, rid: str = "", resubmit: bool = False) -> None:
        self.call = call
        self.rid = rid
        # Whether an UNAVAILABLE raises GatewayGone (another gateway may take the request) rather than the 503.
        self.resubmit = resubmit
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
            if self.resubmit and err.code() is grpc.StatusCode.UNAVAILABLE:
                raise GatewayGone(err) from err
            raise from_rpc_error(err, self.rid) from err

    def close(self) -> None:
        self._watcher.cancel()
        if not self.call.done():
            self.call.cancel()


def resubmissions(gateways: Gateways, rid: str) -> Iterator[tuple[Gateway, bool]]:
    """Each gateway to try for one request, with whether a GatewayGone from it may still go to the next one (not
    from the last: its failure is the answer)."""
    order = gateways.attempts()
    for i, gateway in enumerate(order):
        if i:
            log.warning("%s gateway unavailable before answering; resubmitting to the next one (%d/%d)", rid,
                        i + 1, len(order))
        yield gateway, i < len(order) - 1


async def generate(
    gateways: Gateways, gen: Generation, timeout: float, receive: Receive
) -> gateway_service_pb2.GenerateImagesResponse | None:
    """Run GenerateImages; None if the HTTP client went away (the RPC is then cancelled). A gateway that fails
    it UNAVAILABLE hands it to the next one, each gateway at most once."""
    for gateway, more in resubmissions(gateways, gen.rid):
        await gateway.connected()
        guard = CallGuard(gateway.stub.GenerateImages(gen.request, metadata=gen.metadata, timeout=timeout), receive,
                          gen.rid, resubmit=more)
        try:
            return await guard.wait(guard.call)
        except GatewayGone:
            continue
        finally:
            guard.close()
    raise AssertionError("unreachable: the last gateway's failure is raised")
