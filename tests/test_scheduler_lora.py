"""LoRA placement in the pure scheduler core (gateway/scheduler/placement.py): a job naming adapters
goes to a free denoiser holding them, waits for a busy holder only while that is cheaper than a load (and never
longer than one), and neither plain jobs nor other adapters' jobs wait behind it. The state machine test
(tests/test_scheduler_machine.py) checks the same bounds on random event streams; these pin each rule on its own.
"""

from __future__ import annotations

from gateway.scheduler.types import (
    ArBatchSucceeded,
    DenoiserOccupancy,
    DenoiseSucceeded,
    DispatchArBatch,
    DispatchDenoise,
    RequestArrived,
    Tick,
    WorkerUnhealthy,
)
from tests.support.scheduler_events import job, make, only, up, worker
from tests.support.scheduler_model import AR, DN, SIZE

A = frozenset({"style-a"})
B = frozenset({"style-b"})


def pool(n: int = 2, **kw: object):
    s = make(ar_batch_delay=0.0, ar_batch_max_outputs=1, ar_max_inflight_batches=8, **kw)
    up(s, "ar0", AR)
    for i in range(n):
        up(s, f"d{i}", DN)
    return s


def submit(s, rid: str, loras: frozenset[str] = frozenset(), now: float = 0.0, n: int = 1) -> list[DispatchDenoise]:
    """Admit a request naming ``loras`` and take it through the AR stage: the denoise dispatches that follow."""
    (batch,) = only(s.handle(RequestArrived(now, rid, n, *SIZE, loras=loras)), DispatchArBatch)
    actions = s.handle(ArBatchSucceeded(now, batch.batch_id, {rid: [f"{rid}/ar{i}" for i in range(n)]}))
    return only(actions, DispatchDenoise)


def finish(s, d: DispatchDenoise, now: float, load: float = 0.0) -> list[DispatchDenoise]:
    return only(s.handle(DenoiseSucceeded(now, d.job, d.worker, "img", lora_load_s=load)), DispatchDenoise)


def test_the_next_job_with_the_same_adapter_goes_where_it_was_loaded() -> None:
    # The done-when on an idle two-denoiser pool: two sequential requests, one load. Without affinity the
    # rotation would send the second to the other denoiser.
    s = pool()
    (first,) = submit(s, "r1", A)
    finish(s, first, 1.0, load=0.4)
    (second,) = submit(s, "r2", A, now=1.1)
    assert second.worker == first.worker
    assert A <= worker(s, first.worker).loras


def test_without_affinity_the_rotation_places_it_elsewhere() -> None:
    s = pool(lora_affinity=False)
    (first,) = submit(s, "r1", A)
    finish(s, first, 1.0, load=0.4)
    (second,) = submit(s, "r2", A, now=1.1)
    assert second.worker != first.worker


def test_a_plain_job_keeps_off_the_holders_and_runs_with_none_active() -> None:
    s = pool(3)
    (first,) = submit(s, "r1", A)
    finish(s, first, 1.0)
    (plain,) = submit(s, "p1", now=1.1)  # goes to a denoiser holding nothing, so the holder stays free for A
    assert plain.worker != first.worker
    (again,) = submit(s, "r2", A, now=1.2)
    assert again.worker == first.worker


def test_the_occupancy_stream_says_what_a_denoiser_holds() -> None:
    s = pool()
    s.handle(DenoiserOccupancy(0.1, "d1", False, 5, loras=frozenset({"style-a", "style-c"})))
    assert worker(s, "d1").loras == {"style-a", "style-c"}
    (d,) = submit(s, "r1", A, now=0.2)
    assert d.worker == "d1"
    # It evicted it (another gateway's job loaded others): the next job's holder is unknown again.
    finish(s, d, 0.5)
    s.handle(DenoiserOccupancy(0.6, "d1", False, 7, loras=frozenset({"style-c"})))
    assert worker(s, "d1").loras == {"style-c"}
    # A stale state changes nothing.
    s.handle(DenoiserOccupancy(0.7, "d1", False, 6, loras=frozenset({"style-a"})))
    assert worker(s, "d1").loras == {"style-c"}


def test_while_its_own_job_runs_a_denoiser_counts_that_jobs_adapters_as_held() -> None:
    s = pool()
    (d,) = submit(s, "r1", A)
    # The stream's busy state (published as the job took the slot, before it loaded) says it holds none yet.
    s.handle(DenoiserOccupancy(0.01, d.worker, False, 3, loras=frozenset()))
    assert A <= worker(s, d.worker).loras


def test_a_down_denoiser_holds_nothing() -> None:
    s = pool()
    (d,) = submit(s, "r1", A)
    finish(s, d, 1.0)
    s.handle(WorkerUnhealthy(1.1, d.worker))
    assert worker(s, d.worker).loras == frozenset()


def learned(s, worker_time: float = 1.0, load: float = 3.0) -> None:
    """Teach the scheduler a job time and a load cost with one job that loaded."""
    (d,) = submit(s, "learn", A, now=0.0)
    finish(s, d, worker_time + load, load=load)


