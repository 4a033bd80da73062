"""FastAPI dependencies shared by the routers: the settings, the metrics, the gateway connection and the app's
creation time, all from app.state (set up by create_app and its lifespan)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, Request

from . import sse, upstream
from .metrics import RestMetrics
from .schemas import ErrorResponse, ImagesResponse
from .settings import RestSettings


# Coroutines although they only read app.state: FastAPI runs a plain `def` dependency in its thread pool, a
# thread hop per dependency per request (it cost the REST front ~30% of its throughput at concurrency 32).
async def get_settings(request: Request) -> RestSettings:
    return request.app.state.settings


async def get_metrics(request: Request) -> RestMetrics:
    return request.app.state.metrics


async def get_gateway(request: Request) -> upstream.Gateways:
    return request.app.state.gateways


async def get_created(request: Request) -> int:
    """When the app was made: the models' `created`."""
    return request.app.state.created


Settings = Annotated[RestSettings, Depends(get_settings)]
Metrics = Annotated[RestMetrics, Depends(get_metrics)]
GatewayDep = Annotated[upstream.Gateways, Depends(get_gateway)]
Created = Annotated[int, Depends(get_created)]

# The OpenAI-shaped error answers every image route may give.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 415, 429, 499, 500, 503, 504)
}


def image_responses(partial_event: str, completed_event: str) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI responses of an image route: JSON, or with `stream: true` these events (models by name, added
    to the document by create_app), and the errors."""
    return {
        200: {
            "model": ImagesResponse,
            "description": f"JSON, or with `stream: true` server-sent events (`event: <type>`, `data: <json>`): "
            f"{partial_event}, then one {completed_event} per image; a failure after the first event is sent as "
            "an `error` event holding an ErrorResponse.",
            "content": {sse.MEDIA_TYPE: {"schema": {"oneOf": [
                {"$ref": f"#/components/schemas/{partial_event}"},
                {"$ref": f"#/components/schemas/{completed_event}"},
            ]}}},
        },
        **ERROR_RESPONSES,
    }
