"""Tests of the pure scheduler core (gateway/scheduler/core.py).

Example-based tests pin every event in every relevant state; the hypothesis state machine that drives the scheduler
with random event sequences is in tests/test_scheduler_machine.py.
No I/O, no sleeps: time is a float carried by the events.
"""

from __future__ import annotations

import pytest

from gateway.scheduler.core import Scheduler
from gateway.scheduler.types import (
    Action,
    ArBatchFailed,
    ArBatchSucceeded,
    CancelArBatch,
    CancelDenoise,
    CompleteRequest,
    DenoiseFailed,
    DenoiseRefusedBusy,
    DenoiserOccupancy,
    DenoiseSucceeded,
    DispatchArBatch,
    DispatchDenoise,
    FailRequest,
    JobId,
    RequestArrived,
    RequestCancelled,
    RequestError,
    SchedulerConfig,
    Tick,
    WorkerAdded,
    WorkerDown,
    WorkerHealthy,
    WorkerNotServing,
    WorkerRemoved,
    WorkerRole,
    WorkerSnapshot,
    WorkerState,
    WorkerUnhealthy,
)
from services.runtime.errors import ErrorKind
from tests.support.scheduler_model import AR, DN, OTHER, SIZE

# ----------------------------------------------------------------------------------------------------- helpers


def make(**kw: object) -> Scheduler:
    return Scheduler(SchedulerConfig(**kw))  # type: ignore[arg-type]


def up(s: Scheduler, name: str, role: WorkerRole, now: float = 0.0) -> list[Action]:
    """Add a worker and mark it healthy; return the actions of the health event."""
    assert s.handle(WorkerAdded(now, name, role)) == []
    return s.handle(WorkerHealthy(now, name))


def arrive(
    s: Scheduler,
    rid: str,
    n: int = 1,
    now: float = 0.0,
    size: tuple[int, int] = SIZE,
    deadline: float | None = None,
) -> list[Action]:
    return s.handle(RequestArrived(now, rid, n, size[0], size[1], deadline))


def only(actions: list[Action], cls: type) -> list:
    return [a for a in actions if isinstance(a, cls)]


def ar_outputs(rid: str, n: int) -> list[object]:
    return [f"{rid}/ar{i}" for i in range(n)]


def ar_ok(s: Scheduler, batch: DispatchArBatch, ns: dict[str, int], now: float = 0.0) -> list[Action]:
    return s.handle(
        ArBatchSucceeded(now, batch.batch_id, {rid: ar_outputs(rid, ns[rid]) for rid in batch.request_ids})
    )


def to_denoise(s: Scheduler, rid: str, n: int = 1, now: float = 0.0) -> list[Action]:
    """Admit a request, take it through the AR stage; return the actions of the AR result.

    Needs ar_batch_delay=0 (or a full batch) and a free AR worker."""
    (batch,) = only(arrive(s, rid, n, now), DispatchArBatch)
    assert batch.request_ids == (rid,)
    return ar_ok(s, batch, {rid: n}, now)


def worker(s: Scheduler, name: str) -> WorkerSnapshot | None:
    for w in s.snapshot().workers:
        if w.address == name:
            return w
    return None


def job(rid: str, index: int = 0, attempt: int = 1) -> JobId:
    return JobId(rid, index, attempt)


def ready(**kw: object) -> Scheduler:
    """One AR worker and denoisers d0..d3, no batching delay."""
    cfg: dict[str, object] = {"ar_batch_delay": 0.0}
    cfg.update(kw)
    s = make(**cfg)
    up(s, "ar0", AR)
    for i in range(4):
        up(s, f"d{i}", DN)
    return s


# ------------------------------------------------------------------------------------------------- config/API


def test_config_validation() -> None:
    for bad in (
        {"max_queued_outputs": 0},
        {"ar_batch_max_outputs": 0},
        {"ar_batch_delay": -1.0},
        {"ar_max_inflight_batches": 0},
        {"ar_retries": -1},
        {"max_attempts": 0},
    ):
        with pytest.raises(ValueError):
            SchedulerConfig(**bad)  # type: ignore[arg-type]


def test_unknown_event_type_is_a_programming_error() -> None:
    with pytest.raises(TypeError):
        Scheduler().handle(object())  # type: ignore[arg-type]


def test_empty_scheduler() -> None:
    s = Scheduler()
    assert s.next_wakeup() is None
    assert s.handle(Tick(1.0)) == []
    snap = s.snapshot()
    assert (snap.pending_ar_requests, snap.pending_ar_outputs, snap.pending_denoise_outputs) == (0, 0, 0)
    assert snap.active_requests == 0 and snap.workers == ()
    assert s.fenced_results == 0


# -------------------------------------------------------------------------------------------------- admission


