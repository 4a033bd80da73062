"""Workers joining, draining, leaving and flapping in the scheduler core; its snapshot and counters.
"""

from __future__ import annotations

from gateway.scheduler.types import (
    CancelArBatch,
    CancelDenoise,
    CompleteRequest,
    DenoiseFailed,
    DenoiseSucceeded,
    DispatchArBatch,
    DispatchDenoise,
    FailRequest,
    RequestCancelled,
    WorkerAdded,
    WorkerHealthy,
    WorkerRemoved,
    WorkerState,
    WorkerUnhealthy,
)
from runtime.errors import ErrorKind
from tests.support.scheduler_events import ar_ok, arrive, job, make, only, ready, to_denoise, up, worker
from tests.support.scheduler_model import AR, DN

# ------------------------------------------------------------------------------------------------ membership


def test_removing_an_idle_worker_drops_it_at_once() -> None:
    s = ready()
    assert s.handle(WorkerRemoved(0.0, "d1")) == []
    assert worker(s, "d1") is None
    assert s.handle(WorkerRemoved(0.0, "unknown")) == []


def test_removing_a_busy_denoiser_drains_it() -> None:
    s = make(ar_batch_delay=0.0)
    up(s, "ar0", AR)
    up(s, "d0", DN)
    to_denoise(s, "a", 1)
    s.handle(WorkerRemoved(1.0, "d0"))
    assert worker(s, "d0").state is WorkerState.DRAINING
    assert to_denoise(s, "b", 1, now=1.0) == []  # no new job for a draining worker
    (done,) = s.handle(DenoiseSucceeded(2.0, job("a"), "d0", "img"))  # its current job may finish
    assert done.results == ("img",)
    assert worker(s, "d0") is None
    assert s.snapshot().pending_denoise_outputs == 1
    # A result naming the vanished worker is fenced.
    assert s.handle(DenoiseSucceeded(3.0, job("a"), "d0", "img")) == []


def test_draining_denoiser_going_unhealthy_requeues_and_disappears() -> None:
    s = make(ar_batch_delay=0.0)
    up(s, "ar0", AR)
    up(s, "d0", DN)
    up(s, "d1", DN)
    to_denoise(s, "a", 1)
    to_denoise(s, "b", 1)
    s.handle(WorkerRemoved(1.0, "d0"))
    acts = s.handle(WorkerUnhealthy(2.0, "d0"))
    assert acts == [CancelDenoise(job("a"), "d0")]
    assert worker(s, "d0") is None
    assert s.snapshot().pending_denoise_outputs == 1
    (d,) = s.handle(DenoiseSucceeded(3.0, job("b"), "d1", "x"))[1:]
    assert d == DispatchDenoise(job("a", 0, 2), "d1", "a/ar0")


def test_removing_a_busy_ar_worker_drains_it() -> None:
    s = make(ar_batch_delay=0.0)
    up(s, "ar0", AR)
    (b,) = arrive(s, "a", 1)
    s.handle(WorkerRemoved(1.0, "ar0"))
    assert worker(s, "ar0").state is WorkerState.DRAINING
    assert arrive(s, "b", 1, now=1.0) == []
    up(s, "d0", DN)
    assert only(ar_ok(s, b, {"a": 1}, now=2.0), DispatchDenoise)
    assert worker(s, "ar0") is None
    up(s, "ar1", AR, now=3.0)
    assert s.snapshot().pending_ar_requests == 0


def test_draining_ar_worker_going_unhealthy_fails_its_batch_and_disappears() -> None:
    s = make(ar_retries=0, ar_batch_delay=0.0)
    up(s, "ar0", AR)
    (b,) = arrive(s, "a", 1)
    s.handle(WorkerRemoved(1.0, "ar0"))
    acts = s.handle(WorkerUnhealthy(2.0, "ar0"))
    assert acts[0] == CancelArBatch(b.batch_id, "ar0")
    assert only(acts, FailRequest)[0].error.kind is ErrorKind.UNAVAILABLE
    assert worker(s, "ar0") is None


def test_re_adding_a_draining_worker_keeps_it() -> None:
    s = ready()
    to_denoise(s, "a", 1)
    s.handle(WorkerRemoved(1.0, "d0"))
    s.handle(WorkerAdded(1.5, "d0", DN))
    assert worker(s, "d0").state is WorkerState.BUSY
    s.handle(DenoiseSucceeded(2.0, job("a"), "d0", "x"))
    assert worker(s, "d0").state is WorkerState.AVAILABLE
    # Re-adding under a different role is ignored; re-adding a live worker is idempotent.
    s.handle(WorkerAdded(2.0, "d0", AR))
    s.handle(WorkerAdded(2.0, "d0", DN))
    assert worker(s, "d0").role is DN and worker(s, "d0").state is WorkerState.AVAILABLE


def test_health_flap() -> None:
    s = make(ar_batch_delay=0.0)
    up(s, "ar0", AR)
    up(s, "d0", DN)
    assert s.handle(WorkerUnhealthy(0.0, "d0")) == []
    assert s.handle(WorkerUnhealthy(0.0, "d0")) == []  # repeated: no-op
    assert to_denoise(s, "a", 1) == []
    assert s.snapshot().pending_denoise_outputs == 1
    (d,) = s.handle(WorkerHealthy(1.0, "d0"))  # never stays unavailable once healthy
    assert d.worker == "d0"
    assert s.handle(WorkerHealthy(1.0, "d0")) == []  # repeated: no-op, keeps its job
    assert worker(s, "d0").current_job == job("a")
    assert s.handle(WorkerUnhealthy(2.0, "d0")) == [CancelDenoise(job("a"), "d0")]
    assert s.handle(WorkerHealthy(3.0, "d0")) == [DispatchDenoise(job("a", 0, 2), "d0", "a/ar0")]
    (done,) = s.handle(DenoiseSucceeded(4.0, job("a", 0, 2), "d0", "img"))
    assert done.results == ("img",)


