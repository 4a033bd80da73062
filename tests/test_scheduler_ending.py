"""How work ends early in the scheduler core: stale results fenced, requests cancelled, deadlines passed.
"""

from __future__ import annotations

from gateway.scheduler.types import (
    ArBatchFailed,
    CancelArBatch,
    CancelDenoise,
    CompleteRequest,
    DenoiseFailed,
    DenoiseSucceeded,
    DispatchDenoise,
    FailRequest,
    RequestCancelled,
    RequestError,
    Tick,
    WorkerHealthy,
    WorkerState,
    WorkerUnhealthy,
)
from runtime.errors import ErrorKind
from tests.support.scheduler_events import ar_ok, arrive, job, make, only, ready, to_denoise, up, worker
from tests.support.scheduler_model import AR, DN

# --------------------------------------------------------------------------------------------------- fencing


def test_late_result_after_unhealthy_is_fenced_and_frees_nothing() -> None:
    s = make(ar_batch_delay=0.0)
    up(s, "ar0", AR)
    up(s, "d0", DN)
    up(s, "d1", DN)
    assert [d.worker for d in to_denoise(s, "a", 1)] == ["d0"]
    acts = s.handle(WorkerUnhealthy(1.0, "d0"))
    assert acts == [CancelDenoise(job("a"), "d0"), DispatchDenoise(job("a", 0, 2), "d1", "a/ar0")]
    assert s.counters.requeues["worker_unhealthy"] == 1
    assert to_denoise(s, "b", 1, now=1.5) == []  # no free denoiser: d0 down, d1 busy
    (d,) = s.handle(WorkerHealthy(2.0, "d0"))  # healthy again: gets work at once
    assert d == DispatchDenoise(job("b"), "d0", "b/ar0")
    # The superseded attempt's late result names d0, which now holds b's job: no slot freed, nothing done.
    assert s.handle(DenoiseSucceeded(3.0, job("a"), "d0", "late")) == []
    assert s.handle(DenoiseFailed(3.0, job("a"), "d0", "late", True)) == []
    assert s.fenced_results == 2
    assert worker(s, "d0").current_job == job("b")
    assert worker(s, "d1").current_job == job("a", 0, 2)
    assert s.handle(DenoiseSucceeded(4.0, job("a", 0, 2), "d1", "good")) == [
        CompleteRequest("a", ("good",), ("a/ar0",))
    ]


def test_result_naming_the_wrong_worker_is_fenced() -> None:
    s = ready()
    to_denoise(s, "a", 2)
    assert s.handle(DenoiseSucceeded(1.0, job("a", 0), "d1", "wrong")) == []  # d1 holds a/1, not a/0
    assert s.handle(DenoiseSucceeded(1.0, job("a", 0), "nobody", "x")) == []
    assert s.handle(DenoiseSucceeded(1.0, job("a", 0), "ar0", "x")) == []
    assert s.fenced_results == 3
    assert worker(s, "d0").current_job == job("a", 0)
    assert worker(s, "d1").current_job == job("a", 1)


def test_duplicate_result_is_fenced() -> None:
    s = ready()
    to_denoise(s, "a", 2)
    s.handle(DenoiseSucceeded(1.0, job("a", 0), "d0", "r0"))
    to_denoise(s, "b", 1, now=1.5)  # lands on d2 (next in the rotation), not d0
    assert s.handle(DenoiseSucceeded(2.0, job("a", 0), "d0", "again")) == []
    assert s.fenced_results == 1
    (done,) = s.handle(DenoiseSucceeded(3.0, job("a", 1), "d1", "r1"))
    assert done.results == ("r0", "r1")


def test_reused_request_id_does_not_accept_results_of_the_previous_request() -> None:
    s = make(ar_batch_delay=0.0)
    up(s, "ar0", AR)
    up(s, "d0", DN)
    to_denoise(s, "a", 1)
    s.handle(WorkerUnhealthy(1.0, "d0"))  # a/0/1 fenced, requeued
    s.handle(RequestCancelled(1.0, "a"))
    s.handle(WorkerHealthy(2.0, "d0"))
    (d,) = to_denoise(s, "a", 1, now=2.0)  # a new request with the same id lands on d0 again
    assert d.job.attempt > 1  # attempts continue, so the old token cannot match
    assert s.handle(DenoiseSucceeded(3.0, job("a", 0, 1), "d0", "old")) == []
    assert worker(s, "d0").current_job == d.job
    assert s.handle(DenoiseSucceeded(3.0, d.job, "d0", "new"))[0].results == ("new",)


