"""Prometheus metrics of the AR server, on the default registry (served by --metrics-port)."""
from __future__ import annotations

import enum

from prometheus_client import Counter, Gauge, Histogram

from runtime.errors import ErrorKind


class Outcome(enum.StrEnum):
    OK = "ok"
    INVALID_ARGUMENT = ErrorKind.INVALID_ARGUMENT.value
    RESOURCE_EXHAUSTED = ErrorKind.RESOURCE_EXHAUSTED.value
    CANCELLED = ErrorKind.CANCELLED.value
    DEADLINE_EXCEEDED = ErrorKind.DEADLINE_EXCEEDED.value
    UNAVAILABLE = ErrorKind.UNAVAILABLE.value
    INTERNAL = ErrorKind.INTERNAL.value


REQUESTS = Counter("glmimage_ar_requests_total",
                   "Generate requests finished, by outcome (each request of a GenerateBatch call counts)", ["outcome"])
FAILURES = Counter("glmimage_ar_failures_total", "Generate requests that failed, by reason", ["reason"])
BATCH_SIZE = Histogram("glmimage_ar_batch_size", "Output rows per model batch",
                       buckets=(1, 2, 4, 8, 16, 32, 64, 128))
MERGED_CALLS = Counter("glmimage_ar_merged_calls_total",
                       "Calls (Generate or GenerateBatch) that joined a model batch another waiting call started")
# From the tiny model on a CPU (well under a second) up to real weights at 2048x2048 (minutes).
_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
QUEUE_SECONDS = Histogram("glmimage_ar_queue_seconds", "Wait for the model before a call's batch started",
                          buckets=_SECONDS)
COMPUTE_SECONDS = Histogram("glmimage_ar_compute_seconds", "Model time of one batch (encode, generate, decode)",
                            buckets=_SECONDS)
GENERATED_TOKENS = Counter("glmimage_ar_generated_tokens_total",
                           "Tokens the AR model generated (completion tokens: preview + large grid + end)")
PROMPT_TOKENS = Counter("glmimage_ar_prompt_tokens_total", "Prompt tokens processed (per output row)")
CACHED_TOKENS = Counter("glmimage_ar_cached_prompt_tokens_total",
                        "Prompt tokens served from the backend's prefix cache (0 without one)")
QUEUE_DEPTH = Gauge("glmimage_ar_queue_depth", "Calls waiting for the model")
BUSY = Gauge("glmimage_ar_busy", "1 while a batch holds the model")

# Every label value is exported from the start, so rates work before the first event of a kind.
for _outcome in Outcome:
    REQUESTS.labels(_outcome)
    if _outcome is not Outcome.OK:
        FAILURES.labels(_outcome)


def outcome_of(error: BaseException | None) -> Outcome:
    if error is None:
        return Outcome.OK
    kind = getattr(error, "kind", None)
    return Outcome(kind.value) if isinstance(kind, ErrorKind) else Outcome.INTERNAL


def record(outcome: Outcome, requests: int = 1) -> None:
    REQUESTS.labels(outcome).inc(requests)
    if outcome is not Outcome.OK:
        FAILURES.labels(outcome).inc(requests)
