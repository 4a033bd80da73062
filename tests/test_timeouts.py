"""The adaptive call timeouts: a margin over what recent calls of that size took, capped, never a cold guess."""
from __future__ import annotations

import pytest

from gateway.timeouts import ArTimeouts, DenoiseTimeouts, TimeoutPolicy

POLICY = TimeoutPolicy(margin=3.0, floor=5.0, cap=600.0, window=4)


def test_before_any_call_the_cap_applies() -> None:
    assert DenoiseTimeouts(POLICY).timeout(50, 1024, 1024) == 600.0
    assert ArTimeouts(POLICY).timeout(1024, 1024) == 600.0


def test_denoise_timeout_follows_steps_and_size() -> None:
    t = DenoiseTimeouts(POLICY)
    # 1 megapixel, 10 steps in 2 s (0.2 s per step), decode + encode 0.5 s.
    t.observe(10, 10, 1000, 1000, denoise_seconds=2.0, post_seconds=0.5)
    assert t.timeout(10, 1000, 1000) == pytest.approx(5 + 3 * (2.0 + 0.5))
    assert t.timeout(50, 1000, 1000) == pytest.approx(5 + 3 * (10.0 + 0.5))  # five times the steps
    assert t.timeout(10, 500, 500) == pytest.approx(5 + 3 * 0.25 * (2.0 + 0.5))  # a quarter of the pixels
    assert t.timeout(10_000, 2000, 2000) == 600.0  # capped


def test_a_request_without_steps_uses_what_the_denoisers_run_by_default() -> None:
    t = DenoiseTimeouts(POLICY)
    t.observe(0, 2, 1000, 1000, denoise_seconds=0.4, post_seconds=0.0)  # the default turned out to be 2 steps
    assert t.timeout(0, 1000, 1000) == pytest.approx(5 + 3 * 0.4)


def test_the_slowest_recent_call_counts_and_old_ones_age_out() -> None:
    t = ArTimeouts(POLICY)
    t.observe(1000, 1000, 10.0)
    for _ in range(3):
        t.observe(1000, 1000, 1.0)
    assert t.timeout(1000, 1000) == pytest.approx(5 + 3 * 10.0)  # one slow worker in the pool is honoured
    t.observe(1000, 1000, 1.0)  # the window (4) has moved past it
    assert t.timeout(1000, 1000) == pytest.approx(5 + 3 * 1.0)


def test_a_fixed_timeout_is_used_as_is() -> None:
    t = DenoiseTimeouts(TimeoutPolicy(fixed=7.0))
    t.observe(10, 10, 1000, 1000, 100.0, 1.0)
    assert t.timeout(50, 2048, 2048) == 7.0


@pytest.mark.parametrize("kwargs", [{"fixed": 0}, {"margin": 0.5}, {"cap": 0}, {"window": 0}])
def test_bad_policies_are_refused(kwargs) -> None:
    with pytest.raises(ValueError):
        TimeoutPolicy(**kwargs)
