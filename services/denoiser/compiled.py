"""``--compile``: the DiT's repeated transformer blocks through torch.compile, warmed up before SERVING.

Knows nothing of gRPC. ``compile_blocks`` hands every ``GlmImageTransformerBlock`` to torch.compile with diffusers'
own ``ModelMixin.compile_repeated_blocks`` (regional compilation: one block's code, compiled once for all the
blocks, rather than the whole transformer), ``dynamic=True`` so the sequence lengths (image size, glyph text,
references) are symbolic from the first trace instead of recompiled per size. What is still specialized, and so
warmed up by ``warm_up_plan`` rather than met by a request:

- a length of 0 or 1 (torch always specializes those): glyph text of one token, an edit's reference pass;
- the KV cache's mode (none, write, read): a text-to-image job and an edit's passes each trace their own graph,
  and the number of references (a list's length; ``CompileSettings.references``);
- the step cache. Its TaylorSeer hooks replace a block's ``forward`` while a cached job runs, and the compiled
  region is the block's ``__call__``, so torch traces the hook too: its step bookkeeping is
  ``torch.compiler.disable``d by diffusers (a graph break), the block's own computation after it is compiled, and a
  cached step's extrapolation runs eagerly. Each level (active blocks, or lite's inactive blocks, its Taylor order)
  and the first vs later updates of a job trace once; the hooks are new per job but compiled code is keyed on their
  code, not the objects, so a cached job of one seed gives the same image every time and compiles nothing new.

Every graph torch hands to the backend is counted (a wrapper around the backend): that is the compilation count
the denoiser exports as ``glmimage_denoiser_compilations_total``.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from glmimage.wire.sizes import parse_size
from services.denoiser.step_cache import Schedule, StepCacheLevel

log = logging.getLogger(__name__)

# The gateway's default size and the engine's own warm-up size: what a deployment serves unless it says otherwise.
DEFAULT_SIZES: tuple[tuple[int, int], ...] = ((64, 64), (256, 256))
# torch's default (8 per function) is below the variants above; past the limit torch silently runs the function
# eagerly, which the counter would not show.
RECOMPILE_LIMIT = 64
# Glyph texts of 0, 1 and several tokens: torch specializes a length of 0 or 1, so each is warmed up.
WARM_UP_PROMPTS = ("warm-up", 'a "W" sign', 'a sign that says "compiled warm-up text"')


@dataclass(frozen=True)
class CompileSettings:
    sizes: tuple[tuple[int, int], ...] = DEFAULT_SIZES  # (height, width) of the jobs warmed up before SERVING
    # Edits of 1..references references are warmed up: the KV cache keeps one tensor per reference in a Python list,
    # so torch specializes on their count, and an edit with more compiles once, at its first use.
    references: int = 2
    backend: str = "inductor"  # any torch.compile backend; the tests use "eager" (no code generation)


def parse_sizes(spec: str) -> tuple[tuple[int, int], ...]:
    """``WxH,WxH`` (the flag's form, width first as in the REST ``size``; each read by the suite's one size parser)
    -> ((height, width), ...), without repeats."""
    sizes: list[tuple[int, int]] = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        width, height = parse_size(item)
        if (height, width) not in sizes:
            sizes.append((height, width))
    if not sizes:
        raise ValueError("give at least one size, like 256x256")
    return tuple(sizes)


@dataclass
class CompileCounter:
    """Graphs compiled since compile_blocks, counted in the backend (thread-safe: compiling runs on the worker)."""

    graphs: int = 0
    seconds: float = 0.0  # spent inside the backend
    on_compile: Callable[[], None] | None = None  # e.g. the Prometheus counter
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def backend(self, name: str) -> Callable[..., Any]:
        inner = torch._dynamo.lookup_backend(name)

        def counted(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
            t0 = time.perf_counter()
            compiled = inner(gm, example_inputs)
            with self._lock:
                self.graphs += 1
                self.seconds += time.perf_counter() - t0
            if self.on_compile is not None:
                self.on_compile()
            log.debug("compiled a graph of %d nodes", len(gm.graph.nodes))
            return compiled

        return counted


def compile_blocks(transformer: Any, settings: CompileSettings, counter: CompileCounter) -> None:
    """Compile the transformer's repeated blocks in place (lazily: torch traces at the first call)."""
    import torch.fx.experimental._config as fx_config

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    # Without this, lengths equal at the first trace (a reference grid and the image's, say) become one symbol and
    # a request where they differ recompiles. Process-wide, as the recompile limit: a denoiser runs one engine.
    fx_config.use_duck_shape = False
    transformer.compile_repeated_blocks(backend=counter.backend(settings.backend), dynamic=True)


@dataclass(frozen=True)
class WarmUpJob:
    """One job of the compile warm-up; the engine turns it into a DenoiseJob."""

    height: int
    width: int
    prompt: str
    steps: int
    step_cache: StepCacheLevel = StepCacheLevel.OFF
    references: int = 0  # an edit with this many references (grids of distinct sizes)


def warm_up_plan(settings: CompileSettings, schedules: Mapping[StepCacheLevel, Schedule],
                 can_cache: bool) -> list[WarmUpJob]:
    """At every size: each warm-up prompt uncached, each cached level long enough for its schedule's computed and
    extrapolated steps and a third update of its Taylor factors, and edits (1..references) uncached and at each
    level: every variant of the list in this module's docstring, traced before SERVING."""
    levels = [level for level in schedules if can_cache]
    jobs: list[WarmUpJob] = []
    for height, width in settings.sizes:
        jobs += [WarmUpJob(height, width, prompt, steps=2) for prompt in WARM_UP_PROMPTS]
        for references in range(settings.references + 1):
            if references:
                jobs.append(WarmUpJob(height, width, WARM_UP_PROMPTS[1], steps=2, references=references))
            for level in levels:
                schedule = schedules[level]
                jobs.append(WarmUpJob(height, width, WARM_UP_PROMPTS[1], references=references, step_cache=level,
                                      steps=schedule.warmup + 2 * schedule.interval + 2))
    return jobs