def test_admission_bound_counts_output_slots() -> None:
    s = make(max_queued_outputs=4)  # no AR worker: everything stays queued
    assert arrive(s, "a", 3) == []
    (rej,) = arrive(s, "b", 2)
    assert isinstance(rej, FailRequest) and rej.request_id == "b"
    assert rej.error.kind is ErrorKind.RESOURCE_EXHAUSTED
    # The client reads what it can do, in its own terms; the server flag is for the gateway's log.
    message = rej.error.message
    assert "retry later" in message and "--" not in message and "max-queued" not in message
    assert rej.error.operator_note == "3 queued outputs + n=2 > --max-queued-outputs=4"
    assert arrive(s, "c", 1) == []  # exactly at the bound is fine
    assert s.snapshot().pending_ar_outputs == 4
    assert s.counters.admitted == 2 and s.counters.rejected == 1
    assert s.snapshot().active_requests == 2


def test_in_flight_ar_work_does_not_count_toward_the_bound() -> None:
    s = make(max_queued_outputs=4, ar_batch_max_outputs=4)
    up(s, "ar0", AR)
    assert only(arrive(s, "a", 4), DispatchArBatch)  # full batch leaves at once
    assert s.snapshot().pending_ar_outputs == 0
    assert arrive(s, "b", 4) == []


def test_cancelled_request_frees_its_admission_slots() -> None:
    s = make(max_queued_outputs=2)
    arrive(s, "a", 2)
    assert only(arrive(s, "b", 1), FailRequest)[0].error.kind is ErrorKind.RESOURCE_EXHAUSTED
    s.handle(RequestCancelled(0.0, "a"))
    assert arrive(s, "b2", 2) == []


@pytest.mark.parametrize(("n", "h", "w"), [(0, 256, 256), (-1, 256, 256), (1, 0, 256), (1, 256, -32)])
def test_invalid_arguments_rejected(n: int, h: int, w: int) -> None:
    s = make()
    (rej,) = s.handle(RequestArrived(0.0, "x", n, h, w, None))
    assert rej == FailRequest("x", RequestError(ErrorKind.INVALID_ARGUMENT, rej.error.message))
    assert s.counters.rejected == 1 and s.counters.admitted == 0
    assert s.snapshot().active_requests == 0


def test_n_that_can_never_fit_the_queue_is_invalid_not_exhausted() -> None:
    s = make(max_queued_outputs=4)
    (rej,) = arrive(s, "x", 5)
    assert rej.error.kind is ErrorKind.INVALID_ARGUMENT
    assert "at most 4" in rej.error.message and "--" not in rej.error.message
    assert rej.error.operator_note == "--max-queued-outputs=4"


def test_duplicate_active_id_rejected_and_original_unaffected() -> None:
    s = ready()
    to_denoise(s, "a", 1)
    (rej,) = arrive(s, "a", 1)
    assert rej.error.kind is ErrorKind.INVALID_ARGUMENT and rej.request_id == "a"
    assert s.snapshot().active_requests == 1
    done = s.handle(DenoiseSucceeded(1.0, job("a"), "d0", "img"))
    assert done == [CompleteRequest("a", ("img",), ("a/ar0",))]
    # Once it has ended, the id may be used again.
    assert only(arrive(s, "a", 1, now=2.0), DispatchArBatch)


def test_admitted_without_ar_workers_and_dispatched_when_one_comes() -> None:
    s = make(ar_batch_delay=0.0)
    assert arrive(s, "a", 1) == []
    assert s.counters.admitted == 1
    assert s.next_wakeup() is None  # nothing a Tick could do: no worker
    assert s.handle(WorkerAdded(1.0, "ar0", AR)) == []  # unhealthy until its first health check
    assert worker(s, "ar0").state is WorkerState.UNHEALTHY
    (batch,) = s.handle(WorkerHealthy(1.0, "ar0"))
    assert batch == DispatchArBatch(1, "ar0", 256, 256, ("a",))


def test_deadline_already_passed_at_arrival() -> None:
    s = make()
    (fail,) = arrive(s, "a", 1, now=5.0, deadline=5.0)
    assert fail.error.kind is ErrorKind.DEADLINE_EXCEEDED
    assert s.counters.admitted == 1 and s.counters.failed[ErrorKind.DEADLINE_EXCEEDED] == 1
    assert s.snapshot().active_requests == 0 and s.snapshot().pending_ar_outputs == 0


# ------------------------------------------------------------------------------------------------ AR batching


def test_full_batch_dispatches_immediately() -> None:
    s = make(ar_batch_max_outputs=4, ar_batch_delay=10.0)
    up(s, "ar0", AR)
    assert arrive(s, "a", 2) == []
    (batch,) = arrive(s, "b", 2, now=0.001)
    assert batch == DispatchArBatch(1, "ar0", 256, 256, ("a", "b"))
    assert s.snapshot().pending_ar_requests == 0


