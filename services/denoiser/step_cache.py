"""Step caching in the denoise loop: on a cached step the DiT's transformer blocks are not run, and what they would
give is extrapolated from the last fully computed steps.

Built on diffusers' TaylorSeer hooks (``diffusers.hooks.TaylorSeerCacheConfig``, which
``GlmImageTransformer2DModel`` takes through its ``CacheMixin``), not on cache-dit: the hooks come with the diffusers
we already run, work on any torch device, follow a fixed schedule (so they cache on random tiny weights as on real
ones, where a residual threshold may never be met), and leave the library's forward code alone, where cache-dit
replaces the transformer's and every block's forward with its own copy.

What GLM-Image needs from us, since its pipeline calls the transformer without diffusers' cache contexts:

- the hooks count a step per call, so each call is named: ``cond`` or ``uncond`` (classifier-free guidance), each
  with its own state; an edit's reference passes (which write the references into the KV cache before the loop) are
  never seen by the hooks, because the cache is switched on at the first step's call;
- nothing survives a job: the hooks are removed when the job ends, however it ends, and put back for the next.

The levels' schedules are the denoiser's flags (``--step-cache-balanced``, ``--step-cache-aggressive``).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, fields
from typing import Any

import torch

# Every transformer block as one cached module: its outputs (image and text streams) are extrapolated together.
_BLOCKS = r"^transformer_blocks\.\d+$"


class StepCacheLevel(enum.Enum):
    OFF = "off"
    BALANCED = "balanced"
    AGGRESSIVE = "aggressive"


@dataclass(frozen=True)
class Schedule:
    """Which steps of a job are computed: the first ``warmup``, then one in every ``interval``; the others are
    extrapolated with a Taylor expansion of ``order``. ``lite`` skips the blocks outright on a cached step and
    extrapolates only the output projection (less memory and time, further from the uncached image)."""

    interval: int
    warmup: int
    order: int = 1
    lite: bool = False

    def __post_init__(self) -> None:
        if self.interval < 2 or self.warmup < 1 or not 1 <= self.order <= 4:
            raise ValueError("a step-cache schedule needs interval >= 2, warmup >= 1 and order 1-4")

    @classmethod
    def parse(cls, spec: str) -> Schedule:
        """``interval=2,warmup=3,order=1,lite=0``, the flag's form: interval and warmup must be given; order and lite
        default to 1 and 0."""
        known = {f.name: f.type for f in fields(cls)}
        values: dict[str, Any] = {}
        for item in filter(None, (part.strip() for part in spec.split(","))):
            key, sep, raw = item.partition("=")
            if not sep or key not in known:
                raise ValueError(f"{item!r}: expected key=value with a key among {', '.join(known)}")
            try:
                values[key] = raw in ("1", "true", "yes") if key == "lite" else int(raw)
            except ValueError:
                raise ValueError(f"{item!r}: {key} takes a whole number") from None
        missing = {"interval", "warmup"} - values.keys()
        if missing:
            raise ValueError(f"{spec!r}: {' and '.join(sorted(missing))} must be given")
        return cls(**values)

    def spec(self) -> str:
        return f"interval={self.interval},warmup={self.warmup},order={self.order},lite={int(self.lite)}"

    def cached_steps(self, steps: int) -> int:
        """How many of ``steps`` this schedule extrapolates (the hooks' own rule: after the warm-up, the step one
        past each multiple of ``interval`` is computed)."""
        return sum(1 for i in range(self.warmup, steps) if (i - self.warmup - 1) % self.interval != 0)

    def uncached_note(self, level: StepCacheLevel, steps: int) -> str:
        """Why a job that asked for ``level`` had no step cached: said in its reply, since the image is then exactly
        the uncached one and the caller would otherwise not know the cache did nothing (the tiny model's default 2
        steps are inside every schedule's warm-up). Empty when this schedule caches some of ``steps``."""
        if self.cached_steps(steps):
            return ""
        first = self.warmup + 1  # 1-based: the step right after the warm-up is the first extrapolated one
        return (f"step_cache {level.value}: no step was cached; this denoiser's schedule computes the first "
                f"{self.warmup} steps and caches from step {first} on, and this job ran {steps}")

    def config(self) -> Any:
        from diffusers.hooks import TaylorSeerCacheConfig

        # float32 factors: the library's bfloat16 default would make a cached step differ from run to run of the
        # same seed on some devices, and the factors are small next to the model.
        return TaylorSeerCacheConfig(cache_interval=self.interval, disable_cache_before_step=self.warmup,
                                     max_order=self.order, taylor_factors_dtype=torch.float32,
                                     use_lite_mode=self.lite, cache_identifiers=None if self.lite else [_BLOCKS])


DEFAULT_SCHEDULES = {
    StepCacheLevel.BALANCED: Schedule(interval=2, warmup=3),
    StepCacheLevel.AGGRESSIVE: Schedule(interval=4, warmup=2, lite=True),
}


def supported(transformer: Any) -> bool:
    """Whether this transformer and the installed diffusers can cache steps the way StepCacheRun does."""
    try:
        from diffusers.hooks import TaylorSeerCacheConfig  # noqa: F401
        from diffusers.hooks.hooks import CacheContext, _set_cache_context  # noqa: F401
        from diffusers.hooks.taylorseer_cache import _TAYLORSEER_CACHE_HOOK  # noqa: F401
    except ImportError:
        return False
    return callable(getattr(transformer, "enable_cache", None)) and hasattr(transformer, "transformer_blocks")


class StepCacheRun:
    """One job's step cache: switched on at the first step, each call named, each step told apart as computed or
    extrapolated, and everything removed at ``close()``. With ``schedule`` None every step is computed."""

    def __init__(self, transformer: Any, schedule: Schedule | None) -> None:
        self.transformer = transformer
        self.schedule = schedule
        self.full = 0
        self.cached = 0
        self._on = False
        self._probe: Any = None  # the first block's TaylorSeer hook, whose state says whether a step was computed

    def before_call(self, kwargs: dict) -> None:
        """Before a transformer call of the loop (never an edit's reference pass)."""
        if self.schedule is None:
            return
        from diffusers.hooks.hooks import CacheContext, _set_cache_context

        if not self._on:
            if getattr(self.transformer, "is_cache_enabled", False):
                self.transformer.disable_cache()  # never another job's state
            self.transformer.enable_cache(self.schedule.config())
            # Read, never hooked: a hook inside a block would sit in the compiled region (--compile) and make torch
            # recompile the block for every job. Every level hooks the first block (lite as an inactive module).
            from diffusers.hooks.taylorseer_cache import _TAYLORSEER_CACHE_HOOK

            self._probe = self.transformer.transformer_blocks[0]._diffusers_hook.get_hook(_TAYLORSEER_CACHE_HOOK)
            self._on = True
        drop = kwargs.get("prior_token_drop")
        uncond = drop is not None and drop.numel() > 0 and bool(drop.all())
        _set_cache_context(self.transformer, CacheContext("uncond" if uncond else "cond"))

    def _computed(self) -> bool:
        """Whether the first block really ran at the last call: its state is updated only then (the same rule for
        cond and uncond, so the last call speaks for the step)."""
        state = self._probe.state_manager.get_state()
        return state.last_update_step == state.current_step

    def step_done(self) -> bool:
        """At the end of a step: whether it was extrapolated; counts it."""
        cached = self.schedule is not None and self._on and not self._computed()
        if cached:
            self.cached += 1
        else:
            self.full += 1
        return cached

    def close(self) -> None:
        self._probe = None
        if self._on:
            from diffusers.hooks.hooks import _set_cache_context

            _set_cache_context(self.transformer, None)
            self.transformer.disable_cache()
            self._on = False
