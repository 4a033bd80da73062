"""The scheduler core with the AR's answers: results fenced, counted, retried, split, and AR workers lost mid-batch.
"""

from __future__ import annotations

from gateway.scheduler.types import (
    ArBatchFailed,
    ArBatchSucceeded,
    CancelArBatch,
    CompleteRequest,
    DenoiseSucceeded,
    DispatchArBatch,
    DispatchDenoise,
    FailRequest,
    RequestError,
    WorkerAdded,
    WorkerHealthy,
    WorkerNotServing,
    WorkerState,
    WorkerUnhealthy,
)
from runtime.errors import ErrorKind
from tests.support.scheduler_events import ar_ok, arrive, job, make, only, ready, up, worker
from tests.support.scheduler_model import AR, DN

# ------------------------------------------------------------------------------------------------- AR results


def test_ar_result_for_unknown_batch_is_fenced() -> None:
    s = ready()
    assert s.handle(ArBatchSucceeded(0.0, 99, {"a": [1]})) == []
    assert s.handle(ArBatchFailed(0.0, 98, "boom")) == []
    assert s.fenced_results == 2 and s.counters.fenced_results == 2


def test_duplicate_ar_result_is_fenced() -> None:
    s = ready()
    (b,) = arrive(s, "a", 1)
    assert only(ar_ok(s, b, {"a": 1}), DispatchDenoise)
    assert ar_ok(s, b, {"a": 1}) == []
    assert s.fenced_results == 1


def test_ar_result_with_wrong_output_count_fails_only_that_request() -> None:
    s = make(ar_batch_max_outputs=4, ar_batch_delay=0.0)
    arrive(s, "a", 2)
    arrive(s, "b", 1)
    (b,) = up(s, "ar0", AR)
    up(s, "d0", DN)
    acts = s.handle(ArBatchSucceeded(1.0, b.batch_id, {"a": ["only-one"], "b": ["b0"]}))
    (fail,) = only(acts, FailRequest)
    assert (fail.request_id, fail.error.kind) == ("a", ErrorKind.INTERNAL)
    (d,) = only(acts, DispatchDenoise)
    assert d == DispatchDenoise(job("b"), "d0", "b0")
    # A request missing from the outputs entirely is also INTERNAL.
    (b2,) = arrive(s, "c", 1, now=2.0)
    (fail,) = only(s.handle(ArBatchSucceeded(2.0, b2.batch_id, {})), FailRequest)
    assert (fail.request_id, fail.error.kind) == ("c", ErrorKind.INTERNAL)


def test_ar_outputs_enter_denoise_queue_in_admission_then_index_order() -> None:
    s = make(ar_batch_max_outputs=2, ar_batch_delay=0.0, ar_max_inflight_batches=2)
    up(s, "ar0", AR)
    (b1,) = arrive(s, "a", 2)
    (b2,) = arrive(s, "b", 2, now=0.1)
    assert ar_ok(s, b2, {"b": 2}, now=0.2) == []  # b's AR finished first; no denoiser yet
    assert ar_ok(s, b1, {"a": 2}, now=0.3) == []
    assert s.snapshot().pending_denoise_outputs == 4
    up(s, "d0", DN, now=1.0)
    s.handle(WorkerAdded(1.0, "d1", DN))
    s.handle(WorkerAdded(1.0, "d2", DN))
    assert [d.job for d in s.handle(WorkerHealthy(1.0, "d1"))] == [job("a", 1)]
    # d0 got a/0 when it came up; a is older than b even though its AR result came later.
    assert worker(s, "d0").current_job == job("a", 0)
    assert [d.job for d in s.handle(WorkerHealthy(1.0, "d2"))] == [job("b", 0)]


def test_ar_retry_then_fail() -> None:
    s = make(ar_retries=1, ar_batch_delay=0.0)
    up(s, "ar0", AR)
    (b1,) = arrive(s, "a", 1)
    (b2,) = s.handle(ArBatchFailed(1.0, b1.batch_id, "oom"))  # retried at once: age kept
    assert b2.request_ids == ("a",) and b2.batch_id != b1.batch_id
    assert s.counters.requeues["ar_failed"] == 1
    (fail,) = s.handle(ArBatchFailed(2.0, b2.batch_id, "oom again"))
    assert fail == FailRequest("a", RequestError(ErrorKind.UNAVAILABLE, "AR stage failed: oom again"))
    assert s.counters.failed[ErrorKind.UNAVAILABLE] == 1