def test_an_edit_runs_alone_at_once_and_nothing_joins_its_batch() -> None:
    # An edit's reference images make its prompt unlike any other's: it leaves without the batching delay, alone,
    # and the text-to-image requests around it batch among themselves.
    s = make(ar_batch_max_outputs=8, ar_batch_delay=10.0, ar_max_inflight_batches=2)
    up(s, "ar0", AR)
    assert arrive(s, "t1", 1) == []
    (edit,) = s.handle(RequestArrived(0.001, "e", 2, SIZE[0], SIZE[1], None, solo=True))
    assert edit.request_ids == ("e",)
    assert arrive(s, "t2", 1, now=0.002) == []  # still waiting for t1's window, without the edit
    (batch,) = s.handle(Tick(10.0))
    assert batch.request_ids == ("t1", "t2")


def test_delay_dispatch_via_tick_and_next_wakeup() -> None:
    s = make(ar_batch_delay=0.005)
    up(s, "ar0", AR)
    assert arrive(s, "a", 1, now=1.0) == []
    assert s.next_wakeup() == pytest.approx(1.005)
    assert s.handle(Tick(1.004)) == []
    assert arrive(s, "b", 1, now=1.0045) == []  # joins the same batch, wake-up keyed on the oldest
    assert s.next_wakeup() == pytest.approx(1.005)
    (batch,) = s.handle(Tick(s.next_wakeup()))
    assert batch.request_ids == ("a", "b")
    assert s.next_wakeup() is None


def test_next_wakeup_does_not_spin_when_no_ar_worker_has_room() -> None:
    s = make(ar_batch_delay=0.005)
    up(s, "ar0", AR)
    arrive(s, "a", 1, now=0.0)
    (b1,) = s.handle(Tick(0.01))
    arrive(s, "b", 1, now=0.02)
    s.handle(Tick(0.1))  # b's delay expired, but the only AR worker is busy
    assert s.next_wakeup() is None
    # The worker freeing up is the event that dispatches b.
    (b2,) = only(ar_ok(s, b1, {"a": 1}, now=0.2), DispatchArBatch)
    assert b2.request_ids == ("b",)


def test_next_wakeup_reports_earliest_deadline() -> None:
    s = make(ar_batch_delay=100.0)
    up(s, "ar0", AR)
    arrive(s, "a", 1, now=0.0, deadline=3.0)
    arrive(s, "b", 1, now=0.0, deadline=2.0, size=OTHER)
    assert s.next_wakeup() == 2.0
    s.handle(RequestCancelled(0.5, "b"))
    assert s.next_wakeup() == 3.0


def test_packing_skips_what_does_not_fit_and_keeps_scanning() -> None:
    s = make(ar_batch_max_outputs=4, ar_batch_delay=0.0)
    arrive(s, "a", 3)
    arrive(s, "b", 2)
    arrive(s, "c", 1)
    (b1,) = up(s, "ar0", AR, now=1.0)
    assert b1.request_ids == ("a", "c")  # b does not fit beside a; c does
    assert s.snapshot().pending_ar_outputs == 2
    (b2,) = only(ar_ok(s, b1, {"a": 3, "c": 1}, now=1.1), DispatchArBatch)
    assert b2.request_ids == ("b",)


def test_oversized_request_goes_alone() -> None:
    s = make(ar_batch_max_outputs=4, ar_batch_delay=10.0)
    up(s, "ar0", AR)
    (b1,) = arrive(s, "big", 6)  # over capacity => "full" => leaves at once, alone
    assert b1.request_ids == ("big",)


def test_oversized_request_behind_others_waits_its_turn_then_goes_alone() -> None:
    s = make(ar_batch_max_outputs=4, ar_batch_delay=0.0)
    arrive(s, "a", 1)
    arrive(s, "big", 6)
    arrive(s, "c", 2)
    (b1,) = up(s, "ar0", AR, now=1.0)
    assert b1.request_ids == ("a", "c")
    (b2,) = only(ar_ok(s, b1, {"a": 1, "c": 2}, now=1.1), DispatchArBatch)
    assert b2.request_ids == ("big",)


def test_starvation_oldest_resolution_first_even_if_other_is_fuller() -> None:
    s = make(ar_batch_max_outputs=2, ar_batch_delay=0.0)
    arrive(s, "old", 1, now=0.0, size=OTHER)
    arrive(s, "x", 1, now=1.0)
    arrive(s, "y", 1, now=2.0)  # the 256 group is full, the 512 one is older
    (b1,) = up(s, "ar0", AR, now=3.0)
    assert (b1.height, b1.request_ids) == (512, ("old",))
    (b2,) = only(ar_ok(s, b1, {"old": 1}, now=3.1), DispatchArBatch)
    assert (b2.height, b2.request_ids) == (256, ("x", "y"))


