"""OpenAI-shaped errors and the gRPC -> HTTP status mapping."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import grpc
from fastapi.responses import JSONResponse

from services.runtime.server import OWN_ERROR_KEY, field_violation

log = logging.getLogger("glmimage.rest")

# grpc-gateway's table, plus the OpenAI error `type` a client would expect for each.
GRPC_TO_HTTP: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error"),
    grpc.StatusCode.ABORTED: (409, "server_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "request_cancelled"),
    grpc.StatusCode.INTERNAL: (500, "server_error"),
    grpc.StatusCode.UNKNOWN: (500, "server_error"),
    grpc.StatusCode.DATA_LOSS: (500, "server_error"),
    grpc.StatusCode.UNIMPLEMENTED: (501, "server_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}

# The openai SDK honours Retry-After on 429; one second is the gateway's usual backoff.
DEFAULT_RETRY_AFTER_S = 1


class APIError(Exception):
    """Raised by routes; rendered as `{"error": {...}}` with the given HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def response(self) -> JSONResponse:
        return error_response(
            self.status, self.message, type=self.type, param=self.param, code=self.code, headers=self.headers
        )


def error_response(
    status: int,
    message: str,
    *,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    # Messages may quote client input; lone surrogates would break the UTF-8 encoder.
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    body = {"error": {"message": message, "type": type, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=dict(headers or {}))


# Codes gRPC never produces on its own for a call: their text was written by a server of this suite.
_ALWAYS_OWN = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                         grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ALREADY_EXISTS,
                         grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED})
# In the client's terms, for a status whose text may be gRPC's own (it names addresses and library errors).
_OWN_WORDS = {
    grpc.StatusCode.UNAVAILABLE: "the image service is unavailable; retry later",
    grpc.StatusCode.DEADLINE_EXCEEDED: "the request did not finish in time",
    grpc.StatusCode.CANCELLED: "the request was cancelled",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "the image service is overloaded; retry later",
    grpc.StatusCode.UNIMPLEMENTED: "the gateway does not support this call",
}


def client_text(err: grpc.aio.AioRpcError) -> str:
    """What the client may read of a gateway status: the text our servers composed, else our own words."""
    code = err.code()
    ours = code in _ALWAYS_OWN or any(k == OWN_ERROR_KEY for k, _ in err.trailing_metadata() or ())
    if ours and err.details():
        return err.details()
    return _OWN_WORDS.get(code, "internal error in the image service")


# A gateway request field (from an INVALID_ARGUMENT's google.rpc.BadRequest) -> the REST parameter a client sent.
# height and width come from `size`; `sampling.*` (no REST parameter of its own) is named as is.
_REST_PARAM = {"height": "size", "width": "size", "prompt": "prompt", "n": "n", "seed": "seed",
               "num_inference_steps": "num_inference_steps", "guidance_scale": "guidance_scale",
               "output_format": "output_format", "output_compression": "output_compression",
               "partial_images": "partial_images"}


def rest_param(err: grpc.aio.AioRpcError) -> str | None:
    """OpenAI's `param` for a refused request: the field of the status' BadRequest violation, in REST terms."""
    if err.code() is not grpc.StatusCode.INVALID_ARGUMENT or (violation := field_violation(err)) is None:
        return None
    return param_of(violation[0])


def param_of(field: str) -> str | None:
    """A GenerateImagesRequest field in REST terms."""
    return field if field.startswith("sampling.") else _REST_PARAM.get(field)


def from_rpc_error(err: grpc.aio.AioRpcError, request_id: str = "") -> APIError:
    code = err.code()
    status, err_type = GRPC_TO_HTTP.get(code, (500, "server_error"))
    headers: dict[str, str] = {}
    if status == 429:
        headers["Retry-After"] = _retry_after(err)
    message = client_text(err)
    if message != err.details():  # the original goes to the log, with the request id, never to the client
        log.warning("%s gateway call failed: %s: %s", request_id or "-", code.name, err.details())
    return APIError(status, message, type=err_type, param=rest_param(err), code=code.name.lower(), headers=headers)


def _retry_after(err: grpc.aio.AioRpcError) -> str:
    # Let the gateway suggest a backoff through trailing metadata; fall back to the default.
    for key, value in err.trailing_metadata() or ():
        if key == "retry-after" and isinstance(value, str) and value.isdigit():
            return value
    return str(DEFAULT_RETRY_AFTER_S)


# pydantic error type -> OpenAI-style error code.
_VALIDATION_CODES = {
    "missing": "missing_required_parameter",
    "json_invalid": "invalid_json",
    "int_type": "invalid_type",
    "int_from_float": "invalid_type",
    "float_type": "invalid_type",
    "string_type": "invalid_type",
    "bool_type": "invalid_type",
    "model_attributes_type": "invalid_type",
    "model_type": "invalid_type",
    "dict_type": "invalid_type",
}


def from_validation_errors(errors: Sequence[Mapping[str, Any]]) -> APIError:
    """Turn FastAPI/pydantic validation errors into one 400 naming the first bad field."""
    if not errors:
        return APIError(400, "invalid request body", code="invalid_value")
    first = errors[0]
    err_type = str(first.get("type", ""))
    loc = tuple(first.get("loc", ()))
    if err_type == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return APIError(400, f"request body is not valid JSON: {detail}".rstrip(": "), code="invalid_json")
    # loc is ("body", field, ...); a bare ("body",) means the whole body was wrong.
    param = loc[1] if len(loc) > 1 and loc[0] == "body" and isinstance(loc[1], str) else None
    code = _VALIDATION_CODES.get(err_type, "invalid_value")
    if param is None:
        message = (
            "request body is required" if err_type == "missing" else "request body must be a JSON object"
        )
    elif err_type == "missing":
        message = f"missing required parameter: '{param}'"
    else:
        message = f"invalid value for '{param}': {first.get('msg', 'invalid value')}"
    return APIError(400, message, param=param, code=code)
