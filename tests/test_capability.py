"""Capabilities per worker (issue 32): the one rule (runtime.capability.unmet) that says whether a request fits
one worker, the union the gateway admits, and the pure scheduler placing each denoise job only on a denoiser, and
each AR batch only on an AR server, that can run it, with the real rule as its ``fits``: work whose capable workers
are busy waits for one (never failing, never going to an idle one that cannot run it) while the work behind it goes
on, and plain requests use every worker. The state machine (tests/test_scheduler_machine.py) checks the placement on
random event streams too.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.scheduler.core import Scheduler
from gateway.scheduler.types import (
    ArBatchFailed,
    ArBatchSucceeded,
    DenoiseSucceeded,
    DispatchArBatch,
    DispatchDenoise,
    FailRequest,
    RequestArrived,
    SchedulerConfig,
    Tick,
    WorkerAdded,
    WorkerCapabilities,
    WorkerHealthy,
    WorkerRemoved,
)
from glmimage.v1 import common_pb2
from runtime.capability import AR, DENOISER, Capabilities, Needs, fits, refusal, unmet
from runtime.errors import ErrorKind
from runtime.limits import DENOISER_FIELDS, Limits, limits_in_force
from tests.support.scheduler_events import only, up
from tests.support.scheduler_model import AR as AR_ROLE
from tests.support.scheduler_model import DN, SIZE

STYLE = "style"
FULL = Capabilities(DENOISER, Limits(step_cache=True), frozenset({STYLE}))  # adapters, caching, the default pixels
NO_LORA = Capabilities(DENOISER, Limits(step_cache=True, max_loras_per_request=0))
NO_CACHE = Capabilities(DENOISER, Limits(step_cache=False), frozenset({STYLE}))
SMALL = Capabilities(DENOISER, Limits(step_cache=True, max_pixels=256 * 256), frozenset({STYLE}))
BALANCED = common_pb2.STEP_CACHE_BALANCED


# ---- the rule ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("needs", "caps", "field", "words"), [
    (Needs(loras=(STYLE,)), NO_LORA, "loras", "this server serves no LoRA adapters"),
    (Needs(loras=("other",)), FULL, "loras", "no adapter named 'other' is served here"),
    (Needs(step_cache=BALANCED), NO_CACHE, "step_cache", "cannot cache steps"),
    (Needs(height=512, width=512), SMALL, "height", "exceeds the limit of 65536 pixels"),
    (Needs(steps=300), FULL, "num_inference_steps", "must be between 1 and 200"),
    (Needs(guidance=31.0), FULL, "guidance_scale", "must be between 0 and 30"),
    (Needs(partial_images=3), dataclasses.replace(FULL, limits=Limits(max_partial_images=1)), "partial_images", ""),
    (Needs(references=17), FULL, "reference_images", "an edit takes at most 16"),
    (Needs(prompt_chars=9000), FULL, "prompt", "the limit is 8192"),
    (Needs(n=8), Capabilities(AR, Limits(max_batch_outputs=4)), "n", "must be between 1 and 4"),
])
def test_unmet_names_the_field_a_worker_would_refuse(needs: Needs, caps: Capabilities, field: str,
                                                     words: str) -> None:
    why = unmet(needs, caps)
    assert why is not None and why.field == field and words in why.description, why
    assert not fits(needs, caps)


def test_unmet_reads_only_the_bounds_of_the_workers_role() -> None:
    # An AR server applies no step, guidance or adapter bound: a request past a denoiser's default steps fits it.
    ar = Capabilities.of(AR, {"max_n": 4, "max_steps": 1})
    assert unmet(Needs(steps=500, loras=(STYLE,), step_cache=BALANCED, n=4), ar) is None
    assert unmet(Needs(steps=500, n=40), Capabilities.of(DENOISER, {"max_steps": 500})) is None  # n: the AR's
    for caps in (FULL, NO_LORA, NO_CACHE, SMALL):
        assert unmet(Needs(), caps) is None  # a plain request runs anywhere


def test_refusal_is_none_where_one_member_fits_and_names_the_field_of_a_combination_none_serves() -> None:
    big_no_lora = Capabilities(DENOISER, Limits(max_loras_per_request=0))
    small_lora = dataclasses.replace(SMALL, limits=Limits(max_pixels=256 * 256))
    pool = [big_no_lora, small_lora]
    assert refusal(Needs(height=1024, width=1024), pool) is None
    assert refusal(Needs(loras=(STYLE,), height=256, width=256), pool) is None
    why = refusal(Needs(loras=(STYLE,), height=1024, width=1024), pool)
    assert why is not None and why.field == "loras" and "no denoiser here serves everything" in why.description
    assert refusal(Needs(loras=(STYLE,)), []) is None  # nobody has said: the defaults and the workers' checks


def test_the_pool_admits_the_union_of_its_denoisers_bounded_by_the_gateways_flags() -> None:
    adv = [{name: getattr(c.limits, name) for name in DENOISER_FIELDS + ("step_cache",)}
           for c in (NO_LORA, NO_CACHE, SMALL)]
    got = limits_in_force({}, [], adv)
    assert (got.max_loras_per_request, got.step_cache, got.max_pixels) == (4, True, Limits.max_pixels)
    assert limits_in_force({"max_pixels": 512 * 512}, [], adv).max_pixels == 512 * 512
    # None of them caches: the cached levels stay refused, as before.
    assert not limits_in_force({}, [], [adv[1], {**adv[1]}]).step_cache


# ---- the scheduler's placement ------------------------------------------------------------------------------

def _pool(*kinds: Capabilities, **cfg: object) -> Scheduler:
    s = Scheduler(SchedulerConfig(ar_batch_delay=0.0, ar_batch_max_outputs=1, ar_max_inflight_batches=8,
                                  **cfg),  # type: ignore[arg-type]
                  fits=fits)
    s.handle(WorkerCapabilities(0.0, "ar0", Capabilities(AR)))
    up(s, "ar0", AR_ROLE)
    for i, caps in enumerate(kinds):
        s.handle(WorkerAdded(0.0, f"d{i}", DN))
        s.handle(WorkerCapabilities(0.0, f"d{i}", caps))  # as the driver does: read before it is healthy
        s.handle(WorkerHealthy(0.0, f"d{i}"))
    return s


def _submit(s: Scheduler, rid: str, needs: Needs | None = None, now: float = 0.0, n: int = 1
            ) -> list[DispatchDenoise]:
    needs = needs or Needs()
    arrived = RequestArrived(now, rid, n, *SIZE, loras=frozenset(needs.loras), needs=needs)
    (batch,) = only(s.handle(arrived), DispatchArBatch)
    return only(s.handle(ArBatchSucceeded(now, batch.batch_id, {rid: [f"{rid}/{i}" for i in range(n)]})),
                DispatchDenoise)


def _finish(s: Scheduler, d: DispatchDenoise, now: float) -> list[DispatchDenoise]:
    return only(s.handle(DenoiseSucceeded(now, d.job, d.worker, "img")), DispatchDenoise)


@pytest.mark.parametrize(("weak", "needs"), [
    (NO_LORA, Needs(loras=(STYLE,))),
    (NO_CACHE, Needs(step_cache=BALANCED)),
    (SMALL, Needs(height=512, width=512)),
])
def test_a_job_runs_only_where_it_can_and_waits_for_a_busy_capable_denoiser(weak: Capabilities,
                                                                            needs: Needs) -> None:
    s = _pool(FULL, weak)
    # Four outputs at once: one goes to d0, the three others wait for it (d1 stays idle), none fails.
    first = _submit(s, "r1", needs, n=4)
    assert [d.worker for d in first] == ["d0"]
    # A plain request behind them takes the idle d1 at once: the waiting jobs hold nobody up.
    (plain,) = _submit(s, "p1", Needs(), now=0.1)
    assert plain.worker == "d1"
    done = first[0]
    for step in range(3):
        (nxt,) = _finish(s, done, 1.0 + step)
        assert nxt.worker == "d0" and nxt.job.request_id == "r1"
        done = nxt
    assert _finish(s, done, 5.0) == []
    assert s.counters.completed == 1 and not any(s.counters.failed.values())


def test_plain_requests_use_every_denoiser_of_a_mixed_pool() -> None:
    s = _pool(FULL, NO_LORA, NO_CACHE)
    assert sorted(d.worker for d in _submit(s, "p", Needs(), n=3)) == ["d0", "d1", "d2"]


def test_a_capability_that_changes_moves_the_waiting_jobs() -> None:
    # d1 restarted with an adapter directory (a rolling upgrade): the job waiting for d0 goes to d1 at once.
    s = _pool(FULL, NO_LORA)
    (first,) = _submit(s, "r1", Needs(loras=(STYLE,)), n=2)
    assert first.worker == "d0"
    moved = only(s.handle(WorkerCapabilities(1.0, "d1", FULL)), DispatchDenoise)
    assert [(d.worker, d.job.index) for d in moved] == [("d1", 1)]


def test_a_job_no_member_can_run_waits_and_the_pool_becomes_plain_again_when_the_kind_leaves() -> None:
    s = _pool(FULL, NO_LORA)
    (first,) = _submit(s, "r1", Needs(loras=(STYLE,)), n=1)
    # The capable one is removed while it runs: the job ends there (drain), and a new one waits, never on d1.
    s.handle(WorkerRemoved(0.5, "d0"))
    assert _finish(s, first, 1.0) == []
    arrived = RequestArrived(1.0, "r2", 1, *SIZE, loras=frozenset({STYLE}), needs=Needs(loras=(STYLE,)))
    (batch,) = only(s.handle(arrived), DispatchArBatch)
    actions = s.handle(ArBatchSucceeded(1.0, batch.batch_id, {"r2": ["x"]}))
    assert not only(actions, DispatchDenoise) and not only(actions, FailRequest)
    assert s.snapshot().pending_denoise_outputs == 1
    # The pool is uniform now (d1 alone): the request is the only restricted one, plain jobs take the plain path.
    assert s._capability.kinds == {NO_LORA: 1} and s._capability.restricted == 1


def test_without_fits_every_job_goes_anywhere_as_before() -> None:
    s = Scheduler(SchedulerConfig(ar_batch_delay=0.0, ar_batch_max_outputs=1))
    up(s, "ar0", AR_ROLE)
    up(s, "d0", DN)
    s.handle(WorkerCapabilities(0.0, "d0", NO_LORA))
    assert [d.worker for d in _submit(s, "r1", Needs(loras=(STYLE,)))] == ["d0"]


# ---- AR batches placed by capability ------------------------------------------------------------------------------

BIG_AR = Capabilities(AR)  # the default pixel budget
SMALL_AR = Capabilities(AR, Limits(max_pixels=256 * 256))
SHORT_AR = Capabilities(AR, Limits(max_prompt_chars=100))
LARGE = Needs(height=512, width=512)  # past SMALL_AR's budget
LONG = Needs(prompt_chars=500)  # past SHORT_AR's (at the size of Needs(), so in the same AR queue)


def _ar_pool(*kinds: Capabilities, **cfg: object) -> Scheduler:
    """AR servers ``a0``, ``a1``... of ``kinds`` (each with one batch at a time) and one denoiser of every kind."""
    s = Scheduler(SchedulerConfig(**{"ar_batch_delay": 0.0, "ar_batch_max_outputs": 4, **cfg}),  # type: ignore[arg-type]
                  fits=fits)
    for i, caps in enumerate(kinds):
        s.handle(WorkerAdded(0.0, f"a{i}", AR_ROLE))
        s.handle(WorkerCapabilities(0.0, f"a{i}", caps))
        s.handle(WorkerHealthy(0.0, f"a{i}"))
    s.handle(WorkerCapabilities(0.0, "d0", FULL))
    up(s, "d0", DN)
    return s


def _arrive(s: Scheduler, rid: str, needs: Needs, now: float = 0.0, deadline: float | None = None
            ) -> list[DispatchArBatch]:
    ev = RequestArrived(now, rid, 1, needs.height, needs.width, deadline, needs=needs)
    return only(s.handle(ev), DispatchArBatch)


def test_an_ar_pool_of_one_kind_keeps_the_plain_path() -> None:
    s = _ar_pool(SMALL_AR, SMALL_AR)
    assert _arrive(s, "r1", Needs())[0].worker == "a0"
    assert s._capability.ar_kinds == {SMALL_AR: 2} and s._capability.ar_restricted == 0


def test_a_request_only_one_ar_server_can_run_waits_for_it_while_the_others_go_on() -> None:
    s = _ar_pool(BIG_AR, SMALL_AR)
    (first,) = _arrive(s, "big1", LARGE)
    assert first.worker == "a0"  # the only one that can
    assert _arrive(s, "big2", LARGE, now=0.1) == []  # a0 is busy: it waits, a1 stays free for what it can run
    (plain,) = _arrive(s, "plain", Needs(), now=0.2)
    assert (plain.worker, plain.request_ids) == ("a1", ("plain",))
    # a0 frees up: the waiting request goes there, and never to a1.
    (nxt,) = only(s.handle(ArBatchSucceeded(1.0, first.batch_id, {"big1": ["x"]})), DispatchArBatch)
    assert (nxt.worker, nxt.request_ids) == ("a0", ("big2",))
    assert s._capability.ar_restricted == 2  # (big1 is denoising: counted while active, as for denoisers)


def _blocked(s: Scheduler, needs: Needs) -> DispatchArBatch:
    """A first request that only a1 runs, taken there when its batch delay (0.05 s) ends."""
    assert _arrive(s, "b0", needs) == []
    (blocker,) = only(s.handle(Tick(0.05)), DispatchArBatch)
    assert (blocker.worker, blocker.request_ids) == ("a1", ("b0",))
    return blocker


def test_the_ar_server_that_can_run_less_chooses_first() -> None:
    # Both free when the batches may leave: a1 takes the plain one, and a0 (which runs anything) stays free for
    # the request only it can run, instead of taking the plain one first and leaving a1 idle.
    s = _ar_pool(BIG_AR, SMALL_AR, ar_batch_delay=0.05)
    assert _arrive(s, "plain", Needs()) == [] and _arrive(s, "big", LARGE, now=0.01) == []
    (plain,) = only(s.handle(Tick(0.05)), DispatchArBatch)
    assert (plain.worker, plain.request_ids) == ("a1", ("plain",))
    (big,) = only(s.handle(Tick(s.next_wakeup())), DispatchArBatch)
    assert (big.worker, big.request_ids) == ("a0", ("big",))


def test_a_shared_queue_gives_each_ar_server_only_the_requests_it_can_run() -> None:
    s = _ar_pool(SHORT_AR, BIG_AR, ar_batch_delay=0.05)
    blocker = _blocked(s, LONG)
    # One resolution's queue: a request only a1 can run before two that both can; a0 batches those two when
    # their delay ends, and the other waits for a1.
    for i, needs in enumerate((LONG, Needs(), Needs()), start=1):
        assert _arrive(s, f"r{i}", needs, now=0.05 + 0.01 * i) == []
    assert s.next_wakeup() == pytest.approx(0.12)  # r2's delay: r1's is not a0's to wait for
    (short,) = only(s.handle(Tick(s.next_wakeup())), DispatchArBatch)
    assert (short.worker, short.request_ids) == ("a0", ("r2", "r3"))
    (long,) = only(s.handle(ArBatchSucceeded(0.15, blocker.batch_id, {"b0": ["x"]})), DispatchArBatch)
    assert (long.worker, long.request_ids) == ("a1", ("r1",))


def test_a_free_ar_server_with_nothing_due_holds_up_no_other() -> None:
    s = _ar_pool(SMALL_AR, BIG_AR, ar_batch_delay=0.05)
    blocker = _blocked(s, LARGE)
    assert _arrive(s, "b1", LARGE, now=0.06) == []
    assert _arrive(s, "p1", Needs(), now=0.1) == []  # a0 could take p1, but its batch has not waited its delay
    # a1 frees up at 0.12: b1 has waited past its delay and goes at once, though a0, which chooses first (it can
    # run fewer of the waiting requests), has nothing due yet.
    (nxt,) = only(s.handle(ArBatchSucceeded(0.12, blocker.batch_id, {"b0": ["x"]})), DispatchArBatch)
    assert (nxt.worker, nxt.request_ids) == ("a1", ("b1",))
    assert s.next_wakeup() == pytest.approx(0.15)  # p1's delay ends then, and a0 is free for it
    (last,) = only(s.handle(Tick(s.next_wakeup())), DispatchArBatch)
    assert (last.worker, last.request_ids) == ("a0", ("p1",))


def test_a_request_whose_only_capable_ar_server_left_waits_and_fails_at_its_deadline() -> None:
    # As a denoise job whose capable denoisers left: it waits (never on a server that cannot run it, never failing
    # while one may come back), runs if a capable one comes back or joins, else ends at its deadline. (A new such
    # request is refused at admission, the field named: Members.capable.)
    s = _ar_pool(BIG_AR, SMALL_AR)
    (first,) = _arrive(s, "big1", LARGE)
    assert _arrive(s, "big2", LARGE, now=0.1, deadline=5.0) == []
    assert _arrive(s, "big3", LARGE, now=0.1, deadline=5.0) == []
    s.handle(WorkerRemoved(0.2, "a0"))  # draining: its batch ends there
    actions = s.handle(ArBatchSucceeded(0.3, first.batch_id, {"big1": ["x"]}))
    assert not only(actions, DispatchArBatch) and not only(actions, FailRequest)
    assert "a0" not in s._pool.members and s._capability.ar_kinds == {SMALL_AR: 1}
    assert (plain := _arrive(s, "plain", Needs(), now=0.4)) and plain[0].worker == "a1"
    # A capable server joins: the waiting requests go there.
    s.handle(WorkerAdded(1.0, "a2", AR_ROLE))
    s.handle(WorkerCapabilities(1.0, "a2", BIG_AR))
    (moved,) = only(s.handle(WorkerHealthy(1.0, "a2")), DispatchArBatch)
    assert (moved.worker, moved.request_ids) == ("a2", ("big2", "big3"))
    # It leaves too, the batch failing with it: both wait again, and end at their deadline.
    s.handle(WorkerRemoved(1.1, "a2"))
    s.handle(ArBatchFailed(1.2, moved.batch_id, "gone"))
    failed = only(s.handle(Tick(5.0)), FailRequest)
    assert sorted((f.request_id, f.error.kind) for f in failed) == [("big2", ErrorKind.DEADLINE_EXCEEDED),
                                                                    ("big3", ErrorKind.DEADLINE_EXCEEDED)]


# ---- the union admits what any one member can run --------------------------------------------------------------

_caps = st.builds(
    lambda pixels, steps, cache, loras, refs: Capabilities(
        DENOISER, Limits(max_pixels=pixels, max_steps=steps, step_cache=cache, max_reference_images=refs,
                         max_loras_per_request=4 if loras else 0), frozenset(loras)),
    st.sampled_from([64 * 64, 256 * 256, 512 * 512, Limits.max_pixels]), st.integers(1, 300), st.booleans(),
    st.sampled_from([(), (STYLE,), ("ink",), (STYLE, "ink")]), st.integers(0, 16))
_needs = st.builds(Needs, height=st.sampled_from([32, 64, 256, 320, 512]), width=st.sampled_from([64, 256]),
                   steps=st.integers(0, 300), step_cache=st.sampled_from([0, BALANCED]),
                   loras=st.sampled_from([(), (STYLE,), ("ink",), (STYLE, "ink")]), references=st.integers(0, 16))


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(pool=st.lists(_caps, min_size=1, max_size=4), needs=_needs)
def test_the_union_admits_what_some_member_runs_and_refusal_agrees_with_each_member(pool: list[Capabilities],
                                                                                    needs: Needs) -> None:
    union = limits_in_force({}, [], [{name: getattr(c.limits, name) for name in DENOISER_FIELDS + ("step_cache",)}
                                     for c in pool])
    catalogue = frozenset().union(*(c.loras for c in pool))
    somewhere = any(unmet(needs, c) is None for c in pool)
    # Admission (the union) never refuses what one member can run; refusal says so exactly when none can.
    if somewhere:
        assert unmet(needs, Capabilities(DENOISER, union, catalogue)) is None
    assert (refusal(needs, pool) is None) == somewhere
