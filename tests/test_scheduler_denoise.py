"""The scheduler core's denoise stage: fan-out, a denoiser pool shared by several gateways, completion order and
retries.
"""

from __future__ import annotations

from gateway.scheduler.core import Scheduler
from gateway.scheduler.types import (
    CancelDenoise,
    CompleteRequest,
    DenoiseFailed,
    DenoiseRefusedBusy,
    DenoiserOccupancy,
    DenoiseSucceeded,
    DispatchDenoise,
    FailRequest,
    RequestError,
    SchedulerConfig,
    WorkerHealthy,
    WorkerState,
    WorkerUnhealthy,
)
from runtime.errors import ErrorKind
from tests.support.scheduler_events import ar_ok, arrive, job, make, only, ready, to_denoise, up, worker
from tests.support.scheduler_model import AR, DN

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