def test_just_in_time_batch_grows_while_workers_are_busy() -> None:
    s = make(ar_batch_max_outputs=8, ar_batch_delay=0.0)
    up(s, "ar0", AR)
    (b1,) = arrive(s, "a", 1)
    for i in range(3):  # all expire while ar0 is busy; none forms a batch early
        assert arrive(s, f"q{i}", 1, now=0.1 * (i + 1)) == []
    (b2,) = only(ar_ok(s, b1, {"a": 1}, now=1.0), DispatchArBatch)
    assert b2.request_ids == ("q0", "q1", "q2")


def test_multiple_ar_workers_each_with_its_own_inflight_limit() -> None:
    s = make(ar_batch_max_outputs=1, ar_batch_delay=0.0, ar_max_inflight_batches=2)
    for i in range(5):
        arrive(s, f"r{i}", 1, now=float(i))
    up(s, "ar0", AR, now=10.0)  # takes two batches on its own
    s.handle(WorkerAdded(10.0, "ar1", AR))
    batches = only(s.handle(WorkerHealthy(10.0, "ar1")), DispatchArBatch)
    assert [b.worker for b in batches] == ["ar1", "ar1"]
    assert [b.request_ids for b in batches] == [("r2",), ("r3",)]
    assert worker(s, "ar0").inflight == 2 and worker(s, "ar0").state is WorkerState.BUSY
    assert s.snapshot().pending_ar_requests == 1
    (b5,) = only(s.handle(ArBatchSucceeded(11.0, batches[0].batch_id, {"r2": ["x"]})), DispatchArBatch)
    assert (b5.worker, b5.request_ids) == ("ar1", ("r4",))


def test_ar_worker_choice_fewest_inflight_then_least_recently_used() -> None:
    s = make(ar_batch_max_outputs=1, ar_batch_delay=0.0, ar_max_inflight_batches=2)
    up(s, "ar0", AR)
    up(s, "ar1", AR)
    got = [only(arrive(s, f"r{i}", 1, now=float(i)), DispatchArBatch)[0].worker for i in range(4)]
    assert got == ["ar0", "ar1", "ar0", "ar1"]


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


# ------------------------------------------------------------------------------------------- denoise fan-out


def test_fan_out_of_n4_to_four_workers_at_once() -> None:
    s = ready()
    acts = to_denoise(s, "a", 4)
    assert acts == [DispatchDenoise(job("a", i), f"d{i}", f"a/ar{i}") for i in range(4)]
    assert all(w.state is WorkerState.BUSY for w in s.snapshot().workers if w.role is DN)


def test_fan_out_with_fewer_workers_continues_as_workers_free() -> None:
    s = make(ar_batch_delay=0.0)
    up(s, "ar0", AR)
    up(s, "d0", DN)
    up(s, "d1", DN)
    acts = to_denoise(s, "a", 4)
    assert [d.job.index for d in acts] == [0, 1]
    assert s.snapshot().pending_denoise_outputs == 2
    (d,) = s.handle(DenoiseSucceeded(1.0, job("a", 1), "d1", "r1"))
    assert d == DispatchDenoise(job("a", 2), "d1", "a/ar2")


# ------------------------------------------------------------------------------- several gateways, one pool


def test_a_busy_refusal_goes_to_another_free_denoiser_at_once_and_is_no_attempt() -> None:
    s = ready(max_attempts=1)  # one try only: a collision must not use it up
    (first,) = to_denoise(s, "a")
    assert first == DispatchDenoise(job("a"), "d0", "a/ar0")
    acts = s.handle(DenoiseRefusedBusy(1.0, job("a"), "d0", sequence=10))
    assert acts == [DispatchDenoise(job("a", attempt=2), "d1", "a/ar0")]  # same event, no backoff
    d0 = worker(s, "d0")
    assert d0 is not None and d0.state is WorkerState.BUSY and d0.held_elsewhere and d0.current_job is None
    assert s.counters.collisions == 1 and s.counters.requeues["denoise_failed"] == 0
    (done,) = s.handle(DenoiseSucceeded(2.0, job("a", attempt=2), "d1", "img"))
    assert isinstance(done, CompleteRequest) and done.results == ("img",)


def test_a_denoiser_held_by_another_gateway_gets_nothing_until_its_stream_says_free() -> None:
    s = make(ar_batch_delay=0.0)
    up(s, "ar0", AR)
    up(s, "d0", DN)
    assert s.handle(DenoiserOccupancy(0.0, "d0", elsewhere=True, sequence=5)) == []
    assert to_denoise(s, "a") == []  # queued, not sent to a denoiser that would refuse it
    assert s.handle(DenoiserOccupancy(0.1, "d0", elsewhere=True, sequence=4)) == []  # older: ignored
    assert s.handle(DenoiserOccupancy(0.2, "d0", elsewhere=False, sequence=3)) == []  # older free: ignored too
    assert s.handle(DenoiserOccupancy(0.3, "d0", elsewhere=False, sequence=6)) == [
        DispatchDenoise(job("a"), "d0", "a/ar0")]


