"""Building and running a grpc.aio server the same way for every role.

Every server gets: the error interceptor (domain errors -> status codes, no stack traces to clients),
request ids from the ``x-request-id`` metadata, grpc.health.v1 and server reflection.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import logging
import signal
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc._cython import cygrpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry import context as otel_context
from opentelemetry import trace

from runtime import keepalive, tracing
from runtime.details import OWN_MARK, rich_status
from runtime.errors import ServiceError
from runtime.intake import (
    DEFAULT_BUDGET_BYTES,
    FLOW_CONTROL_OPTIONS,
    Intake,
    IntakePolicy,
    Malformed,
    trim_freed_memory,
)
from runtime.limits import Limits, max_request_bytes
from runtime.logs import REQUEST_ID_KEY, accepted_request_id, new_request_id, request_id_var
from runtime.paths import write_port_file
from runtime.tls import ServerTls, add_server_tls_args

log = logging.getLogger(__name__)
# What grpc.aio raises when a call is written to after it ended: an answer is no longer possible.
_CALL_ENDED = (cygrpc.ExecuteBatchError, cygrpc.UsageError)


def request_id_from(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The caller's first x-request-id if logs.accepted_request_id keeps it (the REST front's rule too), else None."""
    for key, value in metadata or ():
        if key == REQUEST_ID_KEY:
            return accepted_request_id(value)
    return None


# Long-lived infrastructure streams (health Watch) must neither count as work nor hold a drain open.
# The denoiser's occupancy stream is one too: a draining denoiser keeps publishing while its last job finishes.
_INFRA_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.", "/glmimage.v1.DenoiserService/WatchOccupancy")
# Housekeeping polls (the REST front follows the gateway's limits and adapters, the gateway its workers'): no span of
# their own unless the caller traces them.
_QUIET_SUFFIXES = ("/GetLimits", "/GetStatus", "/ListLoras")
_TRACER = tracing.tracer("glmimage.server")
# How long the infrastructure streams get to end before the server stops (they end at once unless hung).
STREAMS_CLOSE_SECONDS = 1.0


class InflightWork:
    """Counts application RPCs in progress, so a drain can wait for exactly those and then stop at once; and ends
    the infrastructure streams (health Watch, WatchOccupancy) before the stop, so none is cut by it (gRPC logs each
    cut stream as an unhandled CancelledError)."""

    def __init__(self) -> None:
        self.count = 0
        self.draining = False
        self._idle = asyncio.Event()
        self._idle.set()
        self.closing = asyncio.Event()  # set just before the stop: infrastructure streams end
        self.streams = 0  # infrastructure streams open
        self._no_streams = asyncio.Event()
        self._no_streams.set()

    def track(self, context: grpc.aio.ServicerContext) -> None:
        """Count this RPC until it has terminated, i.e. its response and status are handed to the transport:
        counting only until the handler returns let a drain stop the server with a reply still unsent."""
        self.count += 1
        self._idle.clear()
        context.add_done_callback(self._exit)

    def _exit(self, _context: object) -> None:
        self.count -= 1
        if self.count == 0:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        # asyncio.timeout, not wait_for: on 3.11 wait_for swallows a cancel that comes as the event is set.
        try:
            async with asyncio.timeout(timeout):
                await self._idle.wait()
            return True
        except TimeoutError:
            return False

    async def stream(self, stream: object) -> AsyncIterator[object]:
        """An infrastructure stream's messages (an async generator's, or none from a handler that writes them
        itself) until it ends or ``closing`` is set."""
        self.streams += 1
        self._no_streams.clear()
        stop = asyncio.ensure_future(self.closing.wait())
        step = stream.__anext__ if inspect.isasyncgen(stream) else None
        part: asyncio.Future | None = None
        try:
            while True:
                part = asyncio.ensure_future(step() if step else stream)  # type: ignore[arg-type]
                await asyncio.wait((part, stop), return_when=asyncio.FIRST_COMPLETED)
                if not part.done():
                    return  # closing: the finally ends it
                if step is None:
                    part.result()
                    return
                try:
                    item = part.result()
                except StopAsyncIteration:
                    return
                yield item
        finally:
            # Also when the call itself is cancelled (its client left): the part must not outlive it.
            stop.cancel()
            if part is not None:
                part.cancel()  # nothing if it is done already
                await asyncio.gather(part, return_exceptions=True)  # its end, whatever it was, is seen
            self.streams -= 1
            if self.streams == 0:
                self._no_streams.set()

    async def close_streams(self, timeout: float) -> None:
        self.closing.set()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._no_streams.wait()


