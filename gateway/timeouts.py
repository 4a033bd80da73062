"""Per-call timeouts that follow the work: a call may take a margin over what such a call recently took.

A fixed timeout is either far too long (a hung worker holds a request for minutes) or too short for the largest
job. Instead each stage keeps the recent cost per unit of work (denoise: per step and megapixel, plus decode and
encode per megapixel; AR: per megapixel of the batch's resolution) and allows ``margin`` times the estimate plus a
floor for the RPC itself, never more than ``cap``. Until it has seen a call, the cap applies: a cold first job
is never cut short. The estimate uses the slowest of the recent observations, so one fast call does not shrink
the timeout below what a slower worker of the same pool needs.

Pure and clock-free like the scheduler: the driver feeds observations and asks for timeouts.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

MEGAPIXEL = 1_000_000


@dataclass(frozen=True)
class TimeoutPolicy:
    fixed: float | None = None  # an operator's value: used as is
    margin: float = 3.0
    floor: float = 5.0  # seconds added to every estimate: connection, queueing for the slot, transfer
    cap: float = 600.0
    window: int = 32  # recent observations kept

    def __post_init__(self) -> None:
        if self.fixed is not None and self.fixed <= 0:
            raise ValueError("a fixed timeout must be positive")
        if self.margin < 1 or self.floor < 0 or self.cap <= 0 or self.window < 1:
            raise ValueError("timeout policy: margin >= 1, floor >= 0, cap > 0, window >= 1")


@dataclass
class _Rates:
    window: int
    values: deque[float] = field(init=False)

    def __post_init__(self) -> None:
        self.values = deque(maxlen=self.window)

    def add(self, value: float) -> None:
        if value >= 0:
            self.values.append(value)

    def high(self) -> float | None:
        return max(self.values) if self.values else None


class DenoiseTimeouts:
    """Timeout of one denoise call from its steps and size."""

    def __init__(self, policy: TimeoutPolicy) -> None:
        self.policy = policy
        self._per_step = _Rates(policy.window)  # seconds per step per megapixel
        self._post = _Rates(policy.window)  # decode + encode seconds per megapixel
        self._default_steps: int | None = None  # what the denoisers run when a request leaves steps at 0

    def observe(self, requested_steps: int, steps_completed: int, height: int, width: int,
                denoise_seconds: float, post_seconds: float) -> None:
        mp = max(height * width / MEGAPIXEL, 1e-6)
        if steps_completed > 0:
            self._per_step.add(denoise_seconds / (steps_completed * mp))
            if requested_steps == 0:
                self._default_steps = steps_completed
        self._post.add(post_seconds / mp)

    def timeout(self, steps: int, height: int, width: int) -> float:
        p = self.policy
        if p.fixed is not None:
            return p.fixed
        per_step, post = self._per_step.high(), self._post.high()
        steps = steps or self._default_steps or 0
        if per_step is None or post is None or steps == 0:
            return p.cap
        mp = height * width / MEGAPIXEL
        return min(p.cap, p.floor + p.margin * mp * (steps * per_step + post))


class ArTimeouts:
    """Timeout of one AR batch call from its resolution (the tokens each row generates grow with the pixels)."""

    def __init__(self, policy: TimeoutPolicy) -> None:
        self.policy = policy
        self._per_mp = _Rates(policy.window)

    def observe(self, height: int, width: int, seconds: float) -> None:
        self._per_mp.add(seconds / max(height * width / MEGAPIXEL, 1e-6))

    def timeout(self, height: int, width: int) -> float:
        p = self.policy
        if p.fixed is not None:
            return p.fixed
        rate = self._per_mp.high()
        if rate is None:
            return p.cap
        return min(p.cap, p.floor + p.margin * rate * height * width / MEGAPIXEL)
