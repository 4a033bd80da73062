"""RPC deadlines as monotonic instants, so engines can stop on them without knowing gRPC."""
from __future__ import annotations

import time

import grpc

# No deadline shows up as None or as an enormous value, depending on the grpc version.
_NO_DEADLINE = 10 * 365 * 86400


def rpc_deadline(context: grpc.aio.ServicerContext) -> float | None:
    """The call's deadline on time.monotonic()'s clock, or None when the caller set none."""
    remaining = context.time_remaining()
    if remaining is None or remaining > _NO_DEADLINE:
        return None
    return time.monotonic() + remaining
