"""Receiving request messages within a memory budget, and only once the caller is known.

gRPC Python reads a unary request whole, into its own buffers, a Python ``bytes`` and the decoded message, before
any handler runs: twelve callers sending 60 MB each held about 1.5 GB, whether or not they had a credential. So
every server here:

- refuses a credential on the call's metadata alone (runtime.auth), before a byte of the message is read;
- receives no message larger than its largest legitimate request (runtime.limits.max_request_bytes);
  gRPC refuses a longer one from its length prefix, without buffering it;
- lets gRPC buffer at most ``LOOKAHEAD_BYTES`` of a message nobody reads yet (no bandwidth-delay probing, which
  grows that window to whole messages), so calls waiting for their turn hold next to nothing;
- reads at most ``permits`` messages at once (``Intake``), each within ``read_seconds``. A call that finds no
  permit within ``wait_seconds`` is refused with RESOURCE_EXHAUSTED: retry later.

A permit covers the read and the decode, the two moments a message exists twice. Small messages hold it for
microseconds, so they queue behind large ones only while those arrive.
"""
from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc

# What gRPC may buffer of a stream's message before the handler asks for it (HTTP/2's own default window).
LOOKAHEAD_BYTES = 64 << 10
# Memory one message in flight can take: gRPC's buffer, the bytes handed to Python and the decoded message.
COPIES_PER_MESSAGE = 3
DEFAULT_BUDGET_BYTES = 256 << 20

# Allocations from this size up get pages of their own, returned to the system when freed (glibc's M_MMAP_THRESHOLD).
MMAP_THRESHOLD_BYTES = 1 << 20
_M_MMAP_THRESHOLD = -3

FLOW_CONTROL_OPTIONS = (("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", LOOKAHEAD_BYTES))


@dataclass(frozen=True)
class IntakePolicy:
    max_message_bytes: int
    budget_bytes: int = DEFAULT_BUDGET_BYTES
    wait_seconds: float = 10.0  # for a permit; past it RESOURCE_EXHAUSTED
    read_seconds: float = 30.0  # for a message to arrive once its read began; past it DEADLINE_EXCEEDED

    def __post_init__(self) -> None:
        if self.max_message_bytes < 1 or self.budget_bytes < 1 or self.wait_seconds <= 0 or self.read_seconds <= 0:
            raise ValueError("intake policy: every bound must be positive")

    @property
    def permits(self) -> int:
        """Messages read at once: as many of the largest as fit the budget, at least one."""
        return max(1, self.budget_bytes // (COPIES_PER_MESSAGE * self.max_message_bytes))


def trim_freed_memory() -> bool:
    """Fix glibc's mmap threshold, so the buffers of large messages go back to the system once freed: by default
    glibc raises the threshold to the size of each large block freed (up to 32 MB), after which such buffers come
    from the heap and stay with the process (12 reads of 30 MB kept 370 MB). False where there is no glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        return bool(libc is not None and libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    except (OSError, AttributeError):
        return False


class Malformed(Exception):
    """The bytes received are not a message of the method (or none came): the caller's error."""


class Intake:
    """Reads request messages for the server's handlers, a bounded number at a time."""

    def __init__(self, policy: IntakePolicy) -> None:
        self.policy = policy
        self._permits = asyncio.Semaphore(policy.permits)

    async def _receive(self, context: grpc.aio.ServicerContext, decode: Callable[[bytes], object] | None
                       ) -> object:
        """The next message, decoded (``_END`` at the end of the stream), read and decoded under a permit."""
        p = self.policy
        remaining = context.time_remaining()
        try:
            await asyncio.wait_for(self._permits.acquire(), min(p.wait_seconds, remaining or p.wait_seconds))
        except TimeoutError:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                "the server is receiving as many large requests as it can hold; retry shortly")
        try:
            try:
                data = await asyncio.wait_for(context.read(), p.read_seconds)
            except TimeoutError:
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                    f"the request message did not arrive within {p.read_seconds:g}s")
            return _END if data is grpc.aio.EOF else _decoded(data, decode)
        finally:
            self._permits.release()

    async def one(self, context: grpc.aio.ServicerContext, decode: Callable[[bytes], object] | None) -> object:
        """The call's single request message, decoded. Malformed if none came or it does not decode."""
        message = await self._receive(context, decode)
        if message is _END:
            if context.cancelled():  # the caller went away before its message arrived: not malformed input
                raise asyncio.CancelledError
            raise Malformed
        return message

    async def each(self, context: grpc.aio.ServicerContext, decode: Callable[[bytes], object] | None
                   ) -> AsyncIterator[object]:
        """A client stream's messages, decoded, each read under a permit."""
        while (message := await self._receive(context, decode)) is not _END:
            yield message


_END = object()


def _decoded(data: bytes, decode: Callable[[bytes], object] | None) -> object:
    if decode is None:
        return data
    try:
        return decode(data)
    except Exception as exc:  # noqa: BLE001 - DecodeError, or whatever a message's parser raises
        raise Malformed from exc