def test_reused_request_id_does_not_take_the_previous_requests_ar_batch() -> None:
    s = make(ar_batch_delay=0.0, ar_max_inflight_batches=2)
    up(s, "ar0", AR)
    up(s, "d0", DN)
    (b1,) = arrive(s, "a", 1)
    s.handle(RequestCancelled(0.5, "a"))
    (b2,) = arrive(s, "a", 2, now=1.0)
    assert ar_ok(s, b1, {"a": 1}, now=2.0) == []  # the old batch result belongs to the cancelled request
    assert s.snapshot().pending_denoise_outputs == 0
    (d0,) = ar_ok(s, b2, {"a": 2}, now=3.0)
    assert d0 == DispatchDenoise(job("a", 0), "d0", "a/ar0")


# ----------------------------------------------------------------------------------------------------- cancel


def test_cancel_while_queued_for_ar() -> None:
    s = make(ar_batch_delay=10.0)
    up(s, "ar0", AR)
    arrive(s, "a", 2)
    (fail,) = s.handle(RequestCancelled(1.0, "a", "client went away"))
    assert fail == FailRequest("a", RequestError(ErrorKind.CANCELLED, "client went away"))
    snap = s.snapshot()
    assert (snap.pending_ar_requests, snap.pending_ar_outputs, snap.active_requests) == (0, 0, 0)
    assert s.next_wakeup() is None
    assert s.counters.failed[ErrorKind.CANCELLED] == 1


def test_cancel_while_ar_in_flight_drops_it_when_the_batch_returns() -> None:
    s = make(ar_batch_max_outputs=4, ar_batch_delay=0.0)
    arrive(s, "a", 1)
    arrive(s, "b", 1)
    (b,) = up(s, "ar0", AR)
    up(s, "d0", DN)
    (fail,) = s.handle(RequestCancelled(1.0, "a"))
    assert fail.error.kind is ErrorKind.CANCELLED
    acts = ar_ok(s, b, {"a": 1, "b": 1}, now=2.0)
    assert acts == [DispatchDenoise(job("b"), "d0", "b/ar0")]


def test_cancel_while_denoising_cancels_jobs_and_waits_for_rpcs() -> None:
    s = make(ar_batch_delay=0.0)
    up(s, "ar0", AR)
    up(s, "d0", DN)
    up(s, "d1", DN)
    to_denoise(s, "a", 3)  # a/0 on d0, a/1 on d1, a/2 queued
    to_denoise(s, "b", 1)
    acts = s.handle(RequestCancelled(1.0, "a"))
    assert acts == [
        CancelDenoise(job("a", 0), "d0"),
        CancelDenoise(job("a", 1), "d1"),
        FailRequest("a", RequestError(ErrorKind.CANCELLED, "cancelled by client")),
    ]
    assert s.snapshot().pending_denoise_outputs == 1  # a/2 removed, b/0 left
    # The cancelled RPC ends: the worker that holds exactly that job is freed and takes b.
    assert s.handle(DenoiseFailed(2.0, job("a", 1), "d1", "CANCELLED", True)) == [
        DispatchDenoise(job("b"), "d1", "b/ar0")
    ]
    assert s.handle(DenoiseSucceeded(2.0, job("a", 0), "d0", "too late")) == []
    assert worker(s, "d0").state is WorkerState.AVAILABLE
    assert s.fenced_results == 2
    assert s.counters.failed[ErrorKind.CANCELLED] == 1 and s.counters.completed == 0


def test_cancel_of_unknown_or_finished_request_does_nothing() -> None:
    s = ready()
    assert s.handle(RequestCancelled(0.0, "nope")) == []
    to_denoise(s, "a", 1)
    s.handle(DenoiseSucceeded(1.0, job("a"), "d0", "x"))
    assert s.handle(RequestCancelled(2.0, "a")) == []
    assert s.counters.failed[ErrorKind.CANCELLED] == 0


