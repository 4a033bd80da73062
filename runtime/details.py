"""The suite's gRPC status details, written by every server and read by every client hop: a domain error as a rich
status (a google.rpc.BadRequest field violation, a google.rpc.ErrorInfo reason) with our own mark, and the reading of
those back from a failed call. Servers encode with ``rich_status``; the gateway and the REST front decode with
``field_violation`` and ``error_info``, without importing the server builder."""
from __future__ import annotations

import math

import grpc
from google.protobuf import duration_pb2
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from runtime.errors import ErrorKind, ServiceError
from runtime.status import code_of

# Trailing metadata on a status this suite's own code composed (a domain error): its text is meant for the client.
# A status without it may come from gRPC itself (connection refused, a deadline seen by the client), whose text
# names addresses and library internals; the REST front shows those in its own words instead.
OWN_ERROR_KEY = "glmimage-error"
OWN_MARK = ((OWN_ERROR_KEY, "1"),)

# Trailing metadata of a refusal that says when to retry (whole seconds), beside its google.rpc.RetryInfo.
RETRY_AFTER_KEY = "retry-after"
# Which quota of its tenant refused a call (requests_per_minute, images_per_minute, max_inflight_images): trailing
# metadata of a quota refusal only (a queue-full one has none).
QUOTA_KEY = "x-glmimage-quota"
# OpenAI's rate-limit figures, in its order (the requests' limit, remaining, reset, then the images'): a quota
# tenant's call carries them in its initial metadata when admitted, in its trailing metadata when refused.
RATE_LIMIT_HEADERS = tuple(f"x-ratelimit-{figure}-{unit}" for unit in ("requests", "images")
                           for figure in ("limit", "remaining", "reset"))

# The google.rpc.ErrorInfo domain of the reasons this suite sends.
ERROR_DOMAIN = "glmimage.v1"


def rich_status(exc: ServiceError) -> grpc.Status:
    """The status for a domain error: its code and message, for INVALID_ARGUMENT with a field a google.rpc.BadRequest
    field violation in the details (the description is the message without its "field: " lead), and our mark."""
    code = code_of(exc.kind)
    status = status_pb2.Status(code=code.value[0], message=exc.message)
    if exc.kind is ErrorKind.INVALID_ARGUMENT and exc.field:
        violation = error_details_pb2.BadRequest.FieldViolation(
            field=exc.field, description=exc.message.removeprefix(f"{exc.field}: "))
        status.details.add().Pack(error_details_pb2.BadRequest(field_violations=[violation]))
    if exc.reason:
        status.details.add().Pack(error_details_pb2.ErrorInfo(reason=exc.reason, domain=ERROR_DOMAIN,
                                                              metadata=exc.info))
    extra: tuple[tuple[str, str], ...] = exc.metadata
    if exc.retry_after is not None:
        wait = max(exc.retry_after, 0.0)
        seconds = int(wait)
        status.details.add().Pack(error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(
            seconds=seconds, nanos=int((wait - seconds) * 1e9))))
        # Whole seconds, at least one: what HTTP's Retry-After (and the REST front relaying it) can say.
        extra = (*extra, (RETRY_AFTER_KEY, str(max(1, math.ceil(wait)))))
    composed = rpc_status.to_status(status)
    # abort_with_status replaces all trailing metadata with the status' own: the mark rides along in it.
    return composed._replace(trailing_metadata=(*composed.trailing_metadata, *OWN_MARK, *extra))


def _details(err: grpc.RpcError) -> list:
    try:
        status = rpc_status.from_call(err)
    except (ValueError, DecodeError):  # details that contradict the status, or are not a Status: not ours to trust
        return []
    return list(status.details) if status is not None else []


def field_violation(err: grpc.RpcError) -> tuple[str, str] | None:
    """The first google.rpc.BadRequest field violation (field, description) in a failed call's rich status."""
    for detail in _details(err):
        bad_request = error_details_pb2.BadRequest()
        if detail.Unpack(bad_request) and bad_request.field_violations:
            violation = bad_request.field_violations[0]
            return violation.field, violation.description
    return None


def error_info(err: grpc.RpcError) -> tuple[str, str, dict[str, str]] | None:
    """(reason, domain, metadata) of the first google.rpc.ErrorInfo in a failed call's rich status."""
    for detail in _details(err):
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            return info.reason, info.domain, dict(info.metadata)
    return None



def retry_delay(err: grpc.RpcError) -> float | None:
    """Seconds of the google.rpc.RetryInfo in a failed call's rich status (None: it has none)."""
    for detail in _details(err):
        info = error_details_pb2.RetryInfo()
        if detail.Unpack(info):
            return info.retry_delay.seconds + info.retry_delay.nanos / 1e9
    return None
