"""The generation, model and health routes, on one APIRouter (edits: edits.py); the settings, the gateway connection
and the metrics come in as FastAPI dependencies (deps.py), except on the generation route, the hot path, which
reads the same objects from app.state."""

from __future__ import annotations

import logging
from typing import Any

import grpc
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from grpc_health.v1 import health_pb2
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from glmimage.v1 import gateway_service_pb2
from runtime.auth import bearer_metadata

from . import adapters, dispatch, translate, upstream
from .deps import Created, GatewayDep, Metrics, Settings, image_responses
from .middleware import request_id
from .schemas import ErrorResponse, ImageGenerationRequest, ModelCard, ModelList
from .settings import RestSettings

log = logging.getLogger("glmimage.rest")

router = APIRouter()


async def generate_images(body: ImageGenerationRequest, request: Request) -> Response:
    state = request.app.state
    settings: RestSettings = state.settings
    rid = request_id(request)
    adapter = await adapters.model_adapter(body.model, request, settings, rid)  # reads nothing for a served name
    gen = translate.admit(body, settings, state.limits.current, rid=rid,
                          metadata=dispatch.gateway_metadata(request, settings, rid), adapter=adapter)
    admitted = gen.admitted
    log.info("%s generate n=%d size=%dx%d steps=%d format=%s stream=%s loras=%s user=%r", rid, admitted.n,
             admitted.width, admitted.height, gen.request.num_inference_steps, gen.output_format, gen.stream,
             ",".join(ref.name for ref in gen.request.loras) or "-", body.user)
    return await dispatch.answer(gen, request, settings, state.metrics, state.gateways)


router.add_api_route("/v1/images/generations", generate_images, methods=["POST"], response_class=JSONResponse,
                     responses=image_responses("ImageGenPartialImageEvent", "ImageGenCompletedEvent"),
                     summary="Create images from a prompt")


def _card(name: str, settings: RestSettings, created: int, adapter: bool = False) -> ModelCard:
    """A served name's card, or (vLLM's form) a LoRA adapter's: its parent is the served model."""
    if adapter:
        return ModelCard(id=name, created=created, owned_by="glmimage", root=name, parent=settings.served_model)
    return ModelCard(id=name, created=created, owned_by="glmimage")


@router.get("/v1/models", response_model=ModelList,
            summary="List the served model, its aliases and the LoRA adapters the pool serves")
async def list_models(request: Request, settings: Settings, created: Created) -> ModelList:
    names = settings.model_names
    served = [_card(name, settings, created) for name in names]
    # A served name wins over an adapter of the same name, as a request's `model` does.
    loras = [_card(name, settings, created, adapter=True)
             for name in sorted(await adapters.listed_adapters(request, settings)) if name not in names]
    return ModelList(data=served + loras)


# :path, so that a served model named like "zai-org/GLM-Image" can be retrieved too.
@router.get("/v1/models/{model_id:path}", response_model=ModelCard, responses={404: {"model": ErrorResponse}},
            summary="The served model, one of its aliases or a LoRA adapter")
async def retrieve_model(model_id: str, request: Request, settings: Settings, created: Created) -> ModelCard:
    if model_id in settings.model_names:
        return _card(model_id, settings, created)
    if model_id in await adapters.listed_adapters(request, settings):
        return _card(model_id, settings, created, adapter=True)
    raise translate.model_not_found(model_id, settings)


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
