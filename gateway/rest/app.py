"""OpenAI-compatible REST front for GLM-Image.

A thin translator: it validates OpenAI Images API requests, calls
`glmimage.v1.GatewayService` over one gRPC channel and maps the answer (or the
gRPC status) back to OpenAI-shaped JSON. It holds no model and no torch.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from glmimage.v1 import common_pb2, gateway_service_pb2, gateway_service_pb2_grpc

from .errors import APIError, error_response, from_rpc_error, from_validation_errors
from .schemas import ErrorResponse, ImageGenerationRequest, ImagesResponse, ModelList

log = logging.getLogger("glmimage.rest")

REQUEST_ID_HEADER = "x-request-id"
# How often the handler checks whether the HTTP client is still there.
DISCONNECT_POLL_S = 0.05
# Ten 2048x2048 PNGs can exceed gRPC's 4 MiB default by far.
_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 256 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
]
# Client-supplied ids end up in gRPC metadata and logs: printable ASCII only.
_REQUEST_ID_RE = re.compile(r"[\x21-\x7e]{1,128}")
_HEADER_VALUE_RE = re.compile(r"[\x20-\x7e]{1,8192}")
_SIZE_RE = re.compile(r"([0-9]{1,7})x([0-9]{1,7})")

_FORMATS: dict[str, common_pb2.ImageFormat.ValueType] = {
    "png": common_pb2.IMAGE_FORMAT_PNG,
    "jpeg": common_pb2.IMAGE_FORMAT_JPEG,
    "webp": common_pb2.IMAGE_FORMAT_WEBP,
}
_FORMAT_NAMES = {v: k for k, v in _FORMATS.items()}
# DALL-E 3 quality names, for clients that still send them to the dall-e-3 alias.
_QUALITY_ALIASES = {"standard": "medium", "hd": "high"}
_READY_STATES = (gateway_service_pb2.WORKER_STATE_AVAILABLE, gateway_service_pb2.WORKER_STATE_BUSY)


def _default_quality_steps() -> dict[str, int]:
    # 0 means "let the denoiser pick its default".
    return {"low": 10, "medium": 30, "high": 50, "auto": 0}


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

    @property
    def model_names(self) -> tuple[str, ...]:
        return (self.served_model, *self.model_aliases)


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


class _FrontMiddleware:
    """Request id, API-key auth, metrics and the last-resort 500, as one pure ASGI layer.

    Pure ASGI (not BaseHTTPMiddleware) so that `receive` reaches the route untouched and
    disconnect detection keeps working. Auth runs here, before FastAPI parses the body.
    """

    def __init__(self, app: ASGIApp, settings: RestSettings, metrics: RestMetrics, router: APIRouter) -> None:
        self.app = app
        self.metrics = metrics
        self.router = router
        self.api_keys = tuple(k.encode() for k in settings.api_keys)

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
            else:
                await self.app(scope, receive, send_wrapper)
        except Exception:
            log.exception("%s unhandled error on %s %s", rid, scope.get("method"), scope.get("path"))
            if not started:
                resp = error_response(
                    500, "internal server error", type="server_error", code="internal_error"
                )
                await resp(scope, receive, send_wrapper)
        finally:
            label = self._route_label(scope)
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
    if body.stream:
        raise APIError(400, "streaming is not supported yet", param="stream", code="unsupported_value")
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


def _usage(resp: gateway_service_pb2.GenerateImagesResponse, settings: RestSettings) -> dict[str, Any]:
    u = resp.usage
    usage: dict[str, Any] = {
        "input_tokens": u.prompt_tokens,
        "output_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens or u.prompt_tokens + u.completion_tokens,
        "input_tokens_details": {"text_tokens": u.prompt_tokens, "image_tokens": 0},
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "reasoning_tokens": u.reasoning_tokens,
        "image_count": len(resp.images),
    }
    # Cache hits reveal what other users prompted, so reporting them is opt-in.
    if settings.enable_cache_report and u.cached_tokens > 0:
        usage["prompt_tokens_details"] = {"cached_tokens": u.cached_tokens}
    return usage


async def _cancel_on_disconnect(request: Request, call: grpc.aio.UnaryUnaryCall, gone: asyncio.Event) -> None:
    while not call.done():
        if await request.is_disconnected():
            gone.set()
            call.cancel()  # propagates as a gRPC cancellation down to the AR/denoiser work
            return
        await asyncio.sleep(DISCONNECT_POLL_S)


async def _generate(
    gateway: _Gateway,
    req: gateway_service_pb2.GenerateImagesRequest,
    metadata: tuple[tuple[str, str], ...],
    timeout: float,
    request: Request,
) -> gateway_service_pb2.GenerateImagesResponse | None:
    """Run GenerateImages; None if the HTTP client went away (the RPC is then cancelled)."""
    call = gateway.stub.GenerateImages(req, metadata=metadata, timeout=timeout)
    gone = asyncio.Event()
    watcher = asyncio.create_task(_cancel_on_disconnect(request, call, gone))
    try:
        return await call
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if gone.is_set() and not (task and task.cancelling()):
            return None
        raise
    except grpc.aio.AioRpcError as err:
        if gone.is_set():
            return None
        raise from_rpc_error(err) from err
    finally:
        watcher.cancel()
        if not call.done():
            call.cancel()


def create_app(settings: RestSettings) -> FastAPI:
    metrics = RestMetrics()
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # grpc.aio channels bind to the running loop, so create it here, not in create_app.
        channel = grpc.aio.insecure_channel(settings.gateway_address, options=_CHANNEL_OPTIONS)
        app.state.gateway = _Gateway(
            channel, gateway_service_pb2_grpc.GatewayServiceStub(channel), health_pb2_grpc.HealthStub(channel)
        )
        log.info("REST front using gateway at %s", settings.gateway_address)
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
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(exc.status_code, str(exc.detail), type=err_type, code=code, headers=exc.headers)

    error_responses: dict[int | str, dict[str, Any]] = {
        status: {"model": ErrorResponse} for status in (400, 401, 404, 429, 499, 500, 503, 504)
    }

    @app.post(
        "/v1/images/generations",
        response_class=JSONResponse,
        responses={200: {"model": ImagesResponse}, **error_responses},
        summary="Create images from a prompt",
    )
    async def generate_images(body: ImageGenerationRequest, request: Request) -> Response:
        rid = _request_id(request)
        req, quality = _to_grpc(body, settings, rid)
        metadata: tuple[tuple[str, str], ...] = ((REQUEST_ID_HEADER, rid),)
        authorization = request.headers.get("authorization")
        if authorization and _HEADER_VALUE_RE.fullmatch(authorization):
            metadata += (("authorization", authorization),)
        log.info(
            "%s generate n=%d size=%dx%d steps=%d format=%s user=%r",
            rid, req.n, req.width, req.height, req.num_inference_steps,
            body.output_format or "png", body.user,
        )
        resp = await _generate(request.app.state.gateway, req, metadata, settings.request_timeout, request)
        if resp is None:
            log.info("%s client disconnected; gateway call cancelled", rid)
            return Response(status_code=499)
        metrics.images.inc(len(resp.images))
        result = {
            "created": int(time.time()),
            "data": [{"b64_json": base64.b64encode(img.image).decode("ascii")} for img in resp.images],
            "size": f"{resp.width or req.width}x{resp.height or req.height}",
            "output_format": _FORMAT_NAMES.get(resp.output_format, "png"),
            "quality": quality,
            "background": "opaque",
            "usage": _usage(resp, settings),
        }
        log.info("%s done: %d image(s), %d+%d tokens", rid, len(resp.images),
                 resp.usage.prompt_tokens, resp.usage.completion_tokens)
        return JSONResponse(result)

    @app.get("/v1/models", response_model=ModelList, summary="List the served model and its aliases")
    async def list_models() -> ModelList:
        cards = [{"id": name, "created": created, "owned_by": "glmimage"} for name in settings.model_names]
        return ModelList.model_validate({"data": cards})

    @app.get("/health", summary="Ready when the gateway serves and has AR and denoiser workers")
    async def health(request: Request) -> Response:
        gateway: _Gateway = request.app.state.gateway
        timeout = settings.health_timeout

        def unavailable(reason: str) -> Response:
            log.info("health: unavailable: %s", reason)
            return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)

        try:
            check = await gateway.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
            if check.status != health_pb2.HealthCheckResponse.SERVING:
                name = health_pb2.HealthCheckResponse.ServingStatus.Name(check.status)
                return unavailable(f"gateway health is {name}")
            status = await gateway.stub.GetStatus(gateway_service_pb2.GetStatusRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as err:
            return unavailable(f"gateway unreachable: {err.code().name}: {err.details()}")
        def ready(role: gateway_service_pb2.WorkerRole.ValueType) -> int:
            return sum(1 for w in status.workers if w.role == role and w.state in _READY_STATES)

        ar = ready(gateway_service_pb2.WORKER_ROLE_AR)
        denoisers = ready(gateway_service_pb2.WORKER_ROLE_DENOISER)
        missing = [name for name, count in (("AR", ar), ("denoiser", denoisers)) if count == 0]
        if missing:
            return unavailable(f"no {' and no '.join(missing)} worker available or busy")
        return JSONResponse({
            "status": "ok",
            "gateway": "SERVING",
            "ar_workers": ar,
            "denoiser_workers": denoisers,
            "active_requests": status.active_requests,
        })

    @app.get("/metrics", include_in_schema=False)
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