def release_frames(exc: BaseException) -> None:
    """Drop the locals of the finished frames ``exc`` (and the exceptions it chains) passed through. A traceback
    keeps its frames and their locals alive, a request of 30 MB among them, and gRPC keeps a failed call's
    exception in reference cycles that only a full garbage collection frees: 24 refused 30 MB calls held 500 MB."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        traceback.clear_frames(current.__traceback__)
        current = current.__cause__ or current.__context__


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Sets the request id for the call, receives its message through the intake, turns exceptions into statuses,
    and tracks work for drains.

    Every handler is served as a client-streaming one on raw bytes, so the message is read only here, after the
    interceptors inside this one (the credential check) have seen the metadata, and within the intake's bounds.
    A ServiceError keeps its message; anything else is logged with its traceback and the client only sees INTERNAL
    with the request id, so nothing internal leaks. While draining, new application RPCs are refused with
    UNAVAILABLE so clients retry elsewhere.
    """

    def __init__(self, intake: Intake, work: InflightWork | None = None) -> None:
        self.intake = intake
        self.work = work or InflightWork()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        rid = request_id_from(handler_call_details.invocation_metadata) or new_request_id()
        method = handler_call_details.method
        work = None if method.startswith(_INFRA_PREFIXES) else self.work
        intake, decode = self.intake, handler.request_deserializer
        rpc = method.rsplit("/", 1)[-1]

        async def _fail(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
            if isinstance(exc, _CALL_ENDED):
                # gRPC itself ended the call first (e.g. metadata past its 16 KiB limit: RESOURCE_EXHAUSTED), so
                # whatever the handler or an interceptor then sends fails: nothing more to answer, and no error of
                # ours (a flood of such calls must not fill the log with tracebacks).
                log.info("%s: the call had already ended (%s)", method, type(exc).__name__)
                return
            if isinstance(exc, Malformed):
                log.info("%s refused: the request bytes are not a valid message", method)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"the request bytes are not a valid {rpc} request message",
                                    trailing_metadata=OWN_MARK)
            if isinstance(exc, NotImplementedError):  # the generated base servicer's answer for a missing method
                await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{method} is not implemented by this server")
            if isinstance(exc, ServiceError):
                log.info("%s failed: %s: %s", method, exc.kind.value, exc.message)
                await context.abort_with_status(rich_status(exc))
            log.exception("%s: unexpected error", method)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error (request id {rid})",
                                trailing_metadata=OWN_MARK)

        metadata = handler_call_details.invocation_metadata
        parent = tracing.context_from_metadata(metadata) if tracing.enabled() and work is not None else None
        if (parent is not None and method.endswith(_QUIET_SUFFIXES)
                and not trace.get_current_span(parent).get_span_context().is_valid):
            parent = None

        def _span() -> trace.Span | None:
            """The call's server span, current for the handler (its task's context: nothing to detach), child of
            the caller's traceparent; None with traces off."""
            if parent is None:
                return None
            span = _TRACER.start_span(method.lstrip("/"), context=parent, kind=trace.SpanKind.SERVER,
                                      attributes={"rpc.system": "grpc", "rpc.method": rpc, "glmimage.request_id": rid})
            otel_context.attach(trace.set_span_in_context(span, parent))
            return span

        def _ended(span: trace.Span | None, exc: BaseException | None = None) -> None:
            if span is None:
                return
            if exc is not None:
                what = exc.kind.value if isinstance(exc, ServiceError) else type(exc).__name__
                span.set_status(trace.StatusCode.ERROR, what)
            span.end()

        async def _admit(context: grpc.aio.ServicerContext) -> None:
            """Before the message is read: the request id, no new call while draining."""
            request_id_var.set(rid)
            if work is not None and work.draining:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "server is draining; retry on another replica",
                                    trailing_metadata=OWN_MARK)
            if work is not None:
                work.track(context)

        async def _request(requests: object, context: grpc.aio.ServicerContext) -> object:
            # The handler's own first argument: one message, or the client's stream of them.
            if handler.unary_unary or handler.unary_stream:
                return await intake.one(context, decode)
            return intake.each(context, decode)

        inner = handler.unary_unary or handler.stream_unary
        if inner is not None:
            async def unary_response(requests, context):
                span = _span()
                error: BaseException | None = None
                try:
                    await _admit(context)
                    return await inner(await _request(requests, context), context)
                except (asyncio.CancelledError, grpc.aio.AbortError) as exc:
                    error = exc
                    release_frames(exc)
                    raise
                except Exception as exc:  # noqa: BLE001 - the edge is where everything is mapped
                    error = exc
                    release_frames(exc)
                    await _fail(context, exc)
                finally:
                    _ended(span, error)

            return grpc.stream_unary_rpc_method_handler(unary_response, None, handler.response_serializer)
        inner_stream = handler.unary_stream or handler.stream_stream

        async def stream_response(requests, context):
            span = _span()
            error: BaseException | None = None
            try:
                await _admit(context)
                stream = inner_stream(await _request(requests, context), context)
                if work is None:  # an infrastructure stream: it ends when the server is about to stop
                    async for item in self.work.stream(stream):
                        yield item
                elif inspect.isasyncgen(stream):
                    async for item in stream:
                        yield item
                else:  # a handler that writes with context.write()
                    await stream
            except (asyncio.CancelledError, grpc.aio.AbortError) as exc:
                error = exc
                release_frames(exc)
                raise
            except Exception as exc:  # noqa: BLE001
                error = exc
                release_frames(exc)
                await _fail(context, exc)
            finally:
                _ended(span, error)

        return grpc.stream_stream_rpc_method_handler(stream_response, None, handler.response_serializer)