def test_a_refusal_older_than_a_free_state_already_seen_does_not_mark_the_denoiser_busy() -> None:
    s = make(ar_batch_delay=0.0, max_attempts=1)
    up(s, "ar0", AR)
    up(s, "d0", DN)
    s.handle(DenoiserOccupancy(0.0, "d0", elsewhere=True, sequence=7))
    s.handle(DenoiserOccupancy(0.0, "d0", elsewhere=False, sequence=8))
    (first,) = to_denoise(s, "a")
    # The other gateway's job (state 7) was still there when the denoiser refused; its end (8) came first here.
    assert s.handle(DenoiseRefusedBusy(0.1, first.job, "d0", sequence=7)) == [
        DispatchDenoise(job("a", attempt=2), "d0", "a/ar0")]
    assert s.counters.collisions == 1


def test_a_refusal_without_a_sequence_holds_the_denoiser_until_any_free_state() -> None:
    s = make(ar_batch_delay=0.0)
    up(s, "ar0", AR)
    up(s, "d0", DN)
    (first,) = to_denoise(s, "a")
    assert s.handle(DenoiseRefusedBusy(0.1, first.job, "d0")) == []
    assert s.snapshot().pending_denoise_outputs == 1
    assert s.handle(DenoiserOccupancy(0.2, "d0", elsewhere=False)) == [
        DispatchDenoise(job("a", attempt=2), "d0", "a/ar0")]


def test_a_held_denoiser_that_goes_down_comes_back_free() -> None:
    s = make(ar_batch_delay=0.0)
    up(s, "ar0", AR)
    up(s, "d0", DN)
    s.handle(DenoiserOccupancy(0.0, "d0", elsewhere=True, sequence=1))
    s.handle(WorkerUnhealthy(0.1, "d0"))
    s.handle(WorkerHealthy(0.2, "d0"))
    d0 = worker(s, "d0")
    assert d0 is not None and d0.state is WorkerState.AVAILABLE and not d0.held_elsewhere


def test_a_refusal_for_a_superseded_attempt_is_fenced_and_marks_nothing() -> None:
    s = ready()
    (first,) = to_denoise(s, "a")
    s.handle(WorkerUnhealthy(0.1, "d0"))  # requeued to d1 as attempt 2
    s.handle(WorkerHealthy(0.2, "d0"))
    fenced = s.counters.fenced_results
    assert s.handle(DenoiseRefusedBusy(0.3, first.job, "d0", sequence=3)) == []
    d0 = worker(s, "d0")
    assert d0 is not None and not d0.held_elsewhere and s.counters.fenced_results == fenced + 1


def test_free_denoisers_are_taken_in_rotation() -> None:
    s = make(ar_batch_delay=0.0)
    up(s, "ar0", AR)
    for i in range(3):
        up(s, f"d{i}", DN)
    assert [d.worker for d in to_denoise(s, "a", 2)] == ["d0", "d1"]
    s.handle(DenoiseSucceeded(1.0, job("a", 0), "d0", "x"))
    s.handle(DenoiseSucceeded(1.0, job("a", 1), "d1", "y"))
    # d2 never used, then d0 (used before d1).
    assert [d.worker for d in to_denoise(s, "b", 2, now=2.0)] == ["d2", "d0"]


def test_a_denoiser_freed_by_another_gateway_waits_its_turn_in_the_rotation() -> None:
    # Taken first, it would be the one every gateway sharing the pool reaches for the moment it is free.
    s = ready()
    assert [d.worker for d in to_denoise(s, "a", 2)] == ["d0", "d1"]
    s.handle(DenoiserOccupancy(0.1, "d2", elsewhere=True))
    assert [d.worker for d in to_denoise(s, "b", 1, now=0.2)] == ["d3"]
    s.handle(DenoiseSucceeded(1.0, job("a", 0), "d0", "x"))
    s.handle(DenoiserOccupancy(1.0, "d2", elsewhere=False))
    s.handle(DenoiseSucceeded(1.0, job("a", 1), "d1", "y"))
    assert [d.worker for d in to_denoise(s, "c", 3, now=2.0)] == ["d0", "d1", "d2"]


