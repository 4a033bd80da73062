"""`POST /v1/images/edits`: OpenAI's image edit, multipart as the openai SDK sends it.

The files become the request's reference images; everything else takes the generation's path: the same one-pass
admission (translate.admit: the references' count, bytes and headers included, each header read once, and
`size: auto` from the first one's) and the same call and answer (dispatch.answer), with `image_edit.*` events
when streaming. The body is bounded before it is read (middleware.py, limits.edit_body_bytes); nothing here
fetches a URL or decodes an image.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.datastructures import FormData, UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException

from runtime.limits import Limits

from . import adapters, dispatch, translate
from .deps import GatewayDep, Metrics, Settings, image_responses
from .errors import APIError, from_validation_errors
from .middleware import request_id
from .schemas import ImageEditRequest

log = logging.getLogger("glmimage.rest")

EDITS_PATH = "/v1/images/edits"
# A single file comes as `image`, a list as `image[]` (the openai SDK's array format); both are taken, in order.
IMAGE_FIELDS = ("image", "image[]")
# Structured fields: one form field each, holding JSON (the openai SDK would flatten a list of objects into
# `loras[][name]` fields; send `extra_body={"loras": json.dumps([...])}`).
JSON_FIELDS = frozenset({"loras"})
# An edit has about twenty text fields; a form with many more is not one (the parser stops there).
_MAX_FIELDS = 64

router = APIRouter()


async def _parse_form(request: Request, limits: Limits, max_part_bytes: int) -> FormData:
    """The multipart form; Starlette's refusals (malformed, too many parts) as OpenAI's 400."""
    try:
        # One file over the count lets a 17th image (or a mask) reach the checks that name it.
        return await request.form(max_files=limits.max_reference_images + 1, max_fields=_MAX_FIELDS,
                                  max_part_size=max_part_bytes)
    except StarletteHTTPException as exc:
        if exc.status_code != 400:  # 413 from the body bound: answered as it is
            raise
        param = "image" if "files" in str(exc.detail) else None
        raise APIError(400, f"invalid multipart body: {exc.detail}", param=param, code="invalid_value") from None


async def _read_images(form: FormData, limits: Limits) -> list[bytes]:
    """The uploaded reference files' bytes, each under the per-file bound before it is read."""
    if "mask" in form:
        raise APIError(400, "mask is not supported: GLM-Image has no inpainting mask; describe the edit in the prompt",
                       param="mask", code="unsupported_value")
    uploads = [value for name in IMAGE_FIELDS for value in form.getlist(name)]
    if not uploads:
        raise APIError(400, "missing required parameter: 'image'", param="image", code="missing_required_parameter")
    for upload in uploads:
        if not isinstance(upload, UploadFile):
            raise APIError(400, "image must be an uploaded file (PNG, JPEG or WebP); image URLs are not fetched",
                           param="image", code="invalid_type")
        if upload.size is not None and upload.size > limits.max_reference_bytes:
            raise APIError(413, f"image {upload.filename!a} is {upload.size} bytes; the limit is "
                           f"{limits.max_reference_bytes} bytes per file", param="image", code="file_too_large")
    return [await upload.read() for upload in uploads]  # type: ignore[union-attr]


def _validate(form: FormData, images: list[bytes]) -> ImageEditRequest:
    fields: dict[str, Any] = {name: value for name, value in form.items() if name not in IMAGE_FIELDS}
    for name in JSON_FIELDS.intersection(fields):
        try:
            fields[name] = json.loads(fields[name]) if isinstance(fields[name], str) else fields[name]
        except ValueError as exc:
            raise APIError(400, f"invalid value for '{name}': not JSON ({exc})", param=name,
                           code="invalid_value") from None
    try:
        return ImageEditRequest.model_validate({**fields, "image": images})
    except ValidationError as exc:  # locations as FastAPI gives them for a body
        raise from_validation_errors([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()],
                                     ImageEditRequest.model_fields) from None


@router.post(
    EDITS_PATH,
    response_class=JSONResponse,
    responses=image_responses("ImageEditPartialImageEvent", "ImageEditCompletedEvent"),
    openapi_extra={"requestBody": {"required": True, "content": {
        "multipart/form-data": {"schema": {"$ref": "#/components/schemas/ImageEditRequest"},
                                # OpenAPI's way to say a form field holds JSON.
                                "encoding": {name: {"contentType": "application/json"}
                                             for name in sorted(JSON_FIELDS)}},
    }}},
    summary="Create images from reference images and a prompt",
)
async def edit_images(request: Request, settings: Settings, metrics: Metrics, gateway: GatewayDep) -> Response:
    rid = request_id(request)
    limits: Limits = request.app.state.limits.current
    form = await _parse_form(request, limits, settings.max_body_bytes)
    try:
        images = await _read_images(form, limits)
        body = _validate(form, images)
    finally:
        await form.close()  # the spooled upload files
    adapter = await adapters.model_adapter(body.model, request, settings, rid)
    gen = translate.admit(body, settings, limits, rid=rid, metadata=dispatch.gateway_metadata(request, settings, rid),
                          references=body.image, events="image_edit", adapter=adapter)
    admitted = gen.admitted
    log.info(
        "%s edit images=%d (%d bytes) n=%d size=%dx%d steps=%d format=%s stream=%s loras=%s user=%r",
        rid, len(body.image), sum(map(len, body.image)), admitted.n, admitted.width, admitted.height,
        gen.request.num_inference_steps, gen.output_format, gen.stream,
        ",".join(ref.name for ref in gen.request.loras) or "-", body.user,
    )
    return await dispatch.answer(gen, request, settings, metrics, gateway)
