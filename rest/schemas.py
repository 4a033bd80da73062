"""Pydantic models for the OpenAI-compatible Images API.

Only shape and fixed-range checks live here; checks that depend on RestSettings (model names) are done by the
route, and the limits in force (rest/limits.py) after translation, by the gateway's own admission code.
"""

from __future__ import annotations

from typing import Any, Literal

from google.protobuf.descriptor import FieldDescriptor
from pydantic import BaseModel, ConfigDict, Field

from glmimage.v1 import gateway_service_pb2
from runtime.limits import MAX_LORA_NAME_CHARS, MAX_LORA_SCALE

Quality = Literal["low", "medium", "high", "auto", "standard", "hd"]
OutputFormat = Literal["png", "jpeg", "webp"]
StepCache = Literal["off", "balanced", "aggressive"]
# The priority classes, highest first (gateway.scheduler.types.PRIORITY_NAMES; the proto's Priority enum).
Priority = Literal["interactive", "default", "batch"]

FLOAT32_MAX = 3.4028234663852886e38
# What each protobuf scalar type can hold: a REST number outside it could not even be put in the request message.
_WIRE_RANGES: dict[int, tuple[float, float]] = {
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1), FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1), FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_FLOAT: (-FLOAT32_MAX, FLOAT32_MAX),
}
_REQUEST = gateway_service_pb2.GenerateImagesRequest.DESCRIPTOR.fields_by_name
# The proto field each numeric REST field is sent as (partial_images: on the stream request).
WIRE_FIELDS: dict[str, FieldDescriptor] = {
    **{name: _REQUEST[name] for name in ("n", "output_compression", "num_inference_steps", "guidance_scale", "seed")},
    "partial_images": gateway_service_pb2.GenerateImagesStreamRequest.DESCRIPTOR.fields_by_name["partial_images"],
}


def wire_range(name: str) -> tuple[float, float]:
    """The values the proto field behind REST field ``name`` can carry."""
    return _WIRE_RANGES[WIRE_FIELDS[name].type]


def _number(name: str, description: str, *, ge: float | None = None, le: float | None = None,
            default: int | None = None) -> Any:
    """An optional numeric field bounded by its proto field's type, and by ``ge``/``le`` where tighter: a value the
    message cannot carry is a 400 naming the field, like any other bad value, never a failure building it."""
    low, high = wire_range(name)
    return Field(default, ge=low if ge is None else max(low, ge), le=high if le is None else min(high, le),
                 description=description)


def _ignored(why: str) -> Any:
    """An OpenAI field taken and ignored on purpose (it has no meaning for GLM-Image), so that clients that send it
    keep working; `x-ignored` says so in /openapi.json."""
    return Field(None, description=f"Accepted for OpenAI compatibility and ignored: {why}",
                 json_schema_extra={"x-ignored": True})


# An adapter name's form (runtime.limits.check_lora_name, which also refuses '..'), for /openapi.json.
LORA_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"


class LoraRef(BaseModel):
    """One LoRA adapter of a request (GLM-Image extension). Only the shape is checked here; the name's form, the
    scale's range and the count are the limits model's (runtime.limits.check_loras), so that a bad one is
    named as `loras[i].name` or `loras[i].scale`."""

    # Strict in an edit's form too: that field is JSON, so its types are JSON's. NaN and infinity get through to
    # check_loras, which names the scale.
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=True)

    name: str = Field(
        description="An adapter the pool serves: the `GET /v1/models` cards whose `parent` is the served model. "
        "Letters, digits, '.', '_' and '-', starting with a letter or digit, no '..'.",
        json_schema_extra={"maxLength": MAX_LORA_NAME_CHARS, "pattern": LORA_NAME_PATTERN},
    )
    scale: float | None = Field(
        None,
        description=f"Multiplies the adapter's update, {-MAX_LORA_SCALE:g} to {MAX_LORA_SCALE:g}: 1 as trained, 0 "
        "switches it off, negative inverts it. Unset: the adapter's default.",
        json_schema_extra={"minimum": -MAX_LORA_SCALE, "maximum": MAX_LORA_SCALE},
    )


LORAS_DESCRIPTION = (
    "Extension: LoRA adapters the denoiser runs with, applied together, no name twice; at most the limit in force "
    "(0: this server serves none). `model` may name one adapter too: it then runs at its default scale, with these."
)


