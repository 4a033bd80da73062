"""The scripted gateway of tests/support/fake_gateway.py with a tenant's priorities and quotas, as the contract
describes them (gateway_service.proto; the rate-limit metadata of issue 30): a generation asking for a priority above
``max_priority`` is INVALID_ARGUMENT on priority; an admitted one carries ``rate_limits`` in its initial metadata; a
refusal scripted in ``refusals`` is RESOURCE_EXHAUSTED with a google.rpc.RetryInfo detail (when it has a
``retry_delay``), trailing ``retry-after``, ``x-glmimage-quota`` and the rate limits. It records when each call
arrived (``arrivals``), so a test can tell how long a client waited before retrying.
"""
from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
from google.protobuf import duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from glmimage.v1 import gateway_service_pb2
from tests.support.fake_gateway import FakeGateway, FakeServer, serve_fake

__all__ = ["GENERATE_METHODS", "LIMITS", "QuotaGateway", "Refusal", "serve_quota_fake", "sent_priority"]

GENERATE_METHODS = frozenset({"GenerateImages", "GenerateImagesStream"})
# What a tenant of 30 requests and 60 images a minute sees after its first request of one image.
LIMITS = (("x-ratelimit-limit-requests", "30"), ("x-ratelimit-remaining-requests", "29"),
          ("x-ratelimit-reset-requests", "59s"), ("x-ratelimit-limit-images", "60"),
          ("x-ratelimit-remaining-images", "59"), ("x-ratelimit-reset-images", "1m0s"))


def sent_priority(fake: FakeServer) -> int:
    """The Priority the last call carried."""
    req = fake.servicer.calls[-1].request
    return getattr(req, "request", req).priority  # a stream request wraps the GenerateImagesRequest


@dataclass(frozen=True)
class Refusal:
    """One quota refusal: which quota, the RetryInfo delay (None: no detail) and the ``retry-after`` header (None:
    the whole seconds of the delay, rounded up, at least 1, as the gateway sends it; "" : none)."""

    quota: str | None = "requests_per_minute"
    retry_delay: float | None = 12.0
    retry_after: str | None = None
    rate_limits: tuple[tuple[str, str], ...] = (("x-ratelimit-limit-requests", "30"),
                                                ("x-ratelimit-remaining-requests", "0"),
                                                ("x-ratelimit-reset-requests", "12s"))

    def status(self) -> grpc.Status:
        message = f"rate limit reached: {self.quota}" if self.quota else "the gateway is busy"
        proto = status_pb2.Status(code=code_pb2.RESOURCE_EXHAUSTED, message=message)
        if self.retry_delay is not None:
            seconds = int(self.retry_delay)
            delay = duration_pb2.Duration(seconds=seconds, nanos=round((self.retry_delay - seconds) * 1e9))
            proto.details.add().Pack(error_details_pb2.RetryInfo(retry_delay=delay))
        header = self.retry_after
        if header is None:
            header = str(max(1, math.ceil(self.retry_delay or 1)))
        trailing = [*self.rate_limits, *([("retry-after", header)] if header else []),
                    *([("x-glmimage-quota", self.quota)] if self.quota else [])]
        composed = rpc_status.to_status(proto)
        # abort_with_status sends the status' own trailing metadata only: ours ride along in it.
        return composed._replace(trailing_metadata=(*composed.trailing_metadata, *trailing))


@dataclass
class QuotaGateway(FakeGateway):
    # The highest class this tenant may ask for (PRIORITY_INTERACTIVE = 1 is the highest; unspecified = default).
    max_priority: int = gateway_service_pb2.PRIORITY_INTERACTIVE
    # Sent as initial metadata with every admitted generation (empty: a tenant without quotas).
    rate_limits: tuple[tuple[str, str], ...] = LIMITS
    # The next generations are refused with these, in order.
    refusals: list[Refusal] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)

    def reset(self) -> None:
        super().reset()
        with self.lock:
            self.max_priority = gateway_service_pb2.PRIORITY_INTERACTIVE
            self.rate_limits = LIMITS
            self.refusals = []
            self.arrivals = []

    def _enter(self, method: str, request, context: grpc.ServicerContext) -> None:
        super()._enter(method, request, context)
        if method not in GENERATE_METHODS:
            return
        with self.lock:
            self.arrivals.append(time.monotonic())
            refusal = self.refusals.pop(0) if self.refusals else None
        if refusal is not None:
            context.abort_with_status(refusal.status())
        asked = getattr(request, "request", request).priority or gateway_service_pb2.PRIORITY_DEFAULT
        if asked < self.max_priority:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"priority: {gateway_service_pb2.Priority.Name(asked)} is above this key's max_priority")
        if self.rate_limits:
            context.send_initial_metadata(self.rate_limits)


@contextlib.contextmanager
def serve_quota_fake() -> Iterator[FakeServer]:
    """QuotaGateway on an ephemeral loopback port (plaintext); stopped on exit."""
    with serve_fake(servicer=QuotaGateway()) as server:
        yield server
