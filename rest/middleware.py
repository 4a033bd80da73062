"""The front layer, one pure ASGI middleware: request ids, API-key auth, body-size and content-type checks,
metrics and the last-resort 500. It runs before FastAPI parses a body.

A JSON body is bounded by RestSettings.max_body_bytes; a multipart edit by the reference images' total bound in
force (the gateway's limits) plus that much again for its text fields (limits.edit_body_bytes)."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

from fastapi import APIRouter, Request
from fastapi.responses import Response
from opentelemetry import context as otel_context
from opentelemetry import trace
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from runtime import tracing
from runtime.auth import bearer_token
from runtime.logs import REQUEST_ID_KEY, new_request_id, request_id_or_new

from .errors import error_response
from .keys import FrontKeys
from .limits import LimitsCache, edit_body_bytes
from .metrics import RestMetrics
from .settings import RestSettings

FILES_PREFIX = "/v1/images/files/"

log = logging.getLogger("glmimage.rest")

REQUEST_ID_HEADER = REQUEST_ID_KEY
_RID_BYTES = REQUEST_ID_KEY.encode()
# scope["state"] key: the status to count in the metrics instead of the one the response started with (a stream
# has sent its 200 long before it learns that the client went away).
OUTCOME_STATUS_KEY = "outcome_status"
# Routes whose body is JSON: anything else there is answered 415 before the body is read.
_JSON_BODY_ROUTES = frozenset({("POST", "/v1/images/generations")})
# Routes whose body is multipart/form-data (file uploads), with a bound of their own.
_MULTIPART_BODY_ROUTES = frozenset({("POST", "/v1/images/edits")})
# The routes that get a server span when traces are on (each image request; not health, metrics or models).
_TRACED_ROUTES = _JSON_BODY_ROUTES | _MULTIPART_BODY_ROUTES
_TRACER = tracing.tracer("glmimage.rest")


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


class FrontMiddleware:
    """Request id, API-key auth, the body checks, metrics and the last-resort 500, as one pure ASGI layer.

    Pure ASGI (not BaseHTTPMiddleware) so that `receive` reaches the route untouched and
    disconnect detection keeps working. Auth runs here, before FastAPI parses the body.
    """

    def __init__(self, app: ASGIApp, settings: RestSettings, metrics: RestMetrics, router: APIRouter,
                 limits: LimitsCache, keys: FrontKeys) -> None:
        self.app = app
        self.metrics = metrics
        self.router = router
        self.limits = limits
        self.keys = keys  # the --api-key list or the tenants in force, read on every request (SIGHUP reloads)
        self.max_body_bytes = settings.max_body_bytes

    def _body_limit(self, route: tuple[str, str]) -> int:
        if route in _MULTIPART_BODY_ROUTES:  # the limits in force now: they follow the gateway's
            return edit_body_bytes(self.limits.current, self.max_body_bytes)
        return self.max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        # The gRPC servers' rule (runtime.logs), on the first header as they take the first metadata value.
        rid = request_id_or_new(next((v for k, v in scope.get("headers", ()) if k.lower() == _RID_BYTES), None))
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
        route = (scope.get("method", ""), scope["path"])
        span, token = None, None
        if tracing.enabled() and route in _TRACED_ROUTES:
            # A caller's traceparent makes this span its child; dispatch.gateway_metadata carries it on.
            parent = tracing.context_from_headers(scope.get("headers", ()))
            span = _TRACER.start_span(" ".join(route), context=parent, kind=trace.SpanKind.SERVER,
                                      attributes={"http.request.method": route[0], "http.route": route[1],
                                                  "glmimage.request_id": rid})
            token = otel_context.attach(trace.set_span_in_context(span, parent))
        try:
            path: str = scope["path"]
            body_limit = self._body_limit(route)
            # A stored image's signed link is its own credential (a browser or the openai SDK fetches it with no
            # key); the files route checks a key that is presented (another tenant's gets 404).
            if path.startswith("/v1/") and not path.startswith(FILES_PREFIX) \
                    and not self.keys.user(bearer_token(scope["headers"])):
                log.info("%s rejected: missing or invalid API key", rid)
                resp = error_response(
                    401, "invalid or missing API key", type="authentication_error", code="invalid_api_key"
                )
                await resp(scope, receive, send_wrapper)
            elif _declared_length(headers) > body_limit:
                log.info("%s rejected: Content-Length %s over the limit", rid, headers["content-length"])
                await _BodyTooLarge(body_limit).response()(scope, receive, send_wrapper)
            elif (wanted := _wrong_media_type(route, headers)) is not None:
                given = headers.get("content-type", "")[:100]
                log.info("%s rejected: body content type %r", rid, given)
                why = f"Content-Type is {given!a}" if given else "the request has no Content-Type header"
                resp = error_response(415, f"the request body must be {wanted}; {why}",
                                      code="unsupported_media_type")
                await resp(scope, receive, send_wrapper)
            else:
                await self.app(scope, _bounded(receive, body_limit), send_wrapper)
        except ClientDisconnect:  # it left (or was timed out, connections.py) before its body was read: no answer
            log.info("%s the client went away before its request body was read", rid)
            scope["state"].setdefault(OUTCOME_STATUS_KEY, 499)
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
            self.metrics.answered(label, status, time.perf_counter() - t0)
            if span is not None and token is not None:
                span.set_attribute("http.response.status_code", status)
                if status >= 500:
                    span.set_status(trace.StatusCode.ERROR)
                span.end()
                otel_context.detach(token)

    def _route_label(self, scope: Scope) -> str:
        # The matched route template keeps label cardinality bounded; requests rejected
        # before routing (auth) still get their route if the path is a known one.
        route = scope.get("route")
        if route is not None:
            return str(getattr(route, "path", "unmatched"))
        known = {getattr(r, "path", None) for r in self.router.routes}
        return scope["path"] if scope["path"] in known else "unmatched"


def _wrong_media_type(route: tuple[str, str], headers: Mapping[str, str]) -> str | None:
    """The media type the route wants, when the request's body is not of it (None: fine, or any body goes)."""
    if route in _JSON_BODY_ROUTES and not _json_or_no_body(headers):
        return "application/json"
    media = headers.get("content-type", "").partition(";")[0].strip().lower()
    if route in _MULTIPART_BODY_ROUTES and media != "multipart/form-data":
        return "multipart/form-data"
    return None


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


def request_id(request: Request) -> str:
    return str(request.scope.get("state", {}).get("request_id") or new_request_id())