@dataclass
class GrpcServer:
    """A started server plus its health servicer; ``port`` is the bound port (useful with port 0)."""

    server: grpc.aio.Server
    health: health.aio.HealthServicer
    port: int
    service_names: tuple[str, ...]
    work: InflightWork = field(default_factory=InflightWork)
    _serving: bool = field(default=False, init=False)

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        self._serving = serving
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    async def stop(self, grace: float | None) -> None:
        await self.set_serving(False)
        await self.server.stop(grace)


def server_options(receive_bytes: int, send_bytes: int) -> list[tuple[str, int]]:
    """The channel arguments of every server: message limits, the flow control that keeps unread messages out of
    memory (runtime.intake), and the pings it accepts from the clients of every hop
    (runtime.keepalive, where the numbers are reasoned)."""
    return [
        *keepalive.message_size_options(receive_bytes, send_bytes),
        *FLOW_CONTROL_OPTIONS,
        ("grpc.so_reuseport", 0),  # two servers on one port must fail loudly, not share traffic
        *keepalive.SERVER_OPTIONS,
    ]


async def start_server(
    add_servicers: Callable[[grpc.aio.Server], None],
    service_names: Iterable[str],
    address: str,
    *,
    intake: IntakePolicy | None = None,
    max_send_mb: int = 64,
    interceptors: Iterable[grpc.aio.ServerInterceptor] = (),
    tls: ServerTls | None = None,
) -> GrpcServer:
    """Start a server with health (NOT_SERVING until the caller says otherwise) and reflection.

    ``intake`` bounds what the server receives: its largest request and the memory of those being read (default:
    the largest request any role takes under the default limits).
    ``interceptors`` run after the error interceptor, on the call's metadata (the message is read only once they
    let it through), and what they raise or abort with is mapped the same way. With ``tls`` the port serves TLS
    only (mutual TLS when it names a client CA)."""
    work = InflightWork()
    if intake is None:
        intake = IntakePolicy(max_request_bytes(Limits(), prompts=Limits().max_batch_outputs, tokens=True))
    trim_freed_memory()
    server = grpc.aio.server(interceptors=[ErrorInterceptor(Intake(intake), work), *interceptors],
                             options=server_options(intake.max_message_bytes, max_send_mb << 20))
    add_servicers(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = tuple(service_names)
    reflection.enable_server_reflection((*names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    port = server.add_secure_port(address, tls.credentials()) if tls else server.add_insecure_port(address)
    if port == 0:
        raise RuntimeError(f"could not bind {address}")
    await server.start()
    grpc_server = GrpcServer(server=server, health=health_servicer, port=port, service_names=names,
                             work=work)
    await grpc_server.set_serving(False)
    return grpc_server


def install_shutdown_signals() -> asyncio.Event:
    """An event set on SIGTERM or SIGINT, so servers drain instead of dying mid-request."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def run_until_signalled(
    server: GrpcServer, *, grace: float, on_drain: Callable[[], Awaitable[None]] | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Serve until SIGTERM/SIGINT, then go NOT_SERVING, let in-flight RPCs finish (up to grace) and stop.

    ``stop``: the event from an earlier install_shutdown_signals() (a server that wants the signals handled during
    its start-up already); installed here otherwise."""
    if stop is None:
        stop = install_shutdown_signals()
    await stop.wait()
    log.info("shutdown requested: draining for up to %.0fs", grace)
    await server.set_serving(False)
    server.work.draining = True
    if on_drain is not None:
        await on_drain()
    # Wait for application RPCs only: health Watch streams stay open forever and must not hold the exit.
    if not await server.work.wait_idle(grace):
        log.warning("%d RPC(s) still running after %.0fs; stopping anyway", server.work.count, grace)
    await server.work.close_streams(STREAMS_CLOSE_SECONDS)
    await server.server.stop(0)
    log.info("stopped")


def common_server_args(default_port: int) -> argparse.ArgumentParser:
    """Flags every gRPC server shares; use as an argparse parent."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=default_port, help="0 picks a free port")
    p.add_argument("--port-file", type=Path, default=None,
                   help="write the bound port here once listening (for supervisors and tests using --port 0)")
    p.add_argument("--drain-seconds", type=float, default=60.0, help="grace period for in-flight work on SIGTERM")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics on this port (0 picks a free one); off when unset")
    p.add_argument("--metrics-port-file", type=Path, default=None,
                   help="write the bound /metrics port here, before --port-file appears (for --metrics-port 0)")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--receive-budget-mb", type=int, default=DEFAULT_BUDGET_BYTES >> 20,
                   help="memory for request messages being received at once: messages are read a few at a time "
                        f"within it, and a call that waits {IntakePolicy.wait_seconds:g}s for its turn gets "
                        "RESOURCE_EXHAUSTED (default %(default)s)")
    p.add_argument("--receive-timeout", type=float, default=IntakePolicy.read_seconds,
                   help="seconds a request message may take to arrive once its read began (default %(default)s)")
    add_server_tls_args(p)
    tracing.add_tracing_args(p)
    return p


def intake_from_args(args: argparse.Namespace, max_message_bytes: int) -> IntakePolicy:
    """The intake of a server whose largest legitimate request is ``max_message_bytes`` (the limits model's
    max_request_bytes for its role)."""
    try:
        return IntakePolicy(max_message_bytes, budget_bytes=args.receive_budget_mb << 20,
                            read_seconds=args.receive_timeout)
    except ValueError as exc:
        raise SystemExit(f"--receive-budget-mb and --receive-timeout must be positive: {exc}") from None


def announce(server: GrpcServer, args: argparse.Namespace, what: str) -> None:
    log.info("%s listening on %s:%d", what, args.host, server.port)
    if args.port_file is not None:
        write_port_file(args.port_file, server.port)
