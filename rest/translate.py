"""Translation between OpenAI JSON and the gRPC messages: an images request, admitted once (admit), -> one
GenerateImagesRequest (sizes and formats read with the suite's one parser and map, glmimage.wire.sizes and
glmimage.wire.formats), a response's images and usage -> JSON, GetStatus -> per-stage health."""

from __future__ import annotations

import base64
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gateway.jobs.render import usage_json
from glmimage.v1 import common_pb2, gateway_service_pb2
from glmimage.wire import formats, sizes
from runtime.admission import Admitted, check_generate, check_partial_images
from runtime.errors import InvalidArgument
from runtime.limits import MAX_ASPECT, SIZE_MULTIPLE, Limits, check_loras, check_reference_images

from .errors import APIError
from .limits import as_api_error
from .schemas import ImageRequest, LoraRef
from .settings import RestSettings

# API name by ImageFormat value, as the gateway answers (a view of glmimage.wire.formats, for the stream's events).
FORMAT_NAMES = {value: fmt.name for value, fmt in formats.BY_PROTO.items()}
# DALL-E 3 quality names, for clients that still send them to the dall-e-3 alias.
_QUALITY_ALIASES = {"standard": "medium", "hd": "high"}
_READY_STATES = (gateway_service_pb2.WORKER_STATE_AVAILABLE, gateway_service_pb2.WORKER_STATE_BUSY)
STAGES = {"ar": gateway_service_pb2.WORKER_ROLE_AR, "denoiser": gateway_service_pb2.WORKER_ROLE_DENOISER}
# A request's `priority` -> the proto's Priority (absent: PRIORITY_UNSPECIFIED, the gateway's default class).
PRIORITIES = {name: gateway_service_pb2.Priority.Value(f"PRIORITY_{name.upper()}")
              for name in ("interactive", "default", "batch")}


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
    return width, height  # the pixel budget is a limit in force (rest/limits.py)


def auto_size(width: int, height: int, max_pixels: int) -> tuple[int, int]:
    """An edit's `size: auto`: the first reference's aspect ratio at its own pixel count, scaled down to
    ``max_pixels`` when larger, each side rounded to the nearest multiple of 32 (at least 32). A 96x64 reference
    gives 96x64."""
    scale = min(1.0, math.sqrt(max_pixels / (width * height)))
    # Half up (not round()'s half to even), so that the same aspect always rounds the same way.
    w, h = (max(1, math.floor(side * scale / SIZE_MULTIPLE + 0.5)) * SIZE_MULTIPLE for side in (width, height))
    while w * h > max_pixels and max(w, h) > SIZE_MULTIPLE:  # rounding up passed the budget: trim the longer side
        if w >= h:
            w -= SIZE_MULTIPLE
        else:
            h -= SIZE_MULTIPLE
    # Rounding a 4:1 reference can pass the aspect bound the target is held to (188x47 -> 192x32): widen the short
    # side while the budget allows, else shorten the long one.
    while max(w, h) > MAX_ASPECT * min(w, h):
        if (min(w, h) + SIZE_MULTIPLE) * max(w, h) <= max_pixels:
            w, h = (w + SIZE_MULTIPLE, h) if w < h else (w, h + SIZE_MULTIPLE)
        else:
            w, h = (w, h - SIZE_MULTIPLE) if w < h else (w - SIZE_MULTIPLE, h)
    return w, h


@dataclass(frozen=True)
class Generation:
    """One admitted generation or edit (admit): everything the gateway call and the answer read, settled once.
    The gateway request inside is built once and never written to; n and the size are the admission's."""

    admitted: Admitted
    quality: str  # the effective quality name, echoed
    stream: bool
    partial_images: int
    metadata: tuple[tuple[str, str], ...]
    rid: str
    events: str = "image_generation"  # the stream's event names: "<events>.partial_image", "<events>.completed"
    webhook_url: str = ""  # a job's (Prefer: respond-async)

    @property
    def request(self) -> gateway_service_pb2.GenerateImagesRequest:
        return self.admitted.request

    @property
    def output_format(self) -> str:
        return formats.name_of(self.admitted.request.output_format)

    def size(self, width: int = 0, height: int = 0) -> str:
        """`WxH` as the gateway answered it, else as admitted."""
        return f"{width or self.admitted.width}x{height or self.admitted.height}"

    def echo(self, size: str, output_format: str) -> dict[str, Any]:
        return {"size": size, "quality": self.quality, "background": "opaque", "output_format": output_format}


def model_not_found(model: str, settings: RestSettings) -> APIError:
    return APIError(404, f"model {model!a} does not exist; available: {', '.join(settings.model_names)}, or a "
                    "LoRA adapter that GET /v1/models lists", param="model", code="model_not_found")


