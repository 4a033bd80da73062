"""The call timeouts' cost model: a margin over what recent calls of that kind took, part by part, capped, and never
a guess for a part no call has shown yet."""
from __future__ import annotations

import pytest

from gateway.timeouts import CostModel, DenoiseTimeouts, TimeoutPolicy, ar_seconds, ar_work, denoise_work
from glmimage.v1 import common_pb2

POLICY = TimeoutPolicy(margin=3.0, floor=5.0, cap=600.0, window=4)
MP = 1000 * 1000


def _denoised(t: DenoiseTimeouts, steps: int = 10, size: int = 1000, reference_pixels: int = 0, *,
              denoise: float = 2.0, prepare: float = 0.0, post: float = 0.5) -> None:
    t.observe(steps, steps, size, size, reference_pixels, denoise_seconds=denoise, prepare_seconds=prepare,
              post_seconds=post)


def test_before_any_call_the_cap_applies() -> None:
    t = DenoiseTimeouts(POLICY)
    assert t.timeout(t.work(50, 1024, 1024, 0)) == 600.0
    assert CostModel(POLICY).timeout(ar_work(1024, 1024, 0)) == 600.0


def test_denoise_timeout_follows_steps_and_size() -> None:
    t = DenoiseTimeouts(POLICY)
    _denoised(t)  # 1 megapixel, 10 steps in 2 s (0.2 s per step), decode + encode 0.5 s
    assert t.timeout(t.work(10, 1000, 1000, 0)) == pytest.approx(5 + 3 * (2.0 + 0.5))
    assert t.timeout(t.work(50, 1000, 1000, 0)) == pytest.approx(5 + 3 * (10.0 + 0.5))  # five times the steps
    assert t.timeout(t.work(10, 500, 500, 0)) == pytest.approx(5 + 3 * 0.25 * (2.0 + 0.5))  # a quarter of the pixels
    assert t.timeout(t.work(10_000, 2000, 2000, 0)) == 600.0  # capped


