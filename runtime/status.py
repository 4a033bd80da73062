"""The one status-code map every hop reads: domain ErrorKind <-> gRPC status code <-> HTTP status and OpenAI error.

The hops: a server raising a domain error answers its code (composed by runtime.details); the gateway
reads a worker's code back as a scheduler ErrorKind (gateway.downstream); the REST front answers a gateway's code as
an HTTP status with an OpenAI error ``type`` and ``code`` (rest.errors). Torch-free, like the rest of
runtime.
"""
from __future__ import annotations

from dataclasses import dataclass

import grpc

from runtime.errors import ErrorKind


@dataclass(frozen=True)
class StatusRow:
    code: grpc.StatusCode
    http: int  # grpc-gateway's table
    openai_type: str  # the OpenAI error `type` a client expects with that HTTP status
    kind: ErrorKind | None = None  # the domain error a server answers with this code
    # The server refused the client's input: a worker's refusal is the client's error (INVALID_ARGUMENT), and
    # the worker's text, which our validation wrote, names the field to fix.
    refusal: bool = False
    # gRPC itself never answers this code for a call: its text was written by a server of this suite.
    own_text: bool = False
    # How the gateway tells a client that a worker failed with this code, after "the denoiser" / "the AR server".
    worker_text: str = "failed"
    # What the REST front says when the text may be gRPC's own (which names addresses and library errors).
    rest_text: str = "internal error in the image service"

    @property
    def openai_code(self) -> str:
        """OpenAI's error `code`: the gRPC code's name, in lower case."""
        return self.code.name.lower()


_CREDENTIAL = "refused the gateway's credential (its internal token)"  # a deployment problem, not the client's
_Code = grpc.StatusCode
ROWS = (
    StatusRow(_Code.INVALID_ARGUMENT, 400, "invalid_request_error", ErrorKind.INVALID_ARGUMENT, refusal=True,
              own_text=True),
    StatusRow(_Code.FAILED_PRECONDITION, 400, "invalid_request_error", refusal=True, own_text=True),
    StatusRow(_Code.OUT_OF_RANGE, 400, "invalid_request_error", refusal=True, own_text=True),
    StatusRow(_Code.UNAUTHENTICATED, 401, "authentication_error", own_text=True, worker_text=_CREDENTIAL),
    StatusRow(_Code.PERMISSION_DENIED, 403, "permission_error", own_text=True, worker_text=_CREDENTIAL),
    StatusRow(_Code.NOT_FOUND, 404, "not_found_error", own_text=True),
    StatusRow(_Code.ALREADY_EXISTS, 409, "invalid_request_error", own_text=True),
    StatusRow(_Code.ABORTED, 409, "server_error"),
    StatusRow(_Code.RESOURCE_EXHAUSTED, 429, "rate_limit_error", ErrorKind.RESOURCE_EXHAUSTED,
              worker_text="was overloaded", rest_text="the image service is overloaded; retry later"),
    StatusRow(_Code.CANCELLED, 499, "request_cancelled", ErrorKind.CANCELLED, worker_text="cancelled the call",
              rest_text="the request was cancelled"),
    StatusRow(_Code.INTERNAL, 500, "server_error", ErrorKind.INTERNAL),
    StatusRow(_Code.UNKNOWN, 500, "server_error"),
    StatusRow(_Code.DATA_LOSS, 500, "server_error"),
    StatusRow(_Code.UNIMPLEMENTED, 501, "server_error", rest_text="the gateway does not support this call"),
    StatusRow(_Code.UNAVAILABLE, 503, "server_error", ErrorKind.UNAVAILABLE, worker_text="was unreachable",
              rest_text="the image service is unavailable; retry later"),
    StatusRow(_Code.DEADLINE_EXCEEDED, 504, "timeout_error", ErrorKind.DEADLINE_EXCEEDED,
              worker_text="did not answer in time", rest_text="the request did not finish in time"),
)
_BY_CODE = {row.code: row for row in ROWS}
_BY_KIND = {row.kind: row for row in ROWS if row.kind is not None}


def row_of(code: grpc.StatusCode) -> StatusRow:
    """The row of a gRPC status code; a code no row names (OK, or one a later grpcio adds) is a server error."""
    row = _BY_CODE.get(code)
    return row if row is not None else StatusRow(code, 500, "server_error")


def code_of(kind: ErrorKind) -> grpc.StatusCode:
    """The gRPC status code a server answers a domain error of ``kind`` with."""
    return _BY_KIND[kind].code


def kind_of(code: grpc.StatusCode, default: ErrorKind) -> ErrorKind:
    """A worker's failure as the error its client gets: a refusal of the input is the client's (INVALID_ARGUMENT);
    anything else is the worker's own, told as ``default``, the stage's kind of failure."""
    return ErrorKind.INVALID_ARGUMENT if row_of(code).refusal else default
