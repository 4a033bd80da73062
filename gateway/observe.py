"""What the driver tells the gateway's metrics (gateway.metrics): queue waits, call times and request outcomes.

Every method is a no-op without a GatewayMetrics, so the driver observes unconditionally. Called on the event
loop thread, as the driver's own bookkeeping is.
"""
from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from gateway.metrics import GatewayMetrics
from gateway.scheduler import types as sch
from gateway.scheduler.core import Scheduler
from glmimage.v1 import ar_service_pb2
from runtime.errors import ErrorKind


@dataclass
class Timing:
    """When one request reached each stage, for the queue-time histograms."""

    arrived: float
    ar_dispatched: bool = False
    ar_done: float | None = None
    denoise_dispatched: set[int] = field(default_factory=set)  # output indices dispatched at least once


class Observer:
    def __init__(self, metrics: GatewayMetrics | None) -> None:
        self.metrics = metrics

    def ar_dispatched(self, members: Iterable[tuple[Timing, int]]) -> None:
        """An AR batch went out holding these (request timing, outputs) members."""
        if self.metrics is None:
            return
        now, slots = time.monotonic(), 0
        for timing, n in members:
            slots += n
            if not timing.ar_dispatched:  # queue time until the first dispatch; a retry is not a new wait
                timing.ar_dispatched = True
                self.metrics.queue_seconds.labels("ar").observe(now - timing.arrived)
        self.metrics.ar_batch_size.observe(slots)

    def ar_done(self, timings: Iterable[Timing], started: float, now: float) -> None:
        for timing in timings:
            timing.ar_done = now
        if self.metrics is not None:
            self.metrics.ar_seconds.observe(now - started)

    def denoise_dispatched(self, timing: Timing | None, index: int) -> None:
        if self.metrics is None or timing is None or timing.ar_done is None or index in timing.denoise_dispatched:
            return
        timing.denoise_dispatched.add(index)
        self.metrics.queue_seconds.labels("denoise").observe(time.monotonic() - timing.ar_done)

    def tenant_waited(self, tenant: str, timing: Timing) -> None:
        """A request of ``tenant`` got its first denoise dispatch: its wait since admission."""
        if self.metrics is not None:
            self.metrics.tenant_queue_wait.labels(tenant).observe(time.monotonic() - timing.arrived)

    def denoise_done(self, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.denoise_seconds.observe(seconds)

    def completed(self, action: sch.CompleteRequest, timing: Timing | None) -> None:
        m = self.metrics
        if m is None:
            return
        m.requests.labels("ok").inc()
        m.images.inc(len(action.results))
        priors: Sequence[ar_service_pb2.PriorOutput] = [o.prior for o in action.ar_outputs]
        m.tokens.labels("prompt").inc(sum(p.usage.prompt_tokens for p in priors))
        m.tokens.labels("completion").inc(sum(p.usage.completion_tokens for p in priors))
        if timing is not None:
            m.request_seconds.observe(time.monotonic() - timing.arrived)

    def failed(self, kind: ErrorKind) -> None:
        if self.metrics is not None:
            self.metrics.requests.labels(kind.value).inc()

    def publish(self, scheduler: Scheduler, stuck: Iterable[sch.WorkerRole],
                refusing: Iterable[sch.WorkerRole] = (), incompatible: Iterable[sch.WorkerRole] = ()) -> None:
        """The scheduler's gauges and counters; ``stuck``: the role of each member there but making no progress;
        ``refusing``: of each member refusing the credential; ``incompatible``: of each member speaking no contract
        revision this gateway does (gateway.compat)."""
        if self.metrics is not None:
            self.metrics.publish(scheduler.gauges(), scheduler.counters, dict(Counter(stuck)), dict(Counter(refusing)),
                                 dict(Counter(incompatible)))
