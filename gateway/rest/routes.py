"""The API's routes, on one APIRouter; the settings, the gateway connection and the metrics come in as FastAPI
dependencies (from app.state, set up by create_app and its lifespan)."""

from __future__ import annotations

import logging
import re
from typing import Annotated, Any

import grpc
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from grpc_health.v1 import health_pb2
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from glmimage.v1 import gateway_service_pb2
from services.runtime.auth import bearer_metadata

from . import limits as rest_limits
from . import sse, streaming, translate, upstream
from .errors import APIError
from .metrics import RestMetrics
from .middleware import REQUEST_ID_HEADER, request_id
from .schemas import ErrorResponse, ImageGenerationRequest, ImagesResponse, ModelCard, ModelList
from .settings import RestSettings

log = logging.getLogger("glmimage.rest")

_HEADER_VALUE_RE = re.compile(r"[\x20-\x7e]{1,8192}")


# The dependencies are coroutines although they only read app.state: FastAPI runs a plain `def` dependency in
# its thread pool, a thread hop per dependency per request (it cost the REST front ~30% of its throughput).
async def get_settings(request: Request) -> RestSettings:
    return request.app.state.settings


async def get_metrics(request: Request) -> RestMetrics:
    return request.app.state.metrics


async def get_gateway(request: Request) -> upstream.Gateway:
    return request.app.state.gateway


async def get_created(request: Request) -> int:
    """When the app was made: the models' `created`."""
    return request.app.state.created


Settings = Annotated[RestSettings, Depends(get_settings)]
Metrics = Annotated[RestMetrics, Depends(get_metrics)]
GatewayDep = Annotated[upstream.Gateway, Depends(get_gateway)]
Created = Annotated[int, Depends(get_created)]

router = APIRouter()

_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 415, 429, 499, 500, 503, 504)
}


@router.post(
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
        **_ERROR_RESPONSES,
    },
    summary="Create images from a prompt",
)
async def generate_images(body: ImageGenerationRequest, request: Request, settings: Settings, metrics: Metrics,
                          gateway: GatewayDep) -> Response:
    rid = request_id(request)
    req, quality = translate.to_grpc(body, settings, rid)
    rest_limits.check(req, body.partial_images or 0, request.app.state.limits.current)
    metadata: tuple[tuple[str, str], ...] = ((REQUEST_ID_HEADER, rid),)
    if settings.gateway_auth == "own":  # the gateway sees this front's key; the client's stays here
        metadata += bearer_metadata(settings.gateway_api_key)
    else:  # forwarded whether or not REST checks keys itself: the gateway may enforce its own
        # A repeated one is not forwarded, as no key check on any hop accepts one (services.runtime.auth).
        authorization = request.headers.getlist("authorization")
        if len(authorization) == 1 and _HEADER_VALUE_RE.fullmatch(authorization[0]):
            metadata += (("authorization", authorization[0]),)
    gen = translate.Generation(request=req, quality=quality, metadata=metadata, rid=rid)
    log.info(
        "%s generate n=%d size=%dx%d steps=%d format=%s stream=%s user=%r",
        rid, req.n, req.width, req.height, req.num_inference_steps, gen.output_format, bool(body.stream),
        body.user,
    )
    if body.stream:
        return await streaming.stream(gateway, gen, body.partial_images or 0, settings, metrics, request.receive,
                                      request.scope["state"])
    resp = await upstream.generate(gateway, gen, settings.request_timeout, request.receive)
    if resp is None:
        log.info("%s client disconnected; gateway call cancelled", rid)
        return Response(status_code=499)
    metrics.images.inc(len(resp.images))
    result = translate.images_json(resp, gen, settings)
    log.info("%s done: %d image(s), %d+%d tokens", rid, len(resp.images),
             resp.usage.prompt_tokens, resp.usage.completion_tokens)
    return JSONResponse(result)


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


@router.get("/health", summary="Ready when the gateway serves and has AR and denoiser workers")
async def health(settings: Settings, gateway: GatewayDep) -> Response:
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