class ImageRequest(BaseModel):
    """What a generation and an edit share. Unknown fields are refused (400 `unknown_parameter`, as OpenAI does):
    a typo such as `sead` would otherwise give an image nobody asked for."""

    # strict: "2" is not an int and true is not 1, as in the OpenAI API.
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    # The bounds that depend on the servers' limits (prompt length, n, steps, guidance, partial images, pixels) are
    # the ones in force, from the gateway's GetLimits: rest/limits.py checks them and adds them to
    # /openapi.json. Only fixed ranges are stated here, and every number's proto type (_number).
    prompt: str = Field(description="Text description of the desired image(s). Must not be empty.")
    model: str | None = Field(
        None, description="Served model name or one of its aliases (e.g. `gpt-image-1`). Defaults to it. Or, as in "
        "vLLM, a LoRA adapter's name (a `GET /v1/models` card with a `parent`): the served model with that adapter at "
        "its default scale."
    )
    n: int | None = _number("n", "Number of images to generate (1 to 10 by default).", ge=1, default=1)
    size: str | None = Field(
        None,
        description="`WIDTHxHEIGHT` in pixels, or `auto` for the server default. "
        "The services round each side to a multiple of 32.",
    )
    quality: Quality | None = Field(
        None,
        description="Maps to a number of denoising steps and a step-cache level (configurable: the REST front's "
        "--quality flag). `auto` uses the denoiser default; `standard` and `hd` are accepted as aliases of "
        "`medium` and `high`.",
    )
    response_format: Literal["b64_json", "url"] | None = Field(
        None, description="`b64_json` (default): the images in the answer. `url`: each image stored and answered as "
        "`data[i].url`, a signed link that expires (1 h by default); a stream answers `b64_json` whatever this says. "
        "A job's images (`Prefer: respond-async`) always come by URL."
    )
    output_format: OutputFormat | None = Field(
        None, description="Image encoding: png (default), jpeg or webp."
    )
    output_compression: int | None = _number(
        "output_compression", "0-100, as in OpenAI: 100 is the least compressed. JPEG/WebP quality; for "
        "lossless PNG the zlib level (0 -> 9, 100 -> 0). Unset: quality 90, or the server's PNG level.", le=100)
    background: Literal["auto", "opaque", "transparent"] | None = Field(
        None, description="`auto` or `opaque`; transparent backgrounds are not supported."
    )
    user: str | None = Field(None, description="End-user identifier; only logged.")
    safety_identifier: str | None = _ignored("OpenAI's end-user identifier for abuse detection.")
    stream: bool | None = Field(
        None,
        description="`true`: answer with server-sent events, `image_generation.partial_image` events then one "
        "`image_generation.completed` event per image (with that image's usage), instead of one JSON body.",
    )
    partial_images: int | None = _number(
        "partial_images", "With `stream`: previews per image, 0 to 3. Ignored without `stream`.")
    # GLM-Image extensions.
    seed: int | None = _number("seed", "Extension: base seed; image i uses seed + i.")
    num_inference_steps: int | None = _number(
        "num_inference_steps", "Extension: denoising steps; overrides `quality`. 0 means the denoiser's default "
        "step count (what `quality: auto` gives), whatever `quality` says.")
    guidance_scale: float | None = _number(
        "guidance_scale", "Extension: classifier-free guidance scale, from 0.", ge=0.0)
    step_cache: StepCache | None = Field(
        None,
        description="Extension: denoising steps cached (extrapolated instead of computed): `off`, `balanced` or "
        "`aggressive`; faster, further from the uncached image. Overrides `quality`, whose profile picks one "
        "otherwise (by default `low`: aggressive, `medium`: balanced, `high` and `auto`: off).",
    )
    loras: list[LoraRef] | None = Field(None, description=LORAS_DESCRIPTION)
    priority: Priority | None = Field(
        None,
        description="Extension: the request's class, `interactive` > `default` > `batch`: within its tenant, work "
        "waits in class order, then arrival; `batch` runs only on capacity nothing else waits for. At most the "
        "tenant's `max_priority` (a higher one is a 400 on `priority`). Unset: `default`.",
    )
    webhook_url: str | None = Field(
        None, max_length=2048,
        description="Extension, with `Prefer: respond-async` only: an https URL the job object is POSTed to when the "
        "job ends, signed by the Standard Webhooks scheme with the tenant's secret (GET /v1/webhooks/secret). Only "
        "hosts the gateway's --webhook-allow patterns admit.",
    )


class ImageGenerationRequest(ImageRequest):
    """Body of `POST /v1/images/generations` (OpenAI Images API plus GLM-Image extensions)."""

    style: Literal["vivid", "natural"] | None = _ignored("a DALL-E 3 style.")
    moderation: Literal["low", "auto"] | None = _ignored("this server runs no content moderation.")


