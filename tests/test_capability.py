"""Capabilities per worker (issue 32): the one rule (runtime.capability.unmet) that says whether a request fits
one worker, the union the gateway admits, and the pure scheduler placing each denoise job only on a denoiser that can
run it, with the real rule as its ``fits``: a job whose capable denoisers are busy waits for one (never failing,
never going to an idle one that cannot run it) while the jobs behind it go on, and plain jobs use every denoiser.
The state machine (tests/test_scheduler_machine.py) checks the placement on random event streams too.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.scheduler.core import Scheduler
from gateway.scheduler.types import (
    ArBatchSucceeded,
    DenoiseSucceeded,
    DispatchArBatch,
    DispatchDenoise,
    FailRequest,
    RequestArrived,
    SchedulerConfig,
    WorkerAdded,
    WorkerCapabilities,
    WorkerHealthy,
    WorkerRemoved,
)
from glmimage.v1 import common_pb2
from runtime.capability import AR, DENOISER, Capabilities, Needs, fits, refusal, unmet
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
