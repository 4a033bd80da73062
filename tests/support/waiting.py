"""Waiting on a live system the test does not own (other processes, a browser, a Prometheus): poll a condition
until it holds, never a fixed sleep."""
from __future__ import annotations

import time
from collections.abc import Callable


def until(predicate: Callable[[], object], timeout: float, what: str, step: float = 0.02) -> float:
    """Poll ``predicate`` every ``step`` seconds until it is true; AssertionError naming ``what`` after
    ``timeout`` seconds. Returns the seconds waited."""
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < timeout, f"timed out after {timeout}s waiting for {what}"
        time.sleep(step)
    return time.monotonic() - t0
