"""OpenAI-compatible REST front for GLM-Image.

A thin translator: it validates OpenAI Images API requests, calls
`glmimage.v1.GatewayService` over one gRPC channel (plaintext or TLS) and maps the
answer (or the gRPC status) back to OpenAI-shaped JSON, or to server-sent events
when the client asks for `stream: true`. It holds no model and no torch.

This module only wires the parts together: settings (settings.py), the front ASGI layer (middleware.py), the
gateway connection (upstream.py), the limits in force (limits.py), the LoRA adapters the pool serves (adapters.py),
the JSON <-> gRPC translation (translate.py), the event stream (streaming.py, sse.py) and the routes (routes.py;
edits.py; their shared parts in deps.py and dispatch.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from gateway.jobs.defaults import default_image_store, default_url_secret_file
from gateway.jobs.images import DiskImageStore
from gateway.jobs.urls import UrlSigner, load_url_secret
from runtime.details import RATE_LIMIT_HEADERS, RETRY_AFTER_KEY

from .adapters import AdapterCache
from .edits import router as edits_router
from .errors import APIError, error_response, from_validation_errors
from .files import router as files_router
from .jobs import router as jobs_router
from .keys import FrontKeys
from .limits import LimitsCache, with_limits
from .metrics import RestMetrics
from .middleware import REQUEST_ID_HEADER, FrontMiddleware, request_id
from .routes import router
from .schemas import (
    ImageEditCompletedEvent,
    ImageEditPartialImageEvent,
    ImageEditRequest,
    ImageGenCompletedEvent,
    ImageGenerationRequest,
    ImageGenPartialImageEvent,
)
from .settings import GATEWAY_AUTH_MODES, RestSettings
from .status_page import router as status_router
from .upstream import channel_credentials, open_gateways

__all__ = ["GATEWAY_AUTH_MODES", "RestSettings", "create_app"]

log = logging.getLogger("glmimage.rest")


def image_serving(settings: RestSettings) -> tuple[UrlSigner, DiskImageStore]:
    """The signer of image links and the disk store this front serves, as the gateways default them."""
    try:
        # (The TTL is the signing gateway's; this front only verifies.)
        signer = UrlSigner(load_url_secret(settings.url_secret_file, default=default_url_secret_file()), 3600.0)
    except (ValueError, OSError) as exc:
        raise SystemExit(f"rest: image links: {exc}") from None
    return signer, DiskImageStore(settings.image_store or Path(default_image_store()), signer)


def create_app(settings: RestSettings) -> FastAPI:
    metrics = RestMetrics()
    credentials = channel_credentials(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # grpc.aio channels bind to the running loop, so create it here, not in create_app.
        gateways = open_gateways(settings, credentials)
        app.state.gateways = gateways
        app.state.gateway = gateways.first
        log.info("REST front using gateway at %s (%s)", ", ".join(settings.gateway_addresses),
                 "TLS" if credentials is not None else "plaintext")
        # Serve with the gateway's limits from the first request on (the defaults if none is up yet).
        stubs = [g.stub for g in gateways]
        await app.state.limits.refresh(stubs, settings.health_timeout)
        follow = asyncio.create_task(app.state.limits.follow(stubs, settings.health_timeout), name="limits")
        try:
            yield
        finally:
            follow.cancel()
            await asyncio.gather(follow, return_exceptions=True)
            await gateways.close()

    app = FastAPI(
        title="GLM-Image OpenAI-compatible API",
        version="1.0",
        description="OpenAI Images API served by the GLM-Image gateway.",
        lifespan=lifespan,
        # FastAPI's own telemetry (newer releases; older ones ignore the argument) stays off: the front's span is
        # the middleware's, one per image request, and health probes and /metrics scrapes make none.
        telemetry={"tracing": False, "metrics": False, "logs": False},
    )
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.limits = LimitsCache()
    app.state.adapters = AdapterCache()
    app.state.created = int(time.time())
    app.state.keys = FrontKeys(settings)  # reads a tenants file now: a bad one stops the front here
    app.state.url_signer, app.state.image_store = image_serving(settings)
    app.add_middleware(FrontMiddleware, settings=settings, metrics=metrics, router=app.router, limits=app.state.limits,
                       keys=app.state.keys)
    if settings.cors_origins:
        # Outside the front's layer: preflights carry no API key, and its own answers (401, 413...) get the headers.
        # Any request header (the SDK adds its x-stainless-* ones); no cookies, the API key is a header.
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["*"], max_age=600,
                           # What a browser's script may read: the id, when to retry, the tenant's rate limits.
                           expose_headers=[REQUEST_ID_HEADER, RETRY_AFTER_KEY, *RATE_LIMIT_HEADERS])

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        if exc.status >= 500:
            log.warning("%s answered %d: %s", request_id(request), exc.status, exc.message)
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        # The one JSON body FastAPI validates is a generation's (an edit's form is validated in edits.py).
        return from_validation_errors(exc.errors(), ImageGenerationRequest.model_fields).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 400 and isinstance(cause := exc.__cause__, UnicodeDecodeError):
            # FastAPI's "error parsing the body": JSON must be UTF-8, so such a body is invalid JSON like any other.
            return error_response(400, f"request body is not valid JSON: not UTF-8 (byte {cause.start})",
                                  code="invalid_json")
        err_type = "server_error" if exc.status_code >= 500 else "invalid_request_error"
        code = {400: "invalid_value", 404: "not_found", 405: "method_not_allowed",
                413: "request_too_large"}.get(exc.status_code)
        return error_response(exc.status_code, str(exc.detail), type=err_type, code=code, headers=exc.headers)

    app.include_router(router)
    app.include_router(edits_router)
    app.include_router(jobs_router)
    app.include_router(files_router)
    app.include_router(status_router)

    def openapi() -> dict[str, Any]:
        # FastAPI only documents models that routes take or return as JSON; add the SSE event models and the
        # multipart edit body by hand.
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            _, defs = models_json_schema(
                [(ImageGenPartialImageEvent, "serialization"), (ImageGenCompletedEvent, "serialization"),
                 (ImageEditPartialImageEvent, "serialization"), (ImageEditCompletedEvent, "serialization"),
                 (ImageEditRequest, "validation")],
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
        return with_limits(app.openapi_schema, app.state.limits.current)

    app.openapi = openapi  # type: ignore[method-assign]
    return app