def test_ar_failure_without_retries_fails_every_request_in_the_batch() -> None:
    s = make(ar_retries=0, ar_batch_max_outputs=4, ar_batch_delay=0.0)
    arrive(s, "a", 1)
    arrive(s, "b", 2)
    (b,) = up(s, "ar0", AR)
    fails = s.handle(ArBatchFailed(1.0, b.batch_id, "x"))
    assert [(f.request_id, f.error.kind) for f in fails] == [
        ("a", ErrorKind.UNAVAILABLE),
        ("b", ErrorKind.UNAVAILABLE),
    ]


def test_a_lone_request_refused_as_bad_input_fails_with_the_ars_message_and_no_retry() -> None:
    s = make(ar_retries=3, ar_batch_delay=0.0)
    up(s, "ar0", AR)
    (b,) = arrive(s, "a", 1)
    (fail,) = s.handle(ArBatchFailed(1.0, b.batch_id, "prompt: is 9000 characters", ErrorKind.INVALID_ARGUMENT))
    assert fail == FailRequest("a", RequestError(ErrorKind.INVALID_ARGUMENT, "prompt: is 9000 characters"))
    assert s.counters.requeues["ar_failed"] == 0


def test_a_shared_batch_refused_as_bad_input_is_split_so_only_the_bad_request_fails() -> None:
    s = make(ar_retries=0, ar_batch_max_outputs=8, ar_batch_delay=0.0, ar_max_inflight_batches=1)
    arrive(s, "good", 1)
    arrive(s, "bad", 2)
    arrive(s, "good2", 1)
    (b,) = up(s, "ar0", AR)
    assert b.request_ids == ("good", "bad", "good2")
    arrive(s, "later", 1, now=0.5)  # queued behind the split requests, and never batched with them
    # No retry budget, yet nobody fails: each of the three goes again alone, oldest first.
    (b1,) = s.handle(ArBatchFailed(1.0, b.batch_id, "bad input", ErrorKind.INVALID_ARGUMENT))
    assert b1.request_ids == ("good",)
    assert s.counters.requeues["ar_batch_split"] == 3
    (b2,) = ar_ok(s, b1, {"good": 1}, now=1.1)
    assert b2.request_ids == ("bad",)
    fail, b3 = s.handle(ArBatchFailed(1.2, b2.batch_id, "sampling.top_p: must be in (0, 1]",
                                      ErrorKind.INVALID_ARGUMENT))
    assert fail == FailRequest("bad", RequestError(ErrorKind.INVALID_ARGUMENT, "sampling.top_p: must be in (0, 1]"))
    assert b3.request_ids == ("good2",)
    (b4,) = ar_ok(s, b3, {"good2": 1}, now=1.3)
    assert b4.request_ids == ("later",)
    assert s.snapshot().pending_ar_requests == 0 and s.snapshot().pending_denoise_outputs == 2


def test_a_batch_the_gateway_failed_to_handle_fails_only_the_request_at_fault() -> None:
    # An unexpected exception in the driver (e.g. a field that cannot be encoded) must neither wedge the AR slot
    # nor fail the batch mates: the batch is split like one refused as bad input; the lone culprit fails INTERNAL.
    s = make(ar_retries=2, ar_batch_max_outputs=8, ar_batch_delay=0.0)
    arrive(s, "good", 1)
    arrive(s, "bad", 1)
    (b,) = up(s, "ar0", AR)
    (b1,) = s.handle(ArBatchFailed(1.0, b.batch_id, "internal error", ErrorKind.INTERNAL))
    assert b1.request_ids == ("good",) and s.counters.requeues["ar_failed"] == 0
    (b2,) = ar_ok(s, b1, {"good": 1}, now=1.1)
    assert b2.request_ids == ("bad",)
    (fail,) = s.handle(ArBatchFailed(1.2, b2.batch_id, "internal error", ErrorKind.INTERNAL))
    assert fail == FailRequest("bad", RequestError(ErrorKind.INTERNAL, "internal error"))
    assert s.snapshot().workers[0].inflight == 0