def test_health_events_for_unknown_workers_are_ignored() -> None:
    s = make()
    assert s.handle(WorkerHealthy(0.0, "ghost")) == []
    assert s.handle(WorkerUnhealthy(0.0, "ghost")) == []
    assert s.snapshot().workers == ()


def test_single_denoiser_unhealthy_requeues_until_it_is_back() -> None:
    s = make(ar_batch_delay=0.0)
    up(s, "ar0", AR)
    up(s, "d0", DN)
    to_denoise(s, "a", 1)
    assert s.handle(WorkerUnhealthy(1.0, "d0")) == [CancelDenoise(job("a"), "d0")]
    assert s.snapshot().pending_denoise_outputs == 1
    assert s.handle(WorkerHealthy(2.0, "d0")) == [DispatchDenoise(job("a", 0, 2), "d0", "a/ar0")]


def test_unhealthy_exhausting_attempts_fails_the_request() -> None:
    s = ready(max_attempts=1)
    to_denoise(s, "a", 2)
    acts = s.handle(WorkerUnhealthy(1.0, "d0"))
    assert acts[0] == CancelDenoise(job("a", 0), "d0")
    assert CancelDenoise(job("a", 1), "d1") in acts
    (fail,) = only(acts, FailRequest)
    assert fail.error.kind is ErrorKind.UNAVAILABLE
    assert "d0" not in fail.error.message and "denoiser" in fail.error.message


def test_snapshot_reports_states_and_queues() -> None:
    s = make(ar_batch_delay=0.0, ar_max_inflight_batches=2)
    s.handle(WorkerAdded(0.0, "dX", DN))
    up(s, "ar0", AR)
    up(s, "d0", DN)
    to_denoise(s, "a", 2)
    arrive(s, "b", 1)
    snap = s.snapshot()
    assert snap.active_requests == 2 and snap.pending_denoise_outputs == 1
    states = {w.address: (w.state, w.inflight) for w in snap.workers}
    assert states == {
        "dX": (WorkerState.UNHEALTHY, 0),
        "ar0": (WorkerState.AVAILABLE, 1),
        "d0": (WorkerState.BUSY, 1),
    }


def test_snapshot_counts_requests_waiting_for_a_denoiser() -> None:
    s = ready()
    to_denoise(s, "a", 4)  # four outputs on d0..d3
    to_denoise(s, "b", 2)
    to_denoise(s, "c", 1)
    snap = s.snapshot()
    assert (snap.pending_denoise_requests, snap.pending_denoise_outputs) == (2, 3)


def test_has_worker_until_drained() -> None:
    s = ready()
    to_denoise(s, "a", 1)
    assert not s.has_worker("nope")
    s.handle(WorkerRemoved(1.0, "d0"))
    assert s.has_worker("d0")  # draining: still holds a/0
    s.handle(DenoiseSucceeded(2.0, job("a"), "d0", "x"))
    assert not s.has_worker("d0")


def test_serial_outputs_run_one_after_another() -> None:
    """The benchmark baseline: a request's outputs never run at the same time, and each starts at once."""
    s = ready(serial_outputs=True)
    (d,) = only(to_denoise(s, "a", 3), DispatchDenoise)
    assert d.job == job("a", 0)
    to_denoise(s, "b", 1)  # b/0 starts on another denoiser meanwhile
    (d1,) = only(s.handle(DenoiseSucceeded(1.0, job("a", 0), d.worker, "r0")), DispatchDenoise)
    assert d1.job == job("a", 1) and d1.ar_output == "a/ar1"
    # A failure retries the same output; the next one still waits for it.
    (d1b,) = only(s.handle(DenoiseFailed(2.0, d1.job, d1.worker, "boom", retryable=True)), DispatchDenoise)
    assert d1b.job == job("a", 1, 2)
    (d2,) = only(s.handle(DenoiseSucceeded(3.0, d1b.job, d1b.worker, "r1")), DispatchDenoise)
    assert d2.job == job("a", 2)
    (done,) = only(s.handle(DenoiseSucceeded(4.0, d2.job, d2.worker, "r2")), CompleteRequest)
    assert done.results == ("r0", "r1", "r2")


def test_serial_outputs_cancel_mid_way() -> None:
    s = ready(serial_outputs=True)
    (d,) = only(to_denoise(s, "a", 3), DispatchDenoise)
    s.handle(DenoiseSucceeded(1.0, job("a", 0), d.worker, "r0"))
    acts = s.handle(RequestCancelled(2.0, "a"))
    assert only(acts, CancelDenoise) == [CancelDenoise(job("a", 1), "d1")]
    assert only(acts, FailRequest)[0].error.kind is ErrorKind.CANCELLED
    assert s.snapshot().pending_denoise_outputs == 0


def test_counters_balance() -> None:
    s = ready(max_queued_outputs=3)
    to_denoise(s, "a", 1)
    s.handle(DenoiseSucceeded(1.0, job("a"), "d0", "x"))
    arrive(s, "bad", 0)
    assert only(arrive(s, "c", 1), DispatchArBatch)
    s.handle(RequestCancelled(2.0, "c"))
    c = s.counters
    assert (c.admitted, c.rejected, c.completed, c.failed[ErrorKind.CANCELLED]) == (2, 1, 1, 1)
    assert c.admitted == c.completed + sum(c.failed.values()) + s.snapshot().active_requests
