"""OpenAI-shaped errors, and a gateway status as one (its HTTP status and OpenAI `type` are read from
runtime.status, the map every hop shares)."""

from __future__ import annotations

import difflib
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import grpc
from fastapi.responses import JSONResponse

from gateway.jobs.render import param_of
from runtime.details import OWN_ERROR_KEY, field_violation, retry_delay
from runtime.status import row_of

from .ratelimits import quota_of, rate_limit_headers, retry_after

log = logging.getLogger("glmimage.rest")

# OpenAI's `type` and `code` of a 429 from a rate limit (a tenant's quota), unlike the queue-full one's.
RATE_LIMIT_EXCEEDED = "rate_limit_exceeded"


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

    def body(self) -> dict[str, Any]:
        # Messages may quote client input; lone surrogates would break the UTF-8 encoder.
        message = self.message.encode("utf-8", "backslashreplace").decode("utf-8")
        return {"error": {"message": message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_response(status: int, message: str, **fields: Any) -> JSONResponse:
    """An OpenAI error body: ``fields`` are APIError's (type, param, code, headers)."""
    return APIError(status, message, **fields).response()


def client_text(err: grpc.aio.AioRpcError) -> str:
    """What the client may read of a gateway status: the text our servers composed, else our own words."""
    row = row_of(err.code())
    ours = row.own_text or any(k == OWN_ERROR_KEY for k, _ in err.trailing_metadata() or ())
    if ours and err.details():
        return err.details()
    return row.rest_text


def rest_param(err: grpc.aio.AioRpcError) -> str | None:
    """OpenAI's `param` for a refused request: the field of the status' BadRequest violation, in REST terms."""
    if err.code() is not grpc.StatusCode.INVALID_ARGUMENT or (violation := field_violation(err)) is None:
        return None
    return param_of(violation[0])


def from_rpc_error(err: grpc.aio.AioRpcError, request_id: str = "") -> APIError:
    """A failed gateway call as the client's error, with the call's rate-limit figures as headers; a tenant's quota
    refusal as OpenAI's (429 `rate_limit_exceeded`, the gateway's words naming the quota, Retry-After)."""
    code = err.code()
    row = row_of(code)
    trailing = err.trailing_metadata() or ()
    headers = rate_limit_headers(err.initial_metadata(), trailing)
    if row.http == 429:
        headers["Retry-After"] = retry_after(trailing, retry_delay(err))
    quota = quota_of(trailing) if code is grpc.StatusCode.RESOURCE_EXHAUSTED else None
    if quota is not None:  # only the gateway's quota check sends this key: its text is its own
        return APIError(429, err.details() or f"the tenant's {quota} quota is used up; retry later",
                        type=RATE_LIMIT_EXCEEDED, code=RATE_LIMIT_EXCEEDED, headers=headers)
    message = client_text(err)
    if message != err.details():  # the original goes to the log, with the request id, never to the client
        log.warning("%s gateway call failed: %s: %s", request_id or "-", code.name, err.details())
    return APIError(row.http, message, type=row.openai_type, param=rest_param(err), code=row.openai_code,
                    headers=headers)


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
    "list_type": "invalid_type",
}


# An unknown field's name is client input: at most this much of it is echoed.
_MAX_NAME_CHARS = 64


def unknown_fields(errors: Sequence[Mapping[str, Any]]) -> list[str]:
    """The body's fields that no parameter has (pydantic's extra_forbidden), in the order the body gave them."""
    return [str(e["loc"][1])[:_MAX_NAME_CHARS] for e in errors
            if e.get("type") == "extra_forbidden" and len(e.get("loc", ())) == 2 and e["loc"][0] == "body"]


def from_validation_errors(errors: Sequence[Mapping[str, Any]], known: Iterable[str] = ()) -> APIError:
    """Turn FastAPI/pydantic validation errors into one 400 naming the first bad field. Unknown fields come
    first, all of them named (``known``: the parameters, for a "did you mean"): a typo is the likeliest cause of
    whatever else is wrong."""
    if not errors:
        return APIError(400, "invalid request body", code="invalid_value")
    if unknown := unknown_fields(errors):
        known = list(known)
        names = ", ".join(f"{name!a}" + "".join(f" (did you mean {close!r}?)" for close in
                                                difflib.get_close_matches(name, known, n=1)) for name in unknown)
        return APIError(400, f"unknown parameter{'s' if len(unknown) > 1 else ''}: {names}", param=unknown[0],
                        code="unknown_parameter")
    first = errors[0]
    err_type = str(first.get("type", ""))
    loc = tuple(first.get("loc", ()))
    if err_type == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return APIError(400, f"request body is not valid JSON: {detail}".rstrip(": "), code="invalid_json")
    # loc is ("body", field, ...) or ("query", name) / ("path", name); a bare ("body",) means the whole body was
    # wrong.
    param = loc[1] if len(loc) > 1 and loc[0] in ("body", "query", "path") and isinstance(loc[1], str) else None
    code = _VALIDATION_CODES.get(err_type, "invalid_value")
    if param is None:
        message = (
            "request body is required" if err_type == "missing" else "request body must be a JSON object"
        )
    elif err_type == "missing":
        message = f"missing required parameter: '{param}'"
    else:
        # Inside a structured field (loras[0].name) the message says where; the param is the field.
        where = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc[2:])
        message = f"invalid value for '{param}{where[:_MAX_NAME_CHARS]}': {first.get('msg', 'invalid value')}"
    return APIError(400, message, param=param, code=code)
