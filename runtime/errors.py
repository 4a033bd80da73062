"""Domain errors. Engines and the scheduler raise these; only the gRPC edge maps them to status codes.

Kept free of grpc imports so engines stay transport-agnostic.
"""
from __future__ import annotations

import enum


class ErrorKind(enum.Enum):
    INVALID_ARGUMENT = "invalid_argument"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    UNAVAILABLE = "unavailable"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    CANCELLED = "cancelled"
    INTERNAL = "internal"


class ServiceError(Exception):
    """An error meant for the client: its message is shown as is, so it must not leak internals."""

    kind = ErrorKind.INTERNAL

    def __init__(self, message: str, *, field: str | None = None, reason: str | None = None,
                 info: dict[str, str] | None = None, retry_after: float | None = None,
                 metadata: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        # Machine-readable cause for the caller (a google.rpc.ErrorInfo at the gRPC edge), e.g. "DENOISER_BUSY"
        # with who holds the slot: the caller acts on it without parsing the message.
        self.reason = reason
        self.info = info or {}
        # When the caller may try again, in seconds (a google.rpc.RetryInfo at the gRPC edge, and `retry-after`):
        # a quota refusal knows when its window resets.
        self.retry_after = retry_after
        # Trailing metadata entries sent with the status (a quota refusal's x-ratelimit-* figures).
        self.metadata = metadata


class InvalidArgument(ServiceError):
    kind = ErrorKind.INVALID_ARGUMENT

    def __init__(self, field: str, message: str) -> None:
        # The field leads the message so grpcurl users can see what to fix; the gRPC edge also sends it as a
        # google.rpc.BadRequest field violation (field, description) for clients that read structured details.
        super().__init__(f"{field}: {message}", field=field)
        self.description = message


# ServiceError.reason of a denoiser that refuses a job because another one holds its slot (info: the holder's
# "owner" and the occupancy "sequence"): the gateway sends the job elsewhere at once instead of counting a failure.
DENOISER_BUSY = "DENOISER_BUSY"


class ResourceExhausted(ServiceError):
    kind = ErrorKind.RESOURCE_EXHAUSTED


class Unavailable(ServiceError):
    kind = ErrorKind.UNAVAILABLE


class Cancelled(ServiceError):
    kind = ErrorKind.CANCELLED


class DeadlineExceeded(ServiceError):
    kind = ErrorKind.DEADLINE_EXCEEDED


def error_for(kind: ErrorKind, message: str, field: str | None = None) -> ServiceError:
    """A ServiceError of the given kind whose message is shown as is (e.g. relayed from another service).

    ``field``, for INVALID_ARGUMENT, is the request field the message is about (it still leads the message)."""
    error = ServiceError(message, field=field)
    error.kind = kind
    return error
