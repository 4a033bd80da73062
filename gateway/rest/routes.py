"""The generation, model and health routes, on one APIRouter (edits: edits.py); the settings, the gateway connection
and the metrics come in as FastAPI dependencies (deps.py)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Coroutine
from typing import Any

import grpc
from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from grpc_health.v1 import health_pb2
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from glmimage.v1 import gateway_service_pb2
from services.runtime.auth import bearer_metadata

from . import dispatch, translate, upstream
from .deps import Created, GatewayDep, Metrics, Settings, image_responses
from .errors import APIError
from .middleware import request_id
from .schemas import ErrorResponse, ImageGenerationRequest, ModelCard, ModelList
from .settings import RestSettings

log = logging.getLogger("glmimage.rest")

router = APIRouter()


class _GenerationRoute(APIRoute):
    """The generation route without FastAPI's generic request handler, whose dependency machinery costs more per
    request than everything this front does with one: the body is read, parsed and validated in one step, and
    refused exactly as FastAPI refuses a JSON body (the same validation errors, the same 400 for undecodable
    bytes). The endpoint's signature still makes the route's OpenAPI entry."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        endpoint = self.endpoint

        async def handler(request: Request) -> Response:
            return await endpoint(await _generation_body(request), request)

        return handler


async def _generation_body(request: Request) -> ImageGenerationRequest:
    raw = await request.body()  # the front layer has refused any body that is neither JSON nor empty
    if not raw:
        raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}])
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", exc.pos), "msg": "JSON decode error",
                                       "input": {}, "ctx": {"error": exc.msg}}]) from exc
    except UnicodeDecodeError as exc:  # answered invalid_json by the app's handler, which looks at the cause
        raise StarletteHTTPException(400, "There was an error parsing the body") from exc
    try:
        return ImageGenerationRequest.model_validate(data)
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None


async def generate_images(body: ImageGenerationRequest, request: Request) -> Response:
    # The app's parts straight from app.state: this route's handler solves no dependencies (_GenerationRoute).
    state = request.app.state
    settings: RestSettings = state.settings
    rid = request_id(request)
    gen = translate.admit(body, settings, state.limits.current, rid=rid,
                          metadata=dispatch.gateway_metadata(request, settings, rid))
    admitted = gen.admitted
    log.info("%s generate n=%d size=%dx%d steps=%d format=%s stream=%s user=%r", rid, admitted.n, admitted.width,
             admitted.height, gen.request.num_inference_steps, gen.output_format, gen.stream, body.user)
    return await dispatch.answer(gen, request, settings, state.metrics, state.gateways)


router.add_api_route("/v1/images/generations", generate_images, methods=["POST"], response_class=JSONResponse,
                     responses=image_responses("ImageGenPartialImageEvent", "ImageGenCompletedEvent"),
                     summary="Create images from a prompt", route_class_override=_GenerationRoute)


@router.get("/v1/models", response_model=ModelList, summary="List the served model and its aliases")
async def list_models(settings: Settings, created: Created) -> ModelList:
    return ModelList(data=[ModelCard(id=name, created=created, owned_by="glmimage") for name in settings.model_names])


# :path, so that a served model named like "zai-org/GLM-Image" can be retrieved too.
@router.get("/v1/models/{model_id:path}", response_model=ModelCard, responses={404: {"model": ErrorResponse}},
            summary="The served model or one of its aliases")
async def retrieve_model(model_id: str, settings: Settings, created: Created) -> ModelCard:
    if model_id not in settings.model_names:
        raise APIError(404, f"model {model_id!a} does not exist; available: {', '.join(settings.model_names)}",
                       param="model", code="model_not_found")
    return ModelCard(id=model_id, created=created, owned_by="glmimage")


@router.get("/health", summary="Ready when a gateway serves and has AR and denoiser workers")
async def health(settings: Settings, gateways: GatewayDep) -> Response:
    """Ready when any gateway is (the others' calls are resubmitted to it); otherwise the first one's reason."""
    first: Response | None = None
    for gateway in gateways:
        answer = await _gateway_health(settings, gateway)
        if answer.status_code == 200:
            return answer
        first = first or answer
    assert first is not None
    return first


async def _gateway_health(settings: RestSettings, gateway: upstream.Gateway) -> Response:
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
                                              metadata=bearer_metadata(settings.gateway_api_key))
    except grpc.aio.AioRpcError as err:
        log.info("health: gateway call failed: %s: %s", err.code().name, err.details())
        if err.code() == grpc.StatusCode.UNAUTHENTICATED:
            return unavailable("the gateway refused the status call (UNAUTHENTICATED); "
                               "give the REST front a key with --gateway-api-key")
        return unavailable(f"the gateway is unreachable ({err.code().name})")
    stages = {name: translate.stage_health(status, role) for name, role in translate.STAGES.items()}
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


@router.get("/metrics", include_in_schema=False)
async def prometheus_metrics(metrics: Metrics) -> Response:
    return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)
