"""The gateway's spans of one request (docs/operating.md#traces), beside the request span the server interceptor
makes (runtime.server): its AR queue wait, the AR batch call, each output's denoise queue wait and
denoise call. The driver calls these as it performs the scheduler's actions; the scheduler itself knows nothing of
traces. With traces off every method returns at once.

An AR batch holds several requests, each in its own trace: its call span is a child of the first request's span
and links to the others', so each trace finds the batch and the AR server's span hangs under one of them.
"""
from __future__ import annotations

import time
from collections.abc import Awaitable, Sequence

from opentelemetry import context as otel_context
from opentelemetry import trace

from gateway.scheduler import types as sch
from runtime import tracing

_TRACER = tracing.tracer("glmimage.gateway")


def _wall_ns(monotonic: float) -> int:
    """A time.monotonic() reading as the wall-clock nanoseconds spans are stamped with."""
    return time.time_ns() - int((time.monotonic() - monotonic) * 1e9)


class RequestTrace:
    """One request's spans in the gateway, under the request span current when it arrived."""

    def __init__(self, request_id: str) -> None:
        self.on = tracing.enabled()
        self.context = otel_context.get_current() if self.on else None
        self.request_id = request_id
        self._ar_queue = (_TRACER.start_span("ar queue", context=self.context,
                                             attributes={"glmimage.request_id": request_id}) if self.on else None)
        self._denoise_queued: set[int] = set()

    @property
    def span_context(self) -> trace.SpanContext:
        return trace.get_current_span(self.context).get_span_context()

    def ar_dispatched(self) -> None:
        """Its first AR batch left: the AR queue wait is over (a retry is not a new wait)."""
        if self._ar_queue is not None:
            self._ar_queue.end()
            self._ar_queue = None

    def denoise_dispatched(self, index: int, attempt: int, since: float | None) -> None:
        """Output ``index`` went to a denoiser for the first time: its wait since the AR answered (``since``, on the
        monotonic clock) as a span of its own."""
        if not self.on or since is None or index in self._denoise_queued:
            return
        self._denoise_queued.add(index)
        _TRACER.start_span("denoise queue", context=self.context, start_time=_wall_ns(since),
                           attributes={"glmimage.output_index": index, "glmimage.attempt": attempt}).end()

    def denoise_call(self, index: int, attempt: int, worker: str) -> trace.Span:
        """The span of one denoise call (a non-recording one with traces off); ends with the call."""
        if not self.on:
            return trace.INVALID_SPAN
        return _TRACER.start_span("denoise call", context=self.context, kind=trace.SpanKind.CLIENT,
                                  attributes={"glmimage.output_index": index, "glmimage.attempt": attempt,
                                              "glmimage.worker": worker, "glmimage.request_id": self.request_id})

    def close(self) -> None:
        """The request ended (maybe before its AR batch ever left)."""
        self.ar_dispatched()


def ar_call(traces: Sequence[RequestTrace], batch_id: int, worker: str) -> trace.Span:
    """The span of one AR batch call over the requests of ``traces`` (see the module's note on links)."""
    if not traces or not traces[0].on:
        return trace.INVALID_SPAN
    first, others = traces[0], traces[1:]
    return _TRACER.start_span(
        "ar call", context=first.context, kind=trace.SpanKind.CLIENT,
        links=[trace.Link(t.span_context) for t in others if t.span_context.is_valid],
        attributes={"glmimage.batch_id": batch_id, "glmimage.worker": worker,
                    "glmimage.request_ids": [t.request_id for t in traces]})


async def traced(span: trace.Span, call: Awaitable[sch.Event]) -> sch.Event:
    """Await a worker call with ``span`` current (its traceparent goes out with the call), ending the span with
    the call: an error status unless the event reports success."""
    failed: str | None = "ended without an answer"  # cancelled, or raised
    try:
        with trace.use_span(span, end_on_exit=False):
            event = await call
        if not isinstance(event, (sch.ArBatchSucceeded, sch.DenoiseSucceeded)):
            failed = f"{type(event).__name__}: {getattr(event, 'message', '')}"
        else:
            failed = None
        return event
    finally:
        if failed is not None:
            span.set_status(trace.StatusCode.ERROR, failed)
        span.end()