class ImageEditRequest(ImageRequest):
    """Body of `POST /v1/images/edits`: multipart/form-data, every field but `image` a text field (read as JSON
    would give it: `n=2`, `stream=true`). `mask` is refused (GLM-Image has no inpainting mask), and so is an
    `image` that is text, not a file: image URLs are never fetched."""

    model_config = ConfigDict(strict=False, extra="forbid", allow_inf_nan=False)

    image: list[bytes] = Field(
        min_length=1,
        description="The reference image files (PNG, JPEG or WebP), 1 to 16 by default: as `image`, or repeated as "
        "`image[]` (what the openai SDK sends for a list).",
    )
    size: str | None = Field(
        None,
        description="`WIDTHxHEIGHT` in pixels, or `auto` (the default): the first image's aspect ratio, at its own "
        "pixel count (scaled down to the pixel limit), each side rounded to a multiple of 32.",
    )
    stream: bool | None = Field(
        None,
        description="`true`: answer with server-sent events, `image_edit.partial_image` events then one "
        "`image_edit.completed` event per image (with that image's usage), instead of one JSON body.",
    )
    input_fidelity: Literal["high", "low"] | None = _ignored("the model always follows the references as it can.")
    loras: list[LoraRef] | None = Field(
        None, description=LORAS_DESCRIPTION + ' In the form, one field holding the JSON array, e.g. '
        '`loras=[{"name": "watercolor", "scale": 0.8}]`.')


class ImageData(BaseModel):
    b64_json: str = Field(description="Base64-encoded image bytes.")
    step_cache_note: str | None = Field(
        None, description="Only when a cached `step_cache` level was asked for and no step could be cached (all of "
        "the job's steps fell in the level's warm-up): why, in words. The image is then the uncached one.")


class InputTokensDetails(BaseModel):
    """The input tokens split: text_tokens + image_tokens = input_tokens (image_tokens: an edit's references)."""

    text_tokens: int
    image_tokens: int


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class ImagesUsage(BaseModel):
    """Both usage families: OpenAI's (input/output tokens) and sglang's (prompt/completion)."""

    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails
    prompt_tokens: int
    completion_tokens: int
    reasoning_tokens: int
    image_count: int
    # Only present when the server enables cache reporting and something was cached.
    prompt_tokens_details: PromptTokensDetails | None = None


class ImagesResponse(BaseModel):
    created: int = Field(description="Unix timestamp (seconds).")
    data: list[ImageData]
    size: str = Field(description="`WIDTHxHEIGHT` actually generated.")
    output_format: OutputFormat
    quality: str
    background: Literal["opaque"]
    usage: ImagesUsage


class _ImageEvent(BaseModel):
    """What every image event of the stream carries."""

    b64_json: str
    created_at: int
    size: str
    quality: str
    background: Literal["opaque"]
    output_format: OutputFormat


class _PartialImageEvent(_ImageEvent):
    """A preview decoded from the current latents."""

    partial_image_index: int = Field(description="0-based, per image.")
    image_index: int = Field(description="Extension: which of the `n` images this preview belongs to.")


class _CompletedEvent(_ImageEvent):
    """One per image; the usage is that image's, so the events add up."""

    usage: ImagesUsage
    image_index: int = Field(description="Extension: which of the `n` images this is.")


class ImageGenPartialImageEvent(_PartialImageEvent):
    """SSE `image_generation.partial_image`: a preview decoded from the current latents."""

    type: Literal["image_generation.partial_image"]


class ImageGenCompletedEvent(_CompletedEvent):
    """SSE `image_generation.completed`: one per image; the usage is that image's, so the events add up."""

    type: Literal["image_generation.completed"]


class ImageEditPartialImageEvent(_PartialImageEvent):
    """SSE `image_edit.partial_image`: a preview decoded from the current latents."""

    type: Literal["image_edit.partial_image"]


class ImageEditCompletedEvent(_CompletedEvent):
    """SSE `image_edit.completed`: one per image (only these carry usage: that image's, so the events add up)."""

    type: Literal["image_edit.completed"]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    # vLLM's fields, set on a LoRA adapter's card: the adapter itself, and the served model it runs on.
    root: str | None = Field(None, description="A LoRA adapter's own name; null for the served model and aliases.")
    parent: str | None = Field(None, description="A LoRA adapter's base: the served model; null otherwise.")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
