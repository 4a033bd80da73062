"""OpenAI-compatible REST front for GLM-Image.

A thin translator: it validates OpenAI Images API requests, calls
`glmimage.v1.GatewayService` over one gRPC channel (plaintext or TLS) and maps the
answer (or the gRPC status) back to OpenAI-shaped JSON, or to server-sent events
when the client asks for `stream: true`. It holds no model and no torch.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from glmimage.v1 import common_pb2, gateway_service_pb2, gateway_service_pb2_grpc
from services.runtime import keepalive

from . import sse
from .errors import APIError, error_response, from_rpc_error, from_validation_errors
from .schemas import (
    ErrorResponse,
    ImageGenCompletedEvent,
    ImageGenerationRequest,
    ImageGenPartialImageEvent,
    ImagesResponse,
    ModelCard,
    ModelList,
)

log = logging.getLogger("glmimage.rest")

REQUEST_ID_HEADER = "x-request-id"
# scope["state"] key: the status to count in the metrics instead of the one the response started with (a stream
# has sent its 200 long before it learns that the client went away).
OUTCOME_STATUS_KEY = "outcome_status"
PARTIAL_EVENT = "image_generation.partial_image"
COMPLETED_EVENT = "image_generation.completed"
ERROR_EVENT = "error"
# Ten 2048x2048 PNGs can exceed gRPC's 4 MiB default by far. Keepalive and the short capped reconnect backoff (a
# restarted gateway is reached within about a second): services.runtime.keepalive, shared by every hop.
_CHANNEL_OPTIONS = [
    *keepalive.message_size_options(256 * 1024 * 1024, 64 * 1024 * 1024),
    *keepalive.GATEWAY_CHANNEL_OPTIONS,
]
# Client-supplied ids end up in gRPC metadata and logs: printable ASCII only.
_REQUEST_ID_RE = re.compile(r"[\x21-\x7e]{1,128}")
_HEADER_VALUE_RE = re.compile(r"[\x20-\x7e]{1,8192}")
_SIZE_RE = re.compile(r"([0-9]{1,7})x([0-9]{1,7})")
# Routes whose body is JSON: anything else there is answered 415 before the body is read.
_JSON_BODY_ROUTES = frozenset({("POST", "/v1/images/generations")})

_FORMATS: dict[str, common_pb2.ImageFormat.ValueType] = {
    "png": common_pb2.IMAGE_FORMAT_PNG,
    "jpeg": common_pb2.IMAGE_FORMAT_JPEG,
    "webp": common_pb2.IMAGE_FORMAT_WEBP,
}
_FORMAT_NAMES = {v: k for k, v in _FORMATS.items()}
# DALL-E 3 quality names, for clients that still send them to the dall-e-3 alias.
_QUALITY_ALIASES = {"standard": "medium", "hd": "high"}
_READY_STATES = (gateway_service_pb2.WORKER_STATE_AVAILABLE, gateway_service_pb2.WORKER_STATE_BUSY)
_STAGES = {"ar": gateway_service_pb2.WORKER_ROLE_AR, "denoiser": gateway_service_pb2.WORKER_ROLE_DENOISER}


@dataclass(frozen=True)
class _StageHealth:
    ready: int
    stuck: int  # connected but not answering, or a call to it timed out: there, yet making no progress
    total: int
    why: tuple[str, ...]  # the distinct health texts of the members that are not ready

    def problem(self, name: str) -> str:
        """Why the stage cannot take work, in the operator's terms (never an address)."""
        label = "AR" if name == "ar" else name
        if self.total == 0:
            return f"no {label} server is configured or discovered"
        if self.stuck:
            return (f"the {label} stage is stuck: {self.stuck} of {self.total} server(s) connected but not "
                    f"making progress ({', '.join(self.why)})")
        return f"no {label} server is ready ({', '.join(self.why) or 'not yet checked'})"