def test_each_seed_has_its_own_pick_order_and_keeps_it() -> None:
    def picks(seed: str | None) -> list[str]:
        s = Scheduler(SchedulerConfig(ar_batch_delay=0.0), pick_seed=seed)
        up(s, "ar0", AR)
        for i in range(8):
            up(s, f"d{i}", DN)
        first = [d.worker for d in to_denoise(s, "a", 4)]
        for i, address in enumerate(first):
            s.handle(DenoiseSucceeded(1.0, job("a", i), address, "x"))
        return first + [d.worker for d in to_denoise(s, "b", 8, now=2.0)]

    assert picks(None)[:8] == [f"d{i}" for i in range(8)]  # unseeded: the order they joined in
    assert picks("gateway-1") == picks("gateway-1")
    assert picks("gateway-1")[:4] != picks("gateway-2")[:4]
    for seed in (None, "gateway-1"):  # a rotation: the four used come after the four not used yet
        order = picks(seed)
        assert set(order[4:8]) == {f"d{i}" for i in range(8)} - set(order[:4]) and order[8:] == order[:4]


def test_completion_in_index_order_regardless_of_arrival_order() -> None:
    s = ready()
    to_denoise(s, "a", 3)
    assert s.handle(DenoiseSucceeded(1.0, job("a", 2), "d2", "r2")) == []
    assert s.handle(DenoiseSucceeded(1.0, job("a", 0), "d0", "r0")) == []
    (done,) = s.handle(DenoiseSucceeded(1.0, job("a", 1), "d1", "r1"))
    assert done == CompleteRequest("a", ("r0", "r1", "r2"), ("a/ar0", "a/ar1", "a/ar2"))
    assert s.counters.completed == 1 and s.snapshot().active_requests == 0


def test_retryable_failure_requeues_at_front_with_next_attempt() -> None:
    s = make(ar_batch_delay=0.0)
    up(s, "ar0", AR)
    up(s, "d0", DN)
    to_denoise(s, "a", 1)
    to_denoise(s, "b", 1, now=0.1)  # queued behind a on the single denoiser
    (d,) = s.handle(DenoiseFailed(1.0, job("a"), "d0", "transient", True))
    assert d == DispatchDenoise(job("a", 0, 2), "d0", "a/ar0")  # front, not behind b
    assert s.counters.requeues["denoise_failed"] == 1
    # The failed attempt's late success is fenced.
    assert s.handle(DenoiseSucceeded(1.1, job("a", 0, 1), "d0", "stale")) == []
    assert worker(s, "d0").current_job == job("a", 0, 2)
    done = s.handle(DenoiseSucceeded(2.0, job("a", 0, 2), "d0", "good"))
    assert done[0] == CompleteRequest("a", ("good",), ("a/ar0",))
    assert done[1] == DispatchDenoise(job("b"), "d0", "b/ar0")


def test_requeued_outputs_go_before_older_fresh_outputs() -> None:
    s = make(ar_batch_delay=0.0, ar_max_inflight_batches=2)
    up(s, "ar0", AR)
    up(s, "d0", DN)
    (b_old,) = arrive(s, "old", 1)
    (b_new,) = arrive(s, "new", 1)
    assert only(ar_ok(s, b_new, {"new": 1}), DispatchDenoise)[0].job == job("new")  # new's AR finished first
    assert ar_ok(s, b_old, {"old": 1}) == []  # old waits: older request, fresh output
    (d,) = s.handle(DenoiseFailed(1.0, job("new"), "d0", "x", True))
    assert d.job == job("new", 0, 2)  # the requeued output goes to the front, before the older request


def test_max_attempts_exhaustion_fails_and_cancels_siblings() -> None:
    s = make(ar_batch_delay=0.0, max_attempts=2)
    up(s, "ar0", AR)
    for i in range(3):
        up(s, f"d{i}", DN)
    to_denoise(s, "a", 2)
    (d,) = s.handle(DenoiseFailed(1.0, job("a", 0), "d0", "oom", True))
    assert d == DispatchDenoise(job("a", 0, 2), "d2", "a/ar0")
    acts = s.handle(DenoiseFailed(2.0, job("a", 0, 2), "d2", "oom again", True))
    assert acts == [
        CancelDenoise(job("a", 1), "d1"),
        FailRequest("a", RequestError(ErrorKind.UNAVAILABLE, "denoise failed after 2 attempt(s): oom again")),
    ]
    # d1 keeps its slot until its RPC ends: a cancelled RPC may still be computing.
    assert worker(s, "d1").current_job == job("a", 1)
    to_denoise(s, "b", 2, now=3.0)
    assert worker(s, "d1").current_job == job("a", 1)
    assert s.handle(DenoiseFailed(4.0, job("a", 1), "d1", "cancelled", True)) == []
    assert worker(s, "d1").state is WorkerState.AVAILABLE
    assert s.fenced_results == 1


def test_max_attempts_one_means_no_retry() -> None:
    s = ready(max_attempts=1)
    to_denoise(s, "a", 1)
    (fail,) = s.handle(DenoiseFailed(1.0, job("a"), "d0", "x", True))
    assert fail.error.kind is ErrorKind.UNAVAILABLE