# --------------------------------------------------------------------------------------------------- deadlines


def test_deadline_while_queued_for_ar_fires_on_tick() -> None:
    s = make(ar_batch_delay=100.0)
    up(s, "ar0", AR)
    arrive(s, "a", 1, now=0.0, deadline=2.0)
    assert s.next_wakeup() == 2.0
    assert s.handle(Tick(1.999)) == []
    (fail,) = s.handle(Tick(2.0))
    assert fail == FailRequest("a", RequestError(ErrorKind.DEADLINE_EXCEEDED, "deadline exceeded"))
    assert s.handle(Tick(3.0)) == []  # exactly once
    assert s.snapshot().pending_ar_outputs == 0 and s.next_wakeup() is None


def test_deadline_while_ar_in_flight() -> None:
    s = make(ar_batch_delay=0.0)
    up(s, "ar0", AR)
    up(s, "d0", DN)
    (b,) = arrive(s, "a", 1, deadline=1.0)
    fail, cancel = s.handle(Tick(1.5))
    assert fail.error.kind is ErrorKind.DEADLINE_EXCEEDED
    # Nobody waits for the batch any more: it is stopped, but holds its AR slot until the call has ended.
    assert cancel == CancelArBatch(b.batch_id, "ar0", abandoned=True)
    assert worker(s, "ar0").inflight == 1
    assert ar_ok(s, b, {"a": 1}, now=2.0) == []  # (or its failure): the late result completes nothing
    assert worker(s, "ar0").inflight == 0 and worker(s, "d0").current_job is None


def test_a_batch_is_stopped_only_once_its_last_request_has_ended() -> None:
    s = make(ar_batch_max_outputs=4, ar_batch_delay=0.0)
    arrive(s, "a", 1)
    arrive(s, "b", 1)
    (b,) = up(s, "ar0", AR)
    assert b.request_ids == ("a", "b")
    assert not only(s.handle(RequestCancelled(1.0, "a")), CancelArBatch)  # b still waits for it
    assert only(s.handle(RequestCancelled(1.1, "b")), CancelArBatch) == [CancelArBatch(b.batch_id, "ar0", True)]
    assert worker(s, "ar0").inflight == 1
    assert s.handle(ArBatchFailed(1.2, b.batch_id, "cancelled", ErrorKind.CANCELLED)) == []  # the call ended
    assert worker(s, "ar0").inflight == 0 and s.counters.requeues["ar_failed"] == 0


def test_deadline_while_denoising_cancels_jobs() -> None:
    s = make(ar_batch_delay=0.0)
    up(s, "ar0", AR)
    up(s, "d0", DN)
    (b,) = arrive(s, "a", 2, deadline=5.0)
    ar_ok(s, b, {"a": 2}, now=1.0)
    acts = s.handle(Tick(5.0))
    assert acts == [
        CancelDenoise(job("a", 0), "d0"),
        FailRequest("a", RequestError(ErrorKind.DEADLINE_EXCEEDED, "deadline exceeded")),
    ]
    assert s.snapshot().pending_denoise_outputs == 0


def test_result_arriving_at_the_deadline_does_not_complete() -> None:
    s = ready()
    (b,) = arrive(s, "a", 1, deadline=5.0)
    ar_ok(s, b, {"a": 1})
    acts = s.handle(DenoiseSucceeded(5.0, job("a"), "d0", "img"))
    assert acts == [
        CancelDenoise(job("a"), "d0"),
        FailRequest("a", RequestError(ErrorKind.DEADLINE_EXCEEDED, "deadline exceeded")),
    ]
    assert worker(s, "d0").state is WorkerState.AVAILABLE  # it held exactly that job
    assert s.counters.completed == 0


def test_time_never_goes_backwards() -> None:
    s = make(ar_batch_delay=1.0)
    up(s, "ar0", AR)
    arrive(s, "a", 1, now=10.0, deadline=12.0)
    s.handle(Tick(12.0))
    assert s.snapshot().active_requests == 0
    arrive(s, "b", 1, now=5.0, deadline=11.0)  # stale timestamp: judged at t=12
    assert s.snapshot().active_requests == 0