def _stage_health(status: gateway_service_pb2.GetStatusResponse, role: int) -> _StageHealth:
    members = [w for w in status.workers if w.role == role]
    idle = [w for w in members if w.state not in _READY_STATES]
    return _StageHealth(ready=len(members) - len(idle), stuck=sum(1 for w in members if w.stuck),
                        total=len(members), why=tuple(sorted({w.health or "unknown" for w in idle})))


def _default_quality_steps() -> dict[str, int]:
    # 0 means "let the denoiser pick its default".
    return {"low": 10, "medium": 30, "high": 50, "auto": 0}


# How generation calls authenticate to the gateway. forward: with the client's own Authorization header (the
# gateway checks every caller; both sides share the keys). own: with this front's --gateway-api-key, after the
# front has checked the client against its own --api-key list (separate key sets per hop).
GATEWAY_AUTH_MODES = ("forward", "own")


@dataclass(frozen=True)
class RestSettings:
    gateway_address: str = "127.0.0.1:50050"
    served_model: str = "glm-image"
    model_aliases: tuple[str, ...] = ("gpt-image-1", "dall-e-3")
    default_size: tuple[int, int] = (256, 256)  # (width, height)
    max_pixels: int = 2048 * 2048
    quality_steps: Mapping[str, int] = field(default_factory=_default_quality_steps)
    api_keys: tuple[str, ...] = ()  # empty: auth off
    request_timeout: float = 300.0
    enable_cache_report: bool = False
    health_timeout: float = 5.0
    # Bearer key for REST's own gateway calls (GetStatus behind /health) when the gateway checks keys.
    # With gateway_auth "forward", generation calls carry the client's own Authorization header instead, so the
    # gateway checks the caller; with "own", they carry this key and the client's header stays here.
    gateway_api_key: str | None = None
    gateway_auth: str = "forward"  # "forward" or "own", see GATEWAY_AUTH_MODES
    # TLS to the gateway: on when any is set. CA: PEM roots to verify the gateway (None: system roots);
    # client cert and key (PEM, both or neither): mutual TLS.
    gateway_tls_ca: Path | None = None
    gateway_tls_client_cert: Path | None = None
    gateway_tls_client_key: Path | None = None
    # Name to check the gateway's certificate against, when it differs from the dialled host.
    gateway_tls_server_name: str | None = None
    # Largest request body accepted (413 above it): a generation body is a few KiB (prompts are at most 32000
    # characters), so 1 MiB leaves room without letting a client make the front hold megabytes.
    max_body_bytes: int = 1024 * 1024
    # Browser origins allowed to call the API (CORS); empty: CORS off, browsers block cross-origin calls.
    cors_origins: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.max_body_bytes <= 0:
            raise ValueError(f"the body limit must be positive, not {self.max_body_bytes}")
        if (self.gateway_tls_client_cert is None) != (self.gateway_tls_client_key is None):
            raise ValueError("gateway TLS: give the client certificate and its key together, or neither")
        if self.gateway_auth not in GATEWAY_AUTH_MODES:
            raise ValueError(f"gateway auth must be one of {', '.join(GATEWAY_AUTH_MODES)}, not {self.gateway_auth!r}")
        if self.gateway_auth == "own" and not self.gateway_api_key:
            raise ValueError("--gateway-auth own needs --gateway-api-key (or GLMIMAGE_GATEWAY_API_KEY): the key this "
                             "front presents to the gateway on every call")
        if self.gateway_auth == "own" and not self.api_keys:
            raise ValueError("--gateway-auth own needs --api-key (or GLMIMAGE_API_KEYS) too: a front with no keys "
                             "of its own would let anyone generate with its gateway key")

    @property
    def model_names(self) -> tuple[str, ...]:
        return (self.served_model, *self.model_aliases)

    @property
    def gateway_tls(self) -> bool:
        return any(p is not None for p in (self.gateway_tls_ca, self.gateway_tls_client_cert,
                                           self.gateway_tls_client_key, self.gateway_tls_server_name))