def test_non_retryable_failure_is_internal_and_cancels_siblings() -> None:
    s = ready()
    to_denoise(s, "a", 3)
    acts = s.handle(DenoiseFailed(1.0, job("a", 1), "d1", "bad tokens", False))
    assert only(acts, CancelDenoise) == [CancelDenoise(job("a", 0), "d0"), CancelDenoise(job("a", 2), "d2")]
    (fail,) = only(acts, FailRequest)
    assert fail == FailRequest("a", RequestError(ErrorKind.INTERNAL, "denoise failed: bad tokens"))
    assert worker(s, "d1").state is WorkerState.AVAILABLE


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


# ------------------------------------------------------------------------------------------ fail fast (503)


def test_fail_fast_refuses_admission_without_a_ready_worker_per_stage() -> None:
    s = make(fail_fast_without_workers=True)
    (rej,) = arrive(s, "a")
    assert isinstance(rej, FailRequest) and rej.error.kind is ErrorKind.UNAVAILABLE and "AR" in rej.error.message
    up(s, "ar", WorkerRole.AR)
    (rej,) = arrive(s, "b")
    assert rej.error.kind is ErrorKind.UNAVAILABLE and "denoiser" in rej.error.message
    up(s, "d", WorkerRole.DENOISER)
    assert not only(arrive(s, "c"), FailRequest)
    assert s.counters.rejected == 2 and s.counters.admitted == 1


def test_fail_fast_fails_requests_stranded_in_the_ar_queue_when_the_last_ar_goes() -> None:
    s = make(fail_fast_without_workers=True, ar_batch_delay=10.0, ar_retries=1)
    up(s, "ar", WorkerRole.AR)
    up(s, "d", WorkerRole.DENOISER)
    assert arrive(s, "a") == [] and arrive(s, "b") == []  # waiting for the batch delay
    failed = only(s.handle(WorkerUnhealthy(1.0, "ar")), FailRequest)
    assert sorted(f.request_id for f in failed) == ["a", "b"]
    assert all(f.error.kind is ErrorKind.UNAVAILABLE and "AR" in f.error.message for f in failed)
    assert s.snapshot().active_requests == 0


def test_fail_fast_fails_requests_waiting_for_a_denoiser_when_the_last_one_goes() -> None:
    s = make(fail_fast_without_workers=True, ar_batch_delay=0.0)
    up(s, "ar", WorkerRole.AR)
    up(s, "d", WorkerRole.DENOISER)
    (d,) = only(to_denoise(s, "a", 2), DispatchDenoise)  # a/0 runs, a/1 waits
    (b,) = only(arrive(s, "b", 1, now=0.5), DispatchArBatch)  # b is in the AR stage meanwhile
    acts = s.handle(WorkerNotServing(1.0, "d"))  # draining: it finishes a/0 but takes nothing new
    (fail,) = only(acts, FailRequest)
    assert fail.request_id == "a" and fail.error.kind is ErrorKind.UNAVAILABLE and "denoiser" in fail.error.message
    assert only(acts, CancelDenoise) == [CancelDenoise(d.job, "d")]  # nobody is left to want a/0
    # b reaches the denoise stage with no denoiser to take it: it fails then, not at its deadline.
    (fail_b,) = only(ar_ok(s, b, {"b": 1}, now=2.0), FailRequest)
    assert fail_b.request_id == "b" and fail_b.error.kind is ErrorKind.UNAVAILABLE
    assert s.snapshot().active_requests == 0


# ------------------------------------------------------------------ a worker that refuses the gateway's credential


def test_a_denoiser_refusing_the_credential_sends_its_job_elsewhere_without_using_an_attempt() -> None:
    s = ready(max_attempts=1)  # one try only: a refusal of the credential must not use it up
    (first,) = to_denoise(s, "a")
    assert first == DispatchDenoise(job("a"), "d0", "a/ar0")
    acts = s.handle(WorkerUnhealthy(1.0, "d0", WorkerDown.CREDENTIAL_REFUSED))
    assert acts == [CancelDenoise(job("a"), "d0"), DispatchDenoise(job("a", attempt=2), "d1", "a/ar0")]
    assert worker(s, "d0").state is WorkerState.UNHEALTHY
    # The refused call's own end is fenced; the job finishes on d1.
    assert s.handle(DenoiseFailed(1.1, job("a"), "d0", "refused", retryable=False)) == []
    (done,) = s.handle(DenoiseSucceeded(2.0, job("a", attempt=2), "d1", "img"))
    assert isinstance(done, CompleteRequest)


