"""The pure scheduler core (gateway/scheduler/core.py): its configuration, admission and AR batching.

Example-based tests pin every event in every relevant state; the hypothesis state machine that drives the scheduler
with random event sequences is in tests/test_scheduler_machine.py.
No I/O, no sleeps: time is a float carried by the events.
"""

from __future__ import annotations

import pytest

from gateway.scheduler.core import Scheduler
from gateway.scheduler.types import (
    ArBatchSucceeded,
    CompleteRequest,
    DenoiseSucceeded,
    DispatchArBatch,
    FailRequest,
    RequestArrived,
    RequestCancelled,
    RequestError,
    SchedulerConfig,
    Tick,
    WorkerAdded,
    WorkerHealthy,
    WorkerState,
)
from runtime.errors import ErrorKind
from tests.support.scheduler_events import ar_ok, arrive, job, make, only, ready, to_denoise, up, worker
from tests.support.scheduler_model import AR, OTHER, SIZE

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