def test_admission_bounds_outputs_waiting_in_both_queues() -> None:
    s = make(max_queued_outputs=4, ar_batch_delay=0.0)
    up(s, "ar0", AR)  # no denoiser: AR results wait in the denoise queue
    (b,) = arrive(s, "a", 3)
    ar_ok(s, b, {"a": 3})
    assert s.snapshot().pending_denoise_outputs == 3
    (rej,) = only(arrive(s, "b", 2), FailRequest)
    assert rej.error.kind is ErrorKind.RESOURCE_EXHAUSTED
    assert not only(arrive(s, "c", 1), FailRequest)


def test_retried_ar_requests_go_to_the_front_keeping_their_age() -> None:
    s = make(ar_retries=1, ar_batch_max_outputs=2, ar_batch_delay=1.0)
    up(s, "ar0", AR)
    (b1,) = arrive(s, "a", 2, now=0.0)
    arrive(s, "new", 1, now=5.0)
    # The failed batch's request goes back in front of the newer one and leaves at once (it is old).
    (b2,) = s.handle(ArBatchFailed(5.1, b1.batch_id, "x"))
    assert b2.request_ids == ("a",)
    assert s.snapshot().pending_ar_requests == 1


def test_ar_worker_unhealthy_mid_batch_requeues_and_fences() -> None:
    s = make(ar_retries=1, ar_batch_delay=0.0)
    up(s, "ar0", AR)
    up(s, "ar1", AR)
    (b1,) = arrive(s, "a", 1)
    assert b1.worker == "ar0"
    acts = s.handle(WorkerUnhealthy(1.0, "ar0"))
    assert acts[0] == CancelArBatch(b1.batch_id, "ar0")
    (b2,) = only(acts, DispatchArBatch)
    assert (b2.worker, b2.request_ids) == ("ar1", ("a",))
    assert s.counters.requeues["worker_unhealthy"] == 1
    assert worker(s, "ar0").state is WorkerState.UNHEALTHY and worker(s, "ar0").inflight == 0
    # The late result of the cancelled batch is fenced and does not touch request a.
    assert s.handle(ArBatchSucceeded(2.0, b1.batch_id, {"a": ["stale"]})) == []
    assert s.fenced_results == 1
    up(s, "d0", DN)
    (d,) = ar_ok(s, b2, {"a": 1}, now=3.0)
    assert d.ar_output == "a/ar0"


def test_a_worker_saying_not_serving_finishes_its_work_but_gets_no_more() -> None:
    s = make(ar_batch_delay=0.0)  # no AR retry budget: a cancelled batch would fail its requests
    up(s, "ar0", AR)
    up(s, "d0", DN)
    (b1,) = arrive(s, "a", 1)
    assert s.handle(WorkerNotServing(1.0, "ar0")) == []  # SIGTERM: nothing is cancelled or requeued
    assert worker(s, "ar0").state is WorkerState.DRAINING and worker(s, "ar0").inflight == 1
    assert arrive(s, "b", 1, now=1.1) == []  # waits for another AR
    (d,) = ar_ok(s, b1, {"a": 1}, now=2.0)  # its batch still counts
    assert d.job == job("a") and d.worker == "d0"
    assert s.handle(WorkerNotServing(2.1, "d0")) == []
    assert worker(s, "d0").state is WorkerState.DRAINING
    (done,) = s.handle(DenoiseSucceeded(3.0, d.job, "d0", "img"))
    assert done == CompleteRequest("a", ("img",), ("a/ar0",))
    assert s.counters.requeues["worker_unhealthy"] == 0
    # It comes back (or a replacement at the same address does): work flows to it again.
    (b2,) = s.handle(WorkerHealthy(4.0, "ar0"))
    assert b2.request_ids == ("b",)


def test_ar_worker_unhealthy_without_retry_budget_fails_requests() -> None:
    s = make(ar_retries=0, ar_batch_delay=0.0)
    up(s, "ar0", AR)
    (b1,) = arrive(s, "a", 1)
    acts = s.handle(WorkerUnhealthy(1.0, "ar0"))
    assert acts[0] == CancelArBatch(b1.batch_id, "ar0")
    (fail,) = only(acts, FailRequest)
    # The client learns which stage failed, never the worker's address (that goes to the gateway's log).
    assert fail.error.kind is ErrorKind.UNAVAILABLE
    assert "AR stage failed" in fail.error.message and "ar0" not in fail.error.message