def test_a_job_refused_by_every_denoiser_in_turn_still_has_all_its_attempts() -> None:
    s = ready(max_attempts=2)
    to_denoise(s, "a")
    for attempt, name in enumerate(("d0", "d1", "d2"), start=1):
        (redo,) = only(s.handle(WorkerUnhealthy(float(attempt), name, WorkerDown.CREDENTIAL_REFUSED)),
                       DispatchDenoise)
        assert redo.job == job("a", attempt=attempt + 1)
    # d3 now holds attempt 4; a real failure uses the first of its two tries, the next one the second.
    (retry,) = s.handle(DenoiseFailed(5.0, job("a", attempt=4), "d3", "boom", retryable=True))
    assert retry.job == job("a", attempt=5) and retry.worker == "d3"
    (fail,) = s.handle(DenoiseFailed(6.0, job("a", attempt=5), "d3", "boom", retryable=True))
    assert isinstance(fail, FailRequest) and "after 2 attempt(s)" in fail.error.message


def test_an_ar_refusing_the_credential_sends_its_batch_to_another_ar_without_using_a_retry() -> None:
    s = make(ar_retries=0, ar_batch_delay=0.0)  # no retry budget: a charged failure would fail the request
    up(s, "ar0", AR)
    up(s, "ar1", AR)
    (b1,) = arrive(s, "a", 1)
    acts = s.handle(WorkerUnhealthy(1.0, "ar0", WorkerDown.CREDENTIAL_REFUSED))
    assert acts[0] == CancelArBatch(b1.batch_id, "ar0")
    (b2,) = only(acts, DispatchArBatch)
    assert (b2.worker, b2.request_ids) == ("ar1", ("a",)) and not only(acts, FailRequest)


def test_with_the_only_ar_refusing_the_credential_requests_fail_with_a_503_that_says_so() -> None:
    s = make(fail_fast_without_workers=True, ar_batch_delay=0.0)
    up(s, "ar0", AR)
    up(s, "d0", DN)
    arrive(s, "a", 1)
    (fail,) = only(s.handle(WorkerUnhealthy(1.0, "ar0", WorkerDown.CREDENTIAL_REFUSED)), FailRequest)
    assert fail.error.kind is ErrorKind.UNAVAILABLE
    assert fail.error.message == ("no AR server is available (it refuses the gateway's credential (its internal "
                                  "token)); retry later")
    # New requests are refused at admission with the same reason.
    (rej,) = arrive(s, "b", now=2.0)
    assert rej.error.kind is ErrorKind.UNAVAILABLE and "refuses the gateway's credential" in rej.error.message


def test_workers_refusing_the_credential_from_the_start_are_named_in_the_503() -> None:
    # They never were healthy (they refused the check when they joined): the reason still reaches the message.
    s = make(fail_fast_without_workers=True)
    up(s, "ar0", AR)
    s.handle(WorkerAdded(0.0, "d0", DN))
    assert s.handle(WorkerUnhealthy(0.0, "d0", WorkerDown.CREDENTIAL_REFUSED)) == []
    (rej,) = arrive(s, "a")
    assert rej.error.message == ("no denoiser is available (it refuses the gateway's credential (its internal token)); "
                           "retry later")
    s.handle(WorkerAdded(0.0, "d1", DN))
    s.handle(WorkerUnhealthy(0.0, "d1", WorkerDown.HUNG))
    (rej,) = arrive(s, "b")
    assert rej.error.message == ("no denoiser is available (one is not answering (hung); one refuses the gateway's "
                           "credential (its internal token)); retry later")
    assert not only(s.handle(WorkerHealthy(1.0, "d1")), FailRequest)
    assert not only(arrive(s, "c", now=1.0), FailRequest)


def test_a_hung_ar_is_reported_as_not_answering_not_as_gone() -> None:
    s = make(fail_fast_without_workers=True, ar_batch_delay=0.0, ar_retries=1)
    up(s, "ar0", AR)
    up(s, "d0", DN)
    arrive(s, "a", 1)
    (fail,) = only(s.handle(WorkerUnhealthy(1.0, "ar0", WorkerDown.HUNG)), FailRequest)
    assert fail.error.message == "no AR server is available (it is not answering (hung)); retry later"
    up(s, "ar0", AR, now=2.0)  # back, then gone for good
    arrive(s, "b", 1, now=2.0)
    (fail,) = only(s.handle(WorkerUnhealthy(3.0, "ar0")), FailRequest)
    assert fail.error.message == "no AR server is available (it went away); retry later"
    # Without retries left, the batch's own failure says the same.
    s = make(ar_batch_delay=0.0, ar_retries=0)
    up(s, "ar0", AR)
    arrive(s, "c", 1)
    (fail,) = only(s.handle(WorkerUnhealthy(1.0, "ar0", WorkerDown.HUNG)), FailRequest)
    assert fail.error.message == "AR stage failed: the AR server running it is not answering (hung)"


def test_without_fail_fast_requests_wait_for_workers() -> None:
    s = make()
    assert arrive(s, "a") == []
    assert s.snapshot().pending_ar_requests == 1