def channel_credentials(settings: RestSettings) -> grpc.ChannelCredentials | None:
    """TLS credentials for the gateway channel, or None for plaintext. Reads the PEM files now, so a bad path
    fails at start-up rather than on the first request."""
    if not settings.gateway_tls:
        return None

    def read(path: Path | None) -> bytes | None:
        return path.read_bytes() if path is not None else None

    return grpc.ssl_channel_credentials(
        root_certificates=read(settings.gateway_tls_ca),
        private_key=read(settings.gateway_tls_client_key),
        certificate_chain=read(settings.gateway_tls_client_cert),
    )


class RestMetrics:
    """REST-side Prometheus metrics, in a registry of their own so apps do not collide."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "glmimage_rest_requests",
            "HTTP requests answered, by route and status code.",
            ["route", "status"],
            registry=self.registry,
        )
        self.duration = Histogram(
            "glmimage_rest_request_duration_seconds",
            "HTTP request duration, by route.",
            ["route"],
            buckets=(0.005, 0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
            registry=self.registry,
        )
        self.images = Counter(
            "glmimage_rest_images", "Images returned to HTTP clients.", registry=self.registry
        )


@dataclass
class _Gateway:
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


class _BodyTooLarge(StarletteHTTPException):
    """Raised by the bounded `receive` once a body passes the limit. An HTTPException, so that FastAPI's body
    parsing lets it through (it turns other errors into 400) and the app's handler answers it, OpenAI-shaped."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than the limit of {limit} bytes")

    def response(self) -> Response:
        return error_response(413, str(self.detail), code="request_too_large")


def _bounded(receive: Receive, limit: int) -> Receive:
    """`receive`, counting body bytes as they stream in: past `limit` it raises instead of handing the chunk
    over, so the app never holds more than `limit` bytes of a body (chunked bodies have no Content-Length)."""
    seen = 0

    async def bounded_receive() -> Message:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise _BodyTooLarge(limit)
        return message

    return bounded_receive


class _FrontMiddleware:
    """Request id, API-key auth, the body checks, metrics and the last-resort 500, as one pure ASGI layer.

    Pure ASGI (not BaseHTTPMiddleware) so that `receive` reaches the route untouched and
    disconnect detection keeps working. Auth runs here, before FastAPI parses the body.
    """

    def __init__(self, app: ASGIApp, settings: RestSettings, metrics: RestMetrics, router: APIRouter) -> None:
        self.app = app
        self.metrics = metrics
        self.router = router
        self.api_keys = tuple(k.encode() for k in settings.api_keys)
        self.max_body_bytes = settings.max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        rid = headers.get(REQUEST_ID_HEADER, "")
        if not _REQUEST_ID_RE.fullmatch(rid):
            rid = f"req-{uuid.uuid4().hex}"
        scope.setdefault("state", {})["request_id"] = rid
        status = 500
        started = False

        async def send_wrapper(message: Message) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                started = True
                status = message["status"]
                message["headers"] = [*message.get("headers", ()), (b"x-request-id", rid.encode())]
            await send(message)

        t0 = time.perf_counter()
        try:
            path: str = scope["path"]
            if self.api_keys and path.startswith("/v1/") and not self._authorized(headers):
                log.info("%s rejected: missing or invalid API key", rid)
                resp = error_response(
                    401, "invalid or missing API key", type="authentication_error", code="invalid_api_key"
                )
                await resp(scope, receive, send_wrapper)
            elif _declared_length(headers) > self.max_body_bytes:
                log.info("%s rejected: Content-Length %s over the limit", rid, headers["content-length"])
                await _BodyTooLarge(self.max_body_bytes).response()(scope, receive, send_wrapper)
            elif (scope.get("method"), path) in _JSON_BODY_ROUTES and not _json_or_no_body(headers):
                given = headers.get("content-type", "")[:100]
                log.info("%s rejected: body content type %r", rid, given)
                why = f"Content-Type is {given!a}" if given else "the request has no Content-Type header"
                resp = error_response(415, f"the request body must be application/json; {why}",
                                      code="unsupported_media_type")
                await resp(scope, receive, send_wrapper)
            else:
                await self.app(scope, _bounded(receive, self.max_body_bytes), send_wrapper)
        except Exception:
            log.exception("%s unhandled error on %s %s", rid, scope.get("method"), scope.get("path"))
            if not started:
                resp = error_response(
                    500, "internal server error", type="server_error", code="internal_error"
                )
                await resp(scope, receive, send_wrapper)
        finally:
            label = self._route_label(scope)
            status = scope["state"].get(OUTCOME_STATUS_KEY, status)
            self.metrics.requests.labels(route=label, status=str(status)).inc()
            self.metrics.duration.labels(route=label).observe(time.perf_counter() - t0)

    def _route_label(self, scope: Scope) -> str:
        # The matched route template keeps label cardinality bounded; requests rejected
        # before routing (auth) still get their route if the path is a known one.
        route = scope.get("route")
        if route is not None:
            return str(getattr(route, "path", "unmatched"))
        known = {getattr(r, "path", None) for r in self.router.routes}
        return scope["path"] if scope["path"] in known else "unmatched"

    def _authorized(self, headers: Mapping[str, str]) -> bool:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            return False
        presented = token.strip().encode("latin-1", "replace")
        # Compare against every key so timing does not reveal which prefix matched.
        return any([hmac.compare_digest(presented, key) for key in self.api_keys])


