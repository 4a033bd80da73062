"""Per-call timeouts that follow the work: one cost model for AR batches and denoise jobs alike.

A fixed timeout is either far too long (a hung worker holds a request for minutes) or too short for the largest
job. Instead a call's work is split into parts, each measured in the units its time grows with:

- a denoise job: ``steps`` (steps x megapixels of the target; with a cached StepCache level, a part of that
  level's own, ``steps/balanced`` or ``steps/aggressive``, since a cached step costs a fraction of a full one and
  the fraction is the schedule's), ``post`` (decode and encode, per target
  megapixel) and ``references`` (decoding and VAE-encoding an edit's references, per megapixel their headers
  declare); the denoiser reports the seconds of each part, so each rate is learned on its own;
- an AR batch: ``text`` (megapixels of the batch's resolution) for a batch of prompts, or ``edit`` (the target's
  megapixels plus the references' declared megapixels) for an edit, which goes alone and whose references the AR
  decodes and prefills: a kind of call with its own rate, since the AR reports only the batch's total; and
  ``queue`` (one per call), the time the call waited behind other callers' batches (other gateways' ones) before its
  own began, which the AR reports: so the work's rate is learned without the wait, and the wait is allowed apart.

The timeout allows ``margin`` times the estimate plus a floor for the RPC itself, never more than ``cap``. A part
the call needs but no call has shown yet leaves the estimate unknown, and the cap applies: a cold first job of
a kind (the first edit after a hundred plain requests) is never cut short. Each rate is the slowest of the
recent observations, so one fast call does not shrink the timeout below what a slower worker of the pool needs.
A call that overran on a worker that still answers its health probe teaches the model too: that work takes at
least that long, so the next such call is allowed more (``observe_overrun``).

Pure and clock-free like the scheduler: the driver feeds observations and asks for timeouts.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from glmimage.v1 import common_pb2

MEGAPIXEL = 1_000_000

# Parts of a call (see the module's docstring).
STEPS, POST, REFERENCES = "steps", "post", "references"
TEXT, EDIT, QUEUE = "text", "edit", "queue"

Work = Mapping[str, float]  # part -> units of it the call does


@dataclass(frozen=True)
class TimeoutPolicy:
    fixed: float | None = None  # an operator's value: used as is
    margin: float = 3.0
    floor: float = 5.0  # seconds added to every estimate: connection, queueing for the slot, transfer
    cap: float = 600.0
    window: int = 32  # recent observations kept per part

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


class CostModel:
    """Seconds per unit of each part of a kind of call, learned from the calls that ended; timeouts from them."""

    def __init__(self, policy: TimeoutPolicy) -> None:
        self.policy = policy
        self._rates: dict[str, _Rates] = {}

    def _series(self, part: str) -> _Rates:
        if part not in self._rates:
            self._rates[part] = _Rates(self.policy.window)
        return self._rates[part]

    def observe(self, work: Work, seconds: Mapping[str, float]) -> None:
        """A call that did ``work`` and took ``seconds`` of each part (a part it did no units of teaches nothing)."""
        for part, units in work.items():
            if units > 0 and part in seconds:
                self._series(part).add(seconds[part] / units)

    def estimate(self, work: Work) -> float | None:
        """Seconds ``work`` should take; None while a part of it has never been seen."""
        total = 0.0
        for part, units in work.items():
            if units <= 0:
                continue
            rate = self._rates[part].high() if part in self._rates else None
            if rate is None:
                return None
            total += rate * units
        return total

    def timeout(self, work: Work) -> float:
        p = self.policy
        if p.fixed is not None:
            return p.fixed
        estimate = self.estimate(work)
        return p.cap if estimate is None else min(p.cap, p.floor + p.margin * estimate)

    def observe_overrun(self, work: Work, seconds: float) -> None:
        """A call that was still running after ``seconds`` on a worker that answers its health checks: the work was
        slower than estimated, by at least seconds / estimate. Every part it did is scaled up by that."""
        estimate = self.estimate(work)
        if estimate is None or estimate <= 0:
            return  # it ran under the cap: nothing longer to allow
        scale = max(1.0, seconds / estimate)
        for part, units in work.items():
            if units > 0:
                series = self._rates[part]
                series.add(series.high() * scale)  # type: ignore[operator] - estimate() saw every rate


def megapixels(height: int, width: int) -> float:
    return max(height * width / MEGAPIXEL, 1e-6)


def steps_part(step_cache: int = 0) -> str:
    """The part a job's steps are learned under: one per cached StepCache level (0 and 1, unspecified and off,
    are the plain steps)."""
    if step_cache in (common_pb2.STEP_CACHE_UNSPECIFIED, common_pb2.STEP_CACHE_OFF):
        return STEPS
    return f"{STEPS}/{common_pb2.StepCache.Name(step_cache).removeprefix('STEP_CACHE_').lower()}"


def denoise_work(steps: int, height: int, width: int, reference_pixels: int, step_cache: int = 0
                 ) -> dict[str, float]:
    """A denoise job's parts; ``steps`` as the job runs them (the request's, else the denoisers' default)."""
    mp = megapixels(height, width)
    return {steps_part(step_cache): steps * mp, POST: mp, REFERENCES: reference_pixels / MEGAPIXEL}


def ar_work(height: int, width: int, reference_pixels: int) -> dict[str, float]:
    """An AR batch's parts: a batch of prompts, or one edit with its references; and its wait for the model."""
    mp = megapixels(height, width)
    return {EDIT if reference_pixels else TEXT: mp + reference_pixels / MEGAPIXEL, QUEUE: 1.0}


def ar_seconds(work: Work, total: float, queue: float) -> dict[str, float]:
    """The parts' seconds of an AR batch that took ``total``, ``queue`` of it waiting for the model."""
    queue = min(max(queue, 0.0), total)
    return {part: queue if part == QUEUE else total - queue for part in work}


class DenoiseTimeouts:
    """The denoise stage's cost model, plus the step count the denoisers run when a request leaves it at 0."""

    def __init__(self, policy: TimeoutPolicy) -> None:
        self.model = CostModel(policy)
        self._default_steps: int | None = None

    def work(self, requested_steps: int, height: int, width: int, reference_pixels: int, step_cache: int = 0
             ) -> dict[str, float] | None:
        """The job's work; None while the default step count it would run is unknown."""
        steps = requested_steps or self._default_steps
        return None if not steps else denoise_work(steps, height, width, reference_pixels, step_cache)

    def timeout(self, work: Work | None) -> float:
        p = self.model.policy
        return p.fixed if p.fixed is not None else (p.cap if work is None else self.model.timeout(work))

    def observe(self, requested_steps: int, steps_completed: int, height: int, width: int, reference_pixels: int,
                *, denoise_seconds: float, prepare_seconds: float, post_seconds: float, step_cache: int = 0) -> None:
        """A job that ended: ``denoise_seconds`` includes ``prepare_seconds``, the references' preparation."""
        if steps_completed > 0 and requested_steps == 0:
            self._default_steps = steps_completed
        work = denoise_work(steps_completed, height, width, reference_pixels, step_cache)
        steps_seconds = denoise_seconds - prepare_seconds if reference_pixels else denoise_seconds
        self.model.observe(work, {steps_part(step_cache): steps_seconds, POST: post_seconds,
                                  REFERENCES: prepare_seconds})
