"""The gateway connections: one channel (plaintext or TLS) and its stubs per gateway address, the round robin over
them and the resubmission to the next one when a gateway is gone (or, on one balanced channel, to its next
backend), the reconnect wait before a call, and the call guard that cancels a gateway call when the HTTP client
hangs up."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import Awaitable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2_grpc
from starlette.types import Receive

from glmimage.v1 import gateway_service_pb2, gateway_service_pb2_grpc, job_service_pb2_grpc
from glmimage.wire.channels import TlsConfig, aio_channel, balanced_target
from runtime import keepalive

from .errors import from_rpc_error
from .ratelimits import rate_limit_headers
from .settings import RestSettings
from .translate import Generation

log = logging.getLogger("glmimage.rest")

# Ten 2048x2048 PNGs can exceed gRPC's 4 MiB default by far. glmimage.wire.channels adds the shared keepalive and the
# short capped reconnect backoff (a restarted gateway is reached within about a second), as on every hop.
CHANNEL_OPTIONS = keepalive.message_size_options(256 * 1024 * 1024, 64 * 1024 * 1024)

GATEWAY_SERVICE = gateway_service_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name
# A balanced channel (one target grpc spreads over several gateways, e.g. dns:///<headless Service>:port) gets
# round_robin with grpc's client-side health checking: a gateway whose health says NOT_SERVING for GatewayService
# (starting, or draining after SIGTERM, when it refuses new calls) gets no new call from this front although its
# connection stays up. A gateway without the health service (UNIMPLEMENTED) counts as serving.
BALANCED_SERVICE_CONFIG = json.dumps({"loadBalancingConfig": [{"round_robin": {}}],
                                      "healthCheckConfig": {"serviceName": GATEWAY_SERVICE}})
# At most this many resubmissions of one request on one balanced channel, whatever its name resolves to.
MAX_BALANCED_RESUBMISSIONS = 8
# How long counting a dns: target's backends may take, and how long a count stands for the next failures.
RESOLVE_TIMEOUT_S = 2.0
RESOLVE_REUSE_S = 1.0


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
    # The grpc target, and whether round_robin spreads this channel's calls over what it names or resolves to.
    target: str = ""
    balanced: bool = False
    _count: tuple[float, asyncio.Future[int]] | None = field(default=None, repr=False)
    jobs: job_service_pb2_grpc.JobServiceStub | None = None

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

    async def other_backends(self) -> int:
        """After a call on this channel failed UNAVAILABLE before any answer: how many more times the request may
        go to it, once per other backend (round_robin picks the next ready one; a dead one has left that set).
        An ipv4:/ipv6: list names its backends: one fewer than it holds. A dns: name is resolved now, and every
        address counts, since the one that failed may have left DNS already (at worst one attempt more when all
        are down). Bounded by MAX_BALANCED_RESUBMISSIONS; 0 for a channel to one address."""
        if not self.balanced:
            return 0
        if self.target.startswith(("ipv4:", "ipv6:")):
            count = len(self.target.split(":", 1)[1].split(",")) - 1
        else:
            # One resolution serves the failures of the next moment (a gateway that dies fails many calls at once).
            loop = asyncio.get_running_loop()
            if self._count is None or loop.time() - self._count[0] > RESOLVE_REUSE_S:
                self._count = (loop.time(), asyncio.ensure_future(resolved_addresses(self.target)))
            count = await asyncio.shield(self._count[1])
        return max(0, min(count, MAX_BALANCED_RESUBMISSIONS))


def dns_host_port(target: str) -> tuple[str, str]:
    """The host and port of a grpc ``dns:`` target (``dns:name:port``, ``dns:///name:port``,
    ``dns://server/name:port``; grpc's default port is 443)."""
    rest = target.removeprefix("dns:")
    if rest.startswith("//"):  # an authority (the DNS server to ask), then the name
        rest = rest[2:].partition("/")[2]
    if rest.startswith("["):
        host, _, port = rest[1:].partition("]")
        port = port.removeprefix(":")
    elif ":" in rest:
        host, _, port = rest.rpartition(":")
    else:
        host, port = rest, ""
    return host, port or "443"


async def resolved_addresses(target: str, timeout: float = RESOLVE_TIMEOUT_S) -> int:
    """How many addresses a ``dns:`` target's name resolves to now, through the system resolver; 0 when it
    resolves to none, fails or takes longer than ``timeout``."""
    host, port = dns_host_port(target)
    loop = asyncio.get_running_loop()
    try:
        infos = await asyncio.wait_for(loop.getaddrinfo(host, port, type=socket.SOCK_STREAM), timeout)
    except (OSError, TimeoutError, UnicodeError):
        return 0
    return len({info[4][0] for info in infos})


def open_gateway(settings: RestSettings, tls: TlsConfig | None, address: str | None = None) -> Gateway:
    """The channel to one gateway (``address``, default the first of the settings') and its stubs. grpc.aio
    channels bind to the running loop: call this from the app's lifespan, not before."""
    # A dns:/// name gets grpc's round_robin over what it resolves to, skipping gateways that say NOT_SERVING; a
    # plain host:port stays as it was.
    target, lb = balanced_target(address or settings.gateway_addresses[0])
    balanced = bool(lb)
    options = [*CHANNEL_OPTIONS, *([("grpc.service_config", BALANCED_SERVICE_CONFIG)] if balanced else [])]
    channel = aio_channel(target, tls, options)
    return Gateway(channel, gateway_service_pb2_grpc.GatewayServiceStub(channel), health_pb2_grpc.HealthStub(channel),
                   target=target, balanced=balanced, jobs=job_service_pb2_grpc.JobServiceStub(channel))


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
    """A call failed UNAVAILABLE before any answer was relayed: the request may go to another gateway."""

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
        # Whether an UNAVAILABLE raises GatewayGone (another gateway may take the request) rather than the 503:
        # until the first answer is relayed.
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


class Resubmissions:
    """The gateways to try for one request, as an async iterator: the first in the round robin, then, each time
    the caller comes back for another (its call failed UNAVAILABLE before any answer: GatewayGone), the same
    balanced channel again while it has other backends (Gateway.other_backends), else the next gateway. Every
    gateway of the list once, in ``Gateways.attempts`` order. The caller answers with its last failure when
    they run out (``unanswered``)."""

    def __init__(self, gateways: Gateways, rid: str, timeout: float) -> None:
        self.rid = rid
        self._order = gateways.attempts()
        self._index = 0
        self._again: int | None = None  # resubmissions left on the current gateway, once counted
        self.tries = 0
        # One deadline for the request, however many gateways it goes to: a resubmission gets what is left.
        self._deadline = asyncio.get_running_loop().time() + timeout

    def remaining(self) -> float:
        return self._deadline - asyncio.get_running_loop().time()

    def __aiter__(self) -> Resubmissions:
        return self

    async def __anext__(self) -> Gateway:
        if self.tries and self.remaining() <= 0:
            raise StopAsyncIteration  # the last failure is the answer
        if self.tries:
            current = self._order[self._index]
            if self._again is None:
                self._again = await current.other_backends()
            if self._again > 0:
                self._again -= 1
                where = "on the same balanced channel"
            else:
                self._index, self._again = self._index + 1, None
                if self._index == len(self._order):
                    raise StopAsyncIteration
                where = "to the next gateway"
            log.warning("%s gateway unavailable before answering; resubmitting %s (attempt %d)", self.rid, where,
                        self.tries + 1)
        self.tries += 1
        return self._order[self._index]


def unanswered(gone: GatewayGone | None, rid: str) -> Exception:
    """The client's error once every attempt of a request failed UNAVAILABLE before answering: the last one's."""
    if gone is None:  # not reached: Gateways holds one gateway at least, so there is a first attempt
        return AssertionError("no gateway was tried")
    return from_rpc_error(gone.err, rid)


@dataclass(frozen=True)
class Reply:
    """A gateway's answer to GenerateImages, and its call's rate-limit figures as HTTP headers (none for a tenant
    without quotas)."""

    response: gateway_service_pb2.GenerateImagesResponse
    headers: dict[str, str]


async def generate(gateways: Gateways, gen: Generation, timeout: float, receive: Receive) -> Reply | None:
    """Run GenerateImages; None if the HTTP client went away (the RPC is then cancelled). A gateway that fails
    it UNAVAILABLE hands it to the next one (see Resubmissions); the last failure is the answer."""
    gone: GatewayGone | None = None
    attempts = Resubmissions(gateways, gen.rid, timeout)
    async for gateway in attempts:
        await gateway.connected()
        guard = CallGuard(gateway.stub.GenerateImages(gen.request, metadata=gen.metadata,
                                                      timeout=attempts.remaining()), receive, gen.rid, resubmit=True)
        try:
            resp = await guard.wait(guard.call)
            if resp is None:
                return None
            # Initial metadata came before the response: reading it now waits for nothing.
            return Reply(resp, rate_limit_headers(await guard.call.initial_metadata()))
        except GatewayGone as exc:
            gone = exc
        finally:
            guard.close()
    raise unanswered(gone, gen.rid) from gone.err if gone else None
