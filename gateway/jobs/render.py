"""A job as its JSON object (`"object": "image.job"`): what GET /v1/images/jobs/{id} answers and what a webhook
carries. Pure (no FastAPI, no I/O), so the gateway renders its webhook bodies with the same function."""
from __future__ import annotations

from typing import Any

import grpc

from glmimage.v1 import common_pb2, gateway_service_pb2, job_service_pb2
from glmimage.wire import formats
from runtime.status import row_of

STATUS_NAMES = {
    job_service_pb2.JOB_STATUS_QUEUED: "queued",
    job_service_pb2.JOB_STATUS_IN_PROGRESS: "in_progress",
    job_service_pb2.JOB_STATUS_COMPLETED: "completed",
    job_service_pb2.JOB_STATUS_FAILED: "failed",
    job_service_pb2.JOB_STATUS_CANCELLED: "cancelled",
}
STATUS_VALUES = {v: k for k, v in STATUS_NAMES.items()}
JOB_OBJECT = "image.job"

# A GenerateImagesRequest field -> the REST parameter a client sent (the error mapping's; see rest.errors).
_REST_PARAM = {"height": "size", "width": "size", "prompt": "prompt", "n": "n", "seed": "seed",
               "num_inference_steps": "num_inference_steps", "guidance_scale": "guidance_scale",
               "output_format": "output_format", "output_compression": "output_compression",
               "partial_images": "partial_images", "step_cache": "step_cache", "priority": "priority",
               "webhook_url": "webhook_url", "idempotency_key": "Idempotency-Key",
               # ListJobs' fields: GET /v1/images/jobs's query parameters
               "limit": "limit", "after": "after", "status": "status"}


def param_of(field: str) -> str | None:
    """A GenerateImagesRequest field in REST terms."""
    if field == "reference_images" or field.startswith("reference_images["):
        return "image"
    if field == "loras" or field.startswith("loras["):  # named as the body's `loras` names it (loras[0].scale)
        return field
    return field if field.startswith("sampling.") else _REST_PARAM.get(field)


def absolute(url: str, base: str) -> str:
    """A link the gateway made relative (it was given no --public-url) made absolute against this front."""
    return base.rstrip("/") + url if url.startswith("/") and base else url


def usage_json(u: common_pb2.Usage, image_count: int, cache_report: bool = False) -> dict[str, Any]:
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
    if cache_report and u.cached_tokens > 0:
        usage["prompt_tokens_details"] = {"cached_tokens": u.cached_tokens}
    return usage


def error_json(code: str, message: str, field: str = "") -> dict[str, Any]:
    """A job's failure as OpenAI's error object, with the type and code the synchronous call would have had."""
    try:
        status = grpc.StatusCode[code]
    except KeyError:
        status = grpc.StatusCode.INTERNAL
    row = row_of(status)
    return {"message": message, "type": row.openai_type,
            "param": param_of(field) if status is grpc.StatusCode.INVALID_ARGUMENT and field else None,
            "code": row.openai_code}


def result_json(resp: gateway_service_pb2.GenerateImagesResponse, created: int, base: str = "",
                cache_report: bool = False) -> dict[str, Any]:
    """A job's images as the ImagesResponse a synchronous response_format=url call answers."""
    data: list[dict[str, Any]] = []
    for img in resp.images:
        item: dict[str, Any] = {"url": absolute(img.url, base)}
        if img.url_expires_at:
            item["expires_at"] = img.url_expires_at
        data.append(item)
    return {
        "created": created,
        "data": data,
        "size": f"{resp.width}x{resp.height}",
        "background": "opaque",
        "output_format": formats.name_of(resp.output_format),
        "usage": usage_json(resp.usage, len(resp.images), cache_report),
    }


def job_json(job: job_service_pb2.Job, base: str = "", cache_report: bool = False) -> dict[str, Any]:
    completed = job.status == job_service_pb2.JOB_STATUS_COMPLETED
    return {
        "id": job.id,
        "object": JOB_OBJECT,
        "status": STATUS_NAMES.get(job.status, "queued"),
        "created_at": job.created_at,
        "started_at": job.started_at or None,
        "finished_at": job.finished_at or None,
        "expires_at": job.expires_at or None,
        "progress": {"queue_position": job.progress.queue_position, "step": job.progress.step,
                     "total_steps": job.progress.total_steps},
        "result": result_json(job.result, job.finished_at, base, cache_report) if completed else None,
        "error": error_json(job.error.code, job.error.message, job.error.field)
        if job.status == job_service_pb2.JOB_STATUS_FAILED else None,
        "webhook_url": job.webhook_url or None,
        "attempts": job.attempts,
        "request_id": job.request_id,
        "kind": "edit" if job.edit else "generation",
        "n": job.n,
    }