def test_the_first_edit_after_plain_jobs_gets_the_cap_then_its_references_are_priced() -> None:
    """The reported failure: timeouts learned from 64x64 text-to-image jobs cut a 16-reference edit short."""
    t, ar = DenoiseTimeouts(POLICY), CostModel(POLICY)
    for _ in range(4):
        _denoised(t, size=64, denoise=0.05, post=0.01)
        ar.observe(ar_work(64, 64, 0), {"text": 0.3, "queue": 0.0})
    refs = 16 * 4096 * 4096
    assert t.timeout(t.work(10, 64, 64, refs)) == 600.0
    assert ar.timeout(ar_work(64, 64, refs)) == 600.0
    # The edit took 20 s to prepare its references (the denoiser reports it apart from the steps), 22 s in all.
    _denoised(t, size=64, reference_pixels=refs, denoise=20.05, prepare=20.0, post=0.01)
    ar.observe(ar_work(64, 64, refs), {"edit": 8.0, "queue": 0.0})
    assert t.timeout(t.work(10, 64, 64, refs)) == pytest.approx(5 + 3 * (20.0 + 0.05 + 0.01), rel=1e-3)
    assert t.timeout(t.work(10, 64, 64, refs // 4)) == pytest.approx(5 + 3 * (5.0 + 0.05 + 0.01), rel=1e-3)
    assert ar.timeout(ar_work(64, 64, refs)) == pytest.approx(5 + 3 * 8.0)
    # The edit's preparation did not make plain jobs' steps look slower.
    assert t.timeout(t.work(10, 64, 64, 0)) == pytest.approx(5 + 3 * 0.06, rel=1e-3)
    assert ar.timeout(ar_work(64, 64, 0)) == pytest.approx(5 + 3 * 0.3)


def test_each_step_cache_level_is_learned_apart_and_a_cold_one_gets_the_cap() -> None:
    """A cached level's step costs a fraction of a full one that only its own jobs show: learned per level, so
    cached jobs neither shrink the plain jobs' timeout nor borrow it before one of them has run."""
    t = DenoiseTimeouts(POLICY)
    _denoised(t)  # plain: 0.2 s per step at 1 MP
    assert t.timeout(t.work(10, 1000, 1000, 0, common_pb2.STEP_CACHE_OFF)) == pytest.approx(5 + 3 * 2.5)
    assert t.timeout(t.work(10, 1000, 1000, 0, common_pb2.STEP_CACHE_UNSPECIFIED)) == pytest.approx(5 + 3 * 2.5)
    aggressive = common_pb2.STEP_CACHE_AGGRESSIVE
    assert t.timeout(t.work(10, 1000, 1000, 0, aggressive)) == 600.0  # never seen: the cap
    t.observe(10, 10, 1000, 1000, 0, denoise_seconds=0.5, prepare_seconds=0.0, post_seconds=0.5,
              step_cache=aggressive)
    assert t.timeout(t.work(10, 1000, 1000, 0, aggressive)) == pytest.approx(5 + 3 * 1.0)
    assert t.timeout(t.work(10, 1000, 1000, 0)) == pytest.approx(5 + 3 * 2.5)  # plain jobs unchanged
    assert t.timeout(t.work(10, 1000, 1000, 0, common_pb2.STEP_CACHE_BALANCED)) == 600.0
    assert set(denoise_work(10, 1000, 1000, 0, aggressive)) == {"steps/aggressive", "post", "references"}


def test_a_request_without_steps_uses_what_the_denoisers_run_by_default() -> None:
    t = DenoiseTimeouts(POLICY)
    assert t.work(0, 1000, 1000, 0) is None
    assert t.timeout(None) == 600.0
    t.observe(0, 2, 1000, 1000, 0, denoise_seconds=0.4, prepare_seconds=0.0, post_seconds=0.0)  # the default is 2
    assert t.work(0, 1000, 1000, 0) == denoise_work(2, 1000, 1000, 0)
    assert t.timeout(t.work(0, 1000, 1000, 0)) == pytest.approx(5 + 3 * 0.4)


def test_the_slowest_recent_call_counts_and_old_ones_age_out() -> None:
    t = CostModel(POLICY)
    work = ar_work(1000, 1000, 0)
    t.observe(work, ar_seconds(work, 10.0, 0.0))
    for _ in range(3):
        t.observe(work, ar_seconds(work, 1.0, 0.0))
    assert t.timeout(work) == pytest.approx(5 + 3 * 10.0)  # one slow worker in the pool is honoured
    t.observe(work, ar_seconds(work, 1.0, 0.0))  # the window (4) has moved past it
    assert t.timeout(work) == pytest.approx(5 + 3 * 1.0)


def test_an_ar_call_s_wait_behind_other_batches_is_learned_apart_from_its_work() -> None:
    """A call that waited 9 s of its 10 s behind other gateways' batches: its work took 1 s; the next call is allowed
    the work's margin plus the recent wait's."""
    t = CostModel(POLICY)
    work = ar_work(1000, 1000, 0)
    assert ar_seconds(work, 10.0, 9.0) == {"text": 1.0, "queue": 9.0}
    assert ar_seconds(work, 1.0, 5.0) == {"text": 0.0, "queue": 1.0}  # a wait past the whole call is clipped
    t.observe(work, ar_seconds(work, 10.0, 9.0))
    assert t.estimate(work) == pytest.approx(10.0)
    assert t.estimate({"text": 2.0, "queue": 1.0}) == pytest.approx(2.0 + 9.0)  # twice the work, one wait


def test_an_overrun_on_a_healthy_worker_allows_such_work_more() -> None:
    t = CostModel(POLICY)
    work = denoise_work(10, 1000, 1000, 0)
    t.observe(work, {"steps": 2.0, "post": 0.5})
    allowed = t.timeout(work)
    t.observe_overrun(work, allowed)  # still running at its timeout: at least allowed / 2.5 times slower
    assert t.estimate(work) == pytest.approx(allowed)
    assert t.timeout(work) == pytest.approx(min(600.0, 5 + 3 * allowed))
    cold = CostModel(POLICY)
    cold.observe_overrun(work, 600.0)  # overran the cap itself: nothing is learned, the cap stays
    assert cold.timeout(work) == 600.0


def test_a_fixed_timeout_is_used_as_is() -> None:
    t = DenoiseTimeouts(TimeoutPolicy(fixed=7.0))
    _denoised(t, denoise=100.0, post=1.0)
    assert t.timeout(t.work(50, 2048, 2048, 1 << 24)) == 7.0
    assert t.timeout(None) == 7.0


@pytest.mark.parametrize("kwargs", [{"fixed": 0}, {"margin": 0.5}, {"cap": 0}, {"window": 0}])
def test_bad_policies_are_refused(kwargs) -> None:
    with pytest.raises(ValueError):
        TimeoutPolicy(**kwargs)
