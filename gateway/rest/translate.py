"""Translation between OpenAI JSON and the gRPC messages: an images request -> GenerateImagesRequest (sizes and
formats read with the suite's one parser and map, glmimage.wire.sizes and glmimage.wire.formats), a response's
images and usage -> JSON, GetStatus -> per-stage health."""

from __future__ import annotations

import base64
import time
from dataclasses import dataclass
from typing import Any

from glmimage.v1 import common_pb2, gateway_service_pb2
from glmimage.wire import formats, sizes

from .errors import APIError
from .schemas import ImageRequest
from .settings import RestSettings

# API name by ImageFormat value, as the gateway answers (a view of glmimage.wire.formats, for the stream's events).
FORMAT_NAMES = {value: fmt.name for value, fmt in formats.BY_PROTO.items()}
# DALL-E 3 quality names, for clients that still send them to the dall-e-3 alias.
_QUALITY_ALIASES = {"standard": "medium", "hd": "high"}
_READY_STATES = (gateway_service_pb2.WORKER_STATE_AVAILABLE, gateway_service_pb2.WORKER_STATE_BUSY)
STAGES = {"ar": gateway_service_pb2.WORKER_ROLE_AR, "denoiser": gateway_service_pb2.WORKER_ROLE_DENOISER}


@dataclass(frozen=True)
class StageHealth:
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


def stage_health(status: gateway_service_pb2.GetStatusResponse, role: int) -> StageHealth:
    members = [w for w in status.workers if w.role == role]
    idle = [w for w in members if w.state not in _READY_STATES]
    return StageHealth(ready=len(members) - len(idle), stuck=sum(1 for w in members if w.stuck),
                        total=len(members), why=tuple(sorted({w.health or "unknown" for w in idle})))


def parse_size(size: str | None, settings: RestSettings) -> tuple[int, int]:
    """Return (width, height); rounding to a multiple of 32 is the services' job."""
    if size is None or size == "auto":
        return settings.default_size
    try:
        width, height = sizes.parse_size(size)
    except ValueError as exc:
        raise APIError(400, f"{exc}; or 'auto' for the default", param="size", code="invalid_value") from None
    return width, height  # the pixel budget is a limit in force (gateway/rest/limits.py)


def to_grpc(
    body: ImageRequest, settings: RestSettings, rid: str
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
    width, height = parse_size(body.size, settings)
    quality = _QUALITY_ALIASES.get(body.quality or "auto", body.quality or "auto")
    steps = body.num_inference_steps
    if steps is None:
        steps = settings.quality_steps.get(quality, 0)
    req = gateway_service_pb2.GenerateImagesRequest(
        prompt=body.prompt,
        n=body.n or 1,
        width=width,
        height=height,
        output_format=formats.by_name(body.output_format or formats.DEFAULT.name).proto,
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


def usage_json(u: common_pb2.Usage, image_count: int, settings: RestSettings) -> dict[str, Any]:
    # Of the prompt tokens, an edit's reference images contributed image_tokens (0 for a generation).
    image_tokens = min(u.image_tokens, u.prompt_tokens)
    usage: dict[str, Any] = {
        "input_tokens": u.prompt_tokens,
        "output_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens or u.prompt_tokens + u.completion_tokens,
        "input_tokens_details": {"text_tokens": u.prompt_tokens - image_tokens, "image_tokens": image_tokens},
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "reasoning_tokens": u.reasoning_tokens,
        "image_count": image_count,
    }
    # Cache hits reveal what other users prompted, so reporting them is opt-in.
    if settings.enable_cache_report and u.cached_tokens > 0:
        usage["prompt_tokens_details"] = {"cached_tokens": u.cached_tokens}
    return usage


@dataclass
class Generation:
    """What one generation or edit call needs to answer: the gRPC request and the echoed settings."""

    request: gateway_service_pb2.GenerateImagesRequest
    quality: str
    metadata: tuple[tuple[str, str], ...]
    rid: str
    events: str = "image_generation"  # the stream's event names: "<events>.partial_image", "<events>.completed"

    @property
    def output_format(self) -> str:
        return formats.name_of(self.request.output_format)

    def echo(self, size: str, output_format: str) -> dict[str, Any]:
        return {"size": size, "quality": self.quality, "background": "opaque", "output_format": output_format}


def images_json(resp: gateway_service_pb2.GenerateImagesResponse, gen: Generation,
                settings: RestSettings) -> dict[str, Any]:
    """A GenerateImagesResponse as the OpenAI ImagesResponse JSON."""
    req = gen.request
    return {
        "created": int(time.time()),
        "data": [{"b64_json": base64.b64encode(img.image).decode("ascii")} for img in resp.images],
        **gen.echo(f"{resp.width or req.width}x{resp.height or req.height}",
                   formats.name_of(resp.output_format, gen.output_format)),
        "usage": usage_json(resp.usage, len(resp.images), settings),
    }