def test_it_waits_for_a_busy_holder_that_frees_up_before_a_load_would_end() -> None:
    s = pool(lora_load_cost=3.0)
    learned(s)  # a job takes 1 s, a load 3 s
    holder = worker(s, "d0") if A <= worker(s, "d0").loras else worker(s, "d1")
    t = 10.0
    (busy,) = submit(s, "r1", A, now=t)
    assert busy.worker == holder.address
    # The other denoiser is free, but the holder frees in ~1 s and a load takes 3 s: the job waits for it.
    assert submit(s, "r2", A, now=t + 0.1) == []
    assert s.next_wakeup() == t + 0.1 + 3.0  # at the latest, one load's time after it was queued
    (after,) = finish(s, busy, t + 1.0)
    assert after.worker == holder.address and after.job.request_id == "r2"


def test_it_never_waits_longer_than_a_load() -> None:
    s = pool(lora_load_cost=3.0)
    learned(s)
    t = 10.0
    (busy,) = submit(s, "r1", A, now=t)
    assert submit(s, "r2", A, now=t + 0.1) == []
    # The holder runs long (its job is stuck behind a slow step): at the bound the job loads on the free one.
    (moved,) = only(s.handle(Tick(t + 3.1)), DispatchDenoise)
    assert moved.job.request_id == "r2" and moved.worker != busy.worker


def test_it_loads_at_once_when_the_holder_is_far_from_done() -> None:
    s = pool(lora_load_cost=0.2)
    learned(s, worker_time=5.0, load=0.2)  # a job takes 5 s, a load 0.2 s: waiting never pays
    t = 10.0
    (busy,) = submit(s, "r1", A, now=t)
    (elsewhere,) = submit(s, "r2", A, now=t + 0.1)
    assert elsewhere.worker != busy.worker


def test_neither_a_plain_job_nor_another_adapters_job_waits_behind_one_that_waits() -> None:
    s = pool(3, lora_load_cost=3.0)
    learned(s)
    t = 10.0
    (busy,) = submit(s, "r1", A, now=t)
    assert submit(s, "r2", A, now=t + 0.1) == []  # waits for the holder
    (plain,) = submit(s, "p1", now=t + 0.2)  # queued behind it, placed at once
    assert plain.job.request_id == "p1"
    (other,) = submit(s, "b1", B, now=t + 0.3)  # another adapter: no holder anywhere, loads on the last free one
    assert other.job.request_id == "b1"
    assert len({busy.worker, plain.worker, other.worker}) == 3


def test_several_waiting_jobs_spread_over_the_holders_in_turn() -> None:
    # The second job behind one busy holder would wait two job times: more than a load, so it loads elsewhere.
    s = pool(3, lora_load_cost=1.5)
    learned(s, worker_time=1.0, load=1.5)
    t = 10.0
    (busy,) = submit(s, "r1", A, now=t)
    assert submit(s, "r2", A, now=t) == []  # the holder frees in ~1 s < 1.5 s
    (loads,) = submit(s, "r3", A, now=t)  # would free in ~2 s > 1.5 s
    assert loads.job.request_id == "r3" and loads.worker != busy.worker


def test_a_request_of_n_outputs_fans_out_over_holders_first() -> None:
    s = pool(4)
    s.handle(DenoiserOccupancy(0.0, "d2", False, 1, loras=A))
    s.handle(DenoiserOccupancy(0.0, "d3", False, 1, loras=A))
    ds = submit(s, "r1", A, now=0.1, n=3)
    assert [d.worker for d in ds[:2]] == ["d2", "d3"]  # both holders first, then one load
    assert len({d.worker for d in ds}) == 3


def test_the_learned_costs_move_towards_what_jobs_say() -> None:
    s = pool(lora_load_cost=2.0)
    (d,) = submit(s, "r1", A)
    finish(s, d, 3.0, load=1.0)  # 2 s of steps, 1 s of loading
    assert s._placement.job_time == 2.0 and 1.0 < s._placement.load_cost < 2.0
    assert s.counters.denoise_dispatches == 1
    assert job("r1") == d.job


def test_a_later_job_holding_its_adapters_goes_first_but_passes_a_waiting_one_for_a_load_at_most() -> None:
    # Both denoisers hold B and run B jobs; queued: H (naming A, which nobody holds), then two B jobs.
    s = pool(lora_load_cost=2.0)
    (b0,) = submit(s, "b0", B)
    (b1,) = submit(s, "b1", B, now=0.1)
    assert submit(s, "h", A, now=0.2) == [] and submit(s, "j1", B, now=0.3) == [] and submit(s, "j2", B, now=0.4) == []
    # The first to free up serves j1 without a load, ahead of h: h would have loaded A over B there.
    (first,) = finish(s, b0, 1.0)
    assert (first.job.request_id, first.worker) == ("j1", b0.worker)
    # h has been held back since then; once that is a load's time, it goes at its turn, ahead of j2's hit.
    (second,) = finish(s, b1, 1.0 + 2.0 + 0.1)
    assert (second.job.request_id, second.worker) == ("h", b1.worker)


def test_a_job_no_later_hit_can_use_loads_at_once_on_an_idle_pool() -> None:
    # Nothing to wait for and nobody to serve instead: held back for nothing would only add a load's time.
    s = pool(lora_load_cost=5.0)
    learned(s)
    (d,) = submit(s, "r1", B, now=10.0)
    assert d.job.request_id == "r1"