def _is_json(content_type: str) -> bool:
    """application/json, with or without parameters (charset), or an application/*+json type."""
    media = content_type.partition(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def _declared_length(headers: Mapping[str, str]) -> int:
    """The Content-Length header's value; 0 when absent (the server refuses malformed ones before we see them)."""
    value = headers.get("content-length", "").strip()
    return int(value) if value.isdigit() else 0


def _json_or_no_body(headers: Mapping[str, str]) -> bool:
    """A JSON body, or none at all (left to the route, which answers "request body is required")."""
    if "content-type" in headers:
        return _is_json(headers["content-type"])
    return headers.get("content-length", "0") == "0" and "transfer-encoding" not in headers


def _headers(scope: Scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}


def _request_id(request: Request) -> str:
    return str(request.scope.get("state", {}).get("request_id") or f"req-{uuid.uuid4().hex}")


def _parse_size(size: str | None, settings: RestSettings) -> tuple[int, int]:
    """Return (width, height); rounding to a multiple of 32 is the services' job."""
    if size is None or size == "auto":
        return settings.default_size
    m = _SIZE_RE.fullmatch(size.strip().lower())
    if m is None:
        raise APIError(400, "size must be 'WIDTHxHEIGHT' (e.g. '1024x1024') or 'auto'", param="size",
                       code="invalid_value")
    width, height = int(m[1]), int(m[2])
    if width <= 0 or height <= 0:
        raise APIError(400, "size: width and height must be positive", param="size", code="invalid_value")
    if width * height > settings.max_pixels:
        raise APIError(
            400,
            f"size {width}x{height} has {width * height} pixels; the limit is {settings.max_pixels}",
            param="size",
            code="invalid_value",
        )
    return width, height


def _to_grpc(
    body: ImageGenerationRequest, settings: RestSettings, rid: str
) -> tuple[gateway_service_pb2.GenerateImagesRequest, str]:
    """Checks that need the settings, then the gRPC request and the effective quality name."""
    if body.model is not None and body.model not in settings.model_names:
        available = ", ".join(settings.model_names)
        raise APIError(404, f"model {body.model!a} does not exist; available: {available}",
                       param="model", code="model_not_found")
    if not body.prompt.strip():
        raise APIError(400, "prompt must not be empty", param="prompt", code="invalid_value")
    try:
        body.prompt.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates from JSON \ud800 escapes; protobuf would reject them
        raise APIError(400, "prompt is not valid Unicode", param="prompt", code="invalid_value") from None
    if body.response_format == "url":
        raise APIError(400, "response_format 'url' is not supported: no image store is configured; "
                       "use 'b64_json'", param="response_format", code="unsupported_value")
    if body.background == "transparent":
        raise APIError(400, "transparent backgrounds are not supported", param="background",
                       code="unsupported_value")
    width, height = _parse_size(body.size, settings)
    quality = _QUALITY_ALIASES.get(body.quality or "auto", body.quality or "auto")
    steps = body.num_inference_steps
    if steps is None:
        steps = settings.quality_steps.get(quality, 0)
    req = gateway_service_pb2.GenerateImagesRequest(
        prompt=body.prompt,
        n=body.n or 1,
        width=width,
        height=height,
        output_format=_FORMATS[body.output_format or "png"],
        num_inference_steps=steps,
        request_id=rid,
    )
    if body.output_compression is not None:
        req.output_compression = body.output_compression
    if body.guidance_scale is not None:
        req.guidance_scale = body.guidance_scale
    if body.seed is not None:
        req.seed = body.seed
    return req, quality


def _usage(u: common_pb2.Usage, image_count: int, settings: RestSettings) -> dict[str, Any]:
    usage: dict[str, Any] = {
        "input_tokens": u.prompt_tokens,
        "output_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens or u.prompt_tokens + u.completion_tokens,
        "input_tokens_details": {"text_tokens": u.prompt_tokens, "image_tokens": 0},
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "reasoning_tokens": u.reasoning_tokens,
        "image_count": image_count,
    }
    # Cache hits reveal what other users prompted, so reporting them is opt-in.
    if settings.enable_cache_report and u.cached_tokens > 0:
        usage["prompt_tokens_details"] = {"cached_tokens": u.cached_tokens}
    return usage


class _CallGuard:
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


@dataclass
class _Generation:
    """What one /v1/images/generations call needs to answer: the gRPC request and the echoed settings."""

    request: gateway_service_pb2.GenerateImagesRequest
    quality: str
    metadata: tuple[tuple[str, str], ...]
    rid: str

    @property
    def output_format(self) -> str:
        return _FORMAT_NAMES.get(self.request.output_format, "png")

    def echo(self, size: str, output_format: str) -> dict[str, Any]:
        return {"size": size, "quality": self.quality, "background": "opaque", "output_format": output_format}


async def _generate(
    gateway: _Gateway, gen: _Generation, timeout: float, receive: Receive
) -> gateway_service_pb2.GenerateImagesResponse | None:
    """Run GenerateImages; None if the HTTP client went away (the RPC is then cancelled)."""
    await gateway.connected()
    guard = _CallGuard(gateway.stub.GenerateImages(gen.request, metadata=gen.metadata, timeout=timeout), receive,
                       gen.rid)
    try:
        return await guard.wait(guard.call)
    finally:
        guard.close()


def _completed_events(
    resp: gateway_service_pb2.GenerateImagesResponse, gen: _Generation, settings: RestSettings
) -> list[bytes]:
    """One completed event per image, each with that image's usage, so the events add up to the request's."""
    size = f"{resp.width or gen.request.width}x{resp.height or gen.request.height}"
    echo = gen.echo(size, _FORMAT_NAMES.get(resp.output_format, gen.output_format))
    per_image = all(img.HasField("usage") for img in resp.images)
    events = []
    for i, img in enumerate(resp.images):
        if per_image:
            usage = _usage(img.usage, 1, settings)
        else:  # a gateway without per-image usage: the whole bill on the last event keeps the sum right
            last = i == len(resp.images) - 1
            usage = _usage(resp.usage if last else common_pb2.Usage(), len(resp.images) if last else 0, settings)
        events.append(sse.event(COMPLETED_EVENT, {
            "type": COMPLETED_EVENT,
            "b64_json": base64.b64encode(img.image).decode("ascii"),
            "created_at": int(time.time()),
            **echo,
            "usage": usage,
            "image_index": img.index,  # extension: which of the n images this is
        }))
    return events


def _error_event(err: APIError) -> bytes:
    # The openai SDK raises APIError for any event whose data has an "error" object.
    body = {"message": err.message, "type": err.type, "param": err.param, "code": err.code}
    return sse.event(ERROR_EVENT, {"type": ERROR_EVENT, "error": body})


async def _stream_events(
    guard: _CallGuard,
    first: gateway_service_pb2.GenerateImagesStreamResponse,
    gen: _Generation,
    settings: RestSettings,
    metrics: RestMetrics,
    state: dict[str, Any],
) -> AsyncIterator[bytes]:
    """GenerateImagesStream messages -> OpenAI image-generation events. Progress becomes SSE comments
    (OpenAI has no progress event; comments are ignored by clients and keep proxies from timing out)."""
    call: grpc.aio.UnaryStreamCall = guard.call  # type: ignore[assignment]
    partial_echo = gen.echo(f"{gen.request.width}x{gen.request.height}", gen.output_format)
    msg: Any = first
    try:
        while msg is not None and msg is not grpc.aio.EOF:
            kind = msg.WhichOneof("event")
            if kind == "progress":
                p = msg.progress
                yield sse.comment(f"progress image={p.image_index} step={p.step}/{p.total_steps}")
            elif kind == "partial_image":
                part = msg.partial_image
                yield sse.event(PARTIAL_EVENT, {
                    "type": PARTIAL_EVENT,
                    "b64_json": base64.b64encode(part.image).decode("ascii"),
                    "created_at": int(time.time()),
                    **partial_echo,
                    "partial_image_index": part.partial_image_index,
                    "image_index": part.image_index,  # extension, as on the completed event
                })
            elif kind == "completed":
                metrics.images.inc(len(msg.completed.images))
                for chunk in _completed_events(msg.completed, gen, settings):
                    yield chunk
                log.info("%s stream done: %d image(s), %d+%d tokens", gen.rid, len(msg.completed.images),
                         msg.completed.usage.prompt_tokens, msg.completed.usage.completion_tokens)
                return
            msg = await guard.wait(call.read())
        if msg is None:
            log.info("%s client disconnected mid-stream; gateway call cancelled", gen.rid)
            state[OUTCOME_STATUS_KEY] = 499
            return
        log.warning("%s gateway stream ended without a result", gen.rid)
        yield _error_event(APIError(502, "the gateway stream ended without a result", type="server_error",
                                    code="incomplete_stream"))
    except APIError as err:
        log.info("%s stream failed: %d %s", gen.rid, err.status, err.message)
        yield _error_event(err)
    finally:
        guard.close()


async def _stream(
    gateway: _Gateway, gen: _Generation, partial_images: int, settings: RestSettings, metrics: RestMetrics,
    receive: Receive, state: dict[str, Any],
) -> Response:
    req = gateway_service_pb2.GenerateImagesStreamRequest(request=gen.request, partial_images=partial_images)
    await gateway.connected()
    call = gateway.stub.GenerateImagesStream(req, metadata=gen.metadata, timeout=settings.request_timeout)
    guard = _CallGuard(call, receive, gen.rid)
    try:
        # Wait for the first message before committing to a 200, so that errors the gateway reports at once
        # (bad input, queue full, bad key, no streaming support) keep their HTTP status.
        first = await guard.wait(call.read())
    except BaseException:
        guard.close()
        raise
    if first is None:
        guard.close()
        log.info("%s client disconnected; gateway call cancelled", gen.rid)
        return Response(status_code=499)
    if first is grpc.aio.EOF:
        guard.close()
        raise APIError(502, "the gateway stream ended without a result", type="server_error",
                       code="incomplete_stream")
    return sse.EventStreamResponse(_stream_events(guard, first, gen, settings, metrics, state))


def create_app(settings: RestSettings) -> FastAPI:
    metrics = RestMetrics()
    created = int(time.time())
    credentials = channel_credentials(settings)
    own_metadata = (("authorization", f"Bearer {settings.gateway_api_key}"),) if settings.gateway_api_key else ()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # grpc.aio channels bind to the running loop, so create it here, not in create_app.
        if credentials is None:
            channel = grpc.aio.insecure_channel(settings.gateway_address, options=_CHANNEL_OPTIONS)
        else:
            options = list(_CHANNEL_OPTIONS)
            if settings.gateway_tls_server_name:
                options.append(("grpc.ssl_target_name_override", settings.gateway_tls_server_name))
            channel = grpc.aio.secure_channel(settings.gateway_address, credentials, options=options)
        app.state.gateway = _Gateway(
            channel, gateway_service_pb2_grpc.GatewayServiceStub(channel), health_pb2_grpc.HealthStub(channel)
        )
        log.info("REST front using gateway at %s (%s)", settings.gateway_address,
                 "TLS" if credentials is not None else "plaintext")
        try:
            yield
        finally:
            await channel.close()

    app = FastAPI(
        title="GLM-Image OpenAI-compatible API",
        version="1.0",
        description="OpenAI Images API served by the GLM-Image gateway.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.metrics = metrics
    app.add_middleware(_FrontMiddleware, settings=settings, metrics=metrics, router=app.router)
    if settings.cors_origins:
        # Outside the front's layer: preflights carry no API key, and its own answers (401, 413...) get the headers.
        # Any request header (the SDK adds its x-stainless-* ones); no cookies, the API key is a header.
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["*"], expose_headers=[REQUEST_ID_HEADER, "retry-after"], max_age=600)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        if exc.status >= 500:
            log.warning("%s answered %d: %s", _request_id(request), exc.status, exc.message)
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        return from_validation_errors(exc.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        err_type = "server_error" if exc.status_code >= 500 else "invalid_request_error"
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status_code)
        return error_response(exc.status_code, str(exc.detail), type=err_type, code=code, headers=exc.headers)

    error_responses: dict[int | str, dict[str, Any]] = {
        status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 415, 429, 499, 500, 503, 504)
    }

    @app.post(
        "/v1/images/generations",
        response_class=JSONResponse,
        responses={
            200: {
                "model": ImagesResponse,
                "description": "JSON, or with `stream: true` server-sent events (`event: <type>`, `data: <json>`): "
                "ImageGenPartialImageEvent, then one ImageGenCompletedEvent per image; a failure after the first "
                "event is sent as an `error` event holding an ErrorResponse.",
                "content": {sse.MEDIA_TYPE: {"schema": {"oneOf": [
                    {"$ref": "#/components/schemas/ImageGenPartialImageEvent"},
                    {"$ref": "#/components/schemas/ImageGenCompletedEvent"},
                ]}}},
            },
            **error_responses,
        },
        summary="Create images from a prompt",
    )
    async def generate_images(body: ImageGenerationRequest, request: Request) -> Response:
        rid = _request_id(request)
        req, quality = _to_grpc(body, settings, rid)
        metadata: tuple[tuple[str, str], ...] = ((REQUEST_ID_HEADER, rid),)
        if settings.gateway_auth == "own":  # the gateway sees this front's key; the client's stays here
            metadata += own_metadata
        else:  # forwarded whether or not REST checks keys itself: the gateway may enforce its own
            authorization = request.headers.get("authorization")
            if authorization and _HEADER_VALUE_RE.fullmatch(authorization):
                metadata += (("authorization", authorization),)
        gen = _Generation(request=req, quality=quality, metadata=metadata, rid=rid)
        log.info(
            "%s generate n=%d size=%dx%d steps=%d format=%s stream=%s user=%r",
            rid, req.n, req.width, req.height, req.num_inference_steps, gen.output_format, bool(body.stream),
            body.user,
        )
        gateway: _Gateway = request.app.state.gateway
        if body.stream:
            return await _stream(gateway, gen, body.partial_images or 0, settings, metrics, request.receive,
                                 request.scope["state"])
        resp = await _generate(gateway, gen, settings.request_timeout, request.receive)
        if resp is None:
            log.info("%s client disconnected; gateway call cancelled", rid)
            return Response(status_code=499)
        metrics.images.inc(len(resp.images))
        result = {
            "created": int(time.time()),
            "data": [{"b64_json": base64.b64encode(img.image).decode("ascii")} for img in resp.images],
            **gen.echo(f"{resp.width or req.width}x{resp.height or req.height}",
                       _FORMAT_NAMES.get(resp.output_format, gen.output_format)),
            "usage": _usage(resp.usage, len(resp.images), settings),
        }
        log.info("%s done: %d image(s), %d+%d tokens", rid, len(resp.images),
                 resp.usage.prompt_tokens, resp.usage.completion_tokens)
        return JSONResponse(result)

    def card(name: str) -> ModelCard:
        return ModelCard(id=name, created=created, owned_by="glmimage")

    @app.get("/v1/models", response_model=ModelList, summary="List the served model and its aliases")
    async def list_models() -> ModelList:
        return ModelList(data=[card(name) for name in settings.model_names])

    # :path, so that a served model named like "zai-org/GLM-Image" can be retrieved too.
    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses={404: {"model": ErrorResponse}},
             summary="The served model or one of its aliases")
    async def retrieve_model(model_id: str) -> ModelCard:
        if model_id not in settings.model_names:
            raise APIError(404, f"model {model_id!a} does not exist; available: {', '.join(settings.model_names)}",
                           param="model", code="model_not_found")
        return card(model_id)

    @app.get("/health", summary="Ready when the gateway serves and has AR and denoiser workers")
    async def health(request: Request) -> Response:
        gateway: _Gateway = request.app.state.gateway
        timeout = settings.health_timeout

        def unavailable(reason: str, **extra: Any) -> Response:
            log.info("health: unavailable: %s", reason)
            return JSONResponse({"status": "unavailable", "reason": reason, **extra}, status_code=503)

        try:
            check = await gateway.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
            if check.status != health_pb2.HealthCheckResponse.SERVING:
                name = health_pb2.HealthCheckResponse.ServingStatus.Name(check.status)
                return unavailable(f"gateway health is {name}")
            status = await gateway.stub.GetStatus(gateway_service_pb2.GetStatusRequest(), timeout=timeout,
                                                  metadata=own_metadata)
        except grpc.aio.AioRpcError as err:
            log.info("health: gateway call failed: %s: %s", err.code().name, err.details())
            if err.code() == grpc.StatusCode.UNAUTHENTICATED:
                return unavailable("the gateway refused the status call (UNAUTHENTICATED); "
                                   "give the REST front a key with --gateway-api-key")
            return unavailable(f"the gateway is unreachable ({err.code().name})")
        stages = {name: _stage_health(status, role) for name, role in _STAGES.items()}
        reasons = [h.problem(name) for name, h in stages.items() if h.ready == 0]
        body = {name: {"ready": h.ready, "stuck": h.stuck, "total": h.total} for name, h in stages.items()}
        if reasons:
            return unavailable("; ".join(reasons), stages=body)
        return JSONResponse({
            "status": "ok",
            "gateway": "SERVING",
            "ar_workers": stages["ar"].ready,
            "denoiser_workers": stages["denoiser"].ready,
            "active_requests": status.active_requests,
            "stages": body,
        })

    @app.get("/metrics", include_in_schema=False)
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def openapi() -> dict[str, Any]:
        # FastAPI only documents models that routes return as JSON; add the SSE event models by hand.
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            _, defs = models_json_schema(
                [(ImageGenPartialImageEvent, "serialization"), (ImageGenCompletedEvent, "serialization")],
                ref_template="#/components/schemas/{model}",
            )
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for name, schema in defs.get("$defs", {}).items():
                schemas.setdefault(name, schema)
            # Validation errors are answered 400 in OpenAI's shape (documented per route), never 422.
            for operations in doc.get("paths", {}).values():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app