def lora_refs(loras: Sequence[LoraRef], adapter: str | None, limits: Limits) -> list[LoraRef]:
    """A request's adapters, checked by the limits model: ``loras`` as given (so that an error's index is the
    client's), then the one `model` names (``adapter``) at its default scale."""
    check_loras(loras, limits)
    if adapter is None:
        return list(loras)
    for i, ref in enumerate(loras):
        if ref.name == adapter:
            raise InvalidArgument(f"loras[{i}].name", f"{adapter!r} is the model already")
    if len(loras) >= limits.max_loras_per_request:
        why = " (this server serves no LoRA adapters)" if limits.max_loras_per_request == 0 else ""
        raise APIError(400, f"model {adapter!r} is a LoRA adapter: with it the request names {len(loras) + 1}; a "
                       f"request takes at most {limits.max_loras_per_request}{why}",
                       param="loras" if loras else "model", code="invalid_value")
    return [*loras, LoraRef(name=adapter)]


def admit(body: ImageRequest, settings: RestSettings, limits: Limits, *, rid: str,
          metadata: tuple[tuple[str, str], ...], references: Sequence[bytes] = (),
          events: str = "image_generation", adapter: str | None = None) -> Generation:
    """The request checked once, in one pass, or APIError: this front's own rules (model names, what it does not
    support), then the gateway's admission under the limits in force on the one request built here (an edit's
    ``references`` included, each header read once). ``adapter``: the LoRA adapter `model` names, as the route
    resolved it (adapters.model_adapter)."""
    if body.model is not None and body.model not in settings.model_names and body.model != adapter:
        raise model_not_found(body.model, settings)
    try:
        body.prompt.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates from JSON \ud800 escapes; protobuf would reject them
        raise APIError(400, "prompt is not valid Unicode", param="prompt", code="invalid_value") from None
    if body.background == "transparent":
        raise APIError(400, "transparent backgrounds are not supported", param="background",
                       code="unsupported_value")
    quality = _QUALITY_ALIASES.get(body.quality or "auto", body.quality or "auto")
    profile = settings.quality_profiles[quality]
    steps = profile.steps if body.num_inference_steps is None else body.num_inference_steps
    # A profile's level is the deployment's choice: where the denoisers cannot cache, that quality runs uncached. A
    # level the caller names is refused there (admission), as any value the servers cannot honour.
    step_cache = body.step_cache or (profile.step_cache if limits.step_cache else "off")
    partial_images = body.partial_images or 0
    with as_api_error():
        reference_sizes = check_reference_images(references, limits) if references else None
        if reference_sizes and body.size in (None, "auto"):
            width, height = auto_size(*reference_sizes[0], limits.max_pixels)
        else:
            width, height = parse_size(body.size, settings)
        request = gateway_service_pb2.GenerateImagesRequest(
            prompt=body.prompt,
            n=body.n,  # null: the admission's default
            width=width,
            height=height,
            output_format=formats.by_name(body.output_format or formats.DEFAULT.name).proto,
            num_inference_steps=steps,
            request_id=rid,
            output_compression=body.output_compression,
            guidance_scale=body.guidance_scale,
            seed=body.seed,
            reference_images=[common_pb2.ReferenceImage(data=data) for data in references],
            step_cache=common_pb2.StepCache.Value(f"STEP_CACHE_{step_cache.upper()}"),
            loras=[common_pb2.LoraRef(name=ref.name, scale=ref.scale)
                   for ref in lora_refs(body.loras or (), adapter, limits)],
            priority=PRIORITIES.get(body.priority or "", gateway_service_pb2.PRIORITY_UNSPECIFIED),
            # Streams carry their images in the completed event, as OpenAI's do.
            response_format=gateway_service_pb2.RESPONSE_FORMAT_URL if body.response_format == "url"
            and not body.stream else gateway_service_pb2.RESPONSE_FORMAT_UNSPECIFIED,
        )
        admitted = check_generate(request, limits, default_height=height, default_width=width,
                                  reference_sizes=reference_sizes)
        check_partial_images(partial_images, limits)
    return Generation(admitted, quality=quality, stream=bool(body.stream), partial_images=partial_images,
                      metadata=metadata, rid=rid, events=events, webhook_url=body.webhook_url or "")


def image_json(img: gateway_service_pb2.GeneratedImage) -> dict[str, Any]:
    """One image as OpenAI's `data[i]`: a link when the gateway stored it (response_format url, a job's images),
    else its bytes."""
    out: dict[str, Any] = {"url": img.url} if img.url else {"b64_json": base64.b64encode(img.image).decode("ascii")}
    if img.step_cache_note:  # a step_cache level asked for and nothing cached: the caller is told why
        out["step_cache_note"] = img.step_cache_note
    return out


def images_json(resp: gateway_service_pb2.GenerateImagesResponse, gen: Generation,
                settings: RestSettings) -> dict[str, Any]:
    """A GenerateImagesResponse as the OpenAI ImagesResponse JSON."""
    return {
        "created": int(time.time()),
        "data": [image_json(img) for img in resp.images],
        **gen.echo(gen.size(resp.width, resp.height), formats.name_of(resp.output_format, gen.output_format)),
        "usage": usage_json(resp.usage, len(resp.images), settings.enable_cache_report),
    }
