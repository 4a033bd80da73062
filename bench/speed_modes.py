"""The step cache's speed modes on the tiny model (`make bench`, speed-modes part): for each level, the steps
computed, the denoise loop's wall time as a ratio to `off` measured side by side, and the image's fidelity to the
`off` image (PSNR and the largest absolute pixel difference).

In one process, through the real DenoiseEngine, at 256x256 and 512x512 with `--steps` steps (default 16). Rounds
alternate the levels' order (off, balanced, aggressive, then reversed), so drift in the machine's load favours none;
each figure is the median over rounds, and each ratio is taken within a round, then the median of those. Fidelity
is deterministic (same seed and tokens): decoded images compared in 8-bit RGB.

The weights are random: the ratios show what skipping the blocks saves around this small a model (its blocks are a
small part of a step), and the fidelity figures say nothing about real images. Published figures on real weights
are in BENCHMARKS.md's text. Writes bench/results/speed_modes.json and speed_modes.png.

    .venv/bin/python -m bench.speed_modes [--rounds 9] [--steps 16]
"""
from __future__ import annotations

import argparse
import io
import logging
import math
import os
import sys
import time
from typing import Any

import numpy as np
import torch
from PIL import Image

from bench.common import RESULTS, median, write_result
from services.denoiser.engine import TOKEN_PATCH, DenoiseEngine, DenoiseJob, JobControl
from services.denoiser.step_cache import DEFAULT_SCHEDULES, StepCacheLevel

log = logging.getLogger("bench.speed_modes")

TORCH_THREADS = 2
SIZES = (256, 512)
PROMPT = 'A red sign that says "HELLO"'
LEVELS = tuple(StepCacheLevel)


def job_at(engine: DenoiseEngine, size: int, steps: int, level: StepCacheLevel) -> DenoiseJob:
    n = (size // TOKEN_PATCH) ** 2
    return engine.validate(DenoiseJob(prompt=PROMPT, token_ids=[(7 + i) % engine.codebook_size for i in range(n)],
                                      height=size, width=size, steps=steps, seed=1, step_cache=level))


def pixels(engine: DenoiseEngine, job: DenoiseJob) -> np.ndarray:
    png = engine.run(job).image
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.float64)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a - b) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


def bench_size(engine: DenoiseEngine, size: int, steps: int, rounds: int) -> dict[str, Any]:
    jobs = {level: job_at(engine, size, steps, level) for level in LEVELS}
    for job in jobs.values():
        engine.denoise(job)  # warm-up: first-call allocations at this size, each level's hooks once
    loop: dict[StepCacheLevel, list[float]] = {level: [] for level in LEVELS}
    cached: dict[StepCacheLevel, int] = {}
    ratios: dict[StepCacheLevel, list[float]] = {level: [] for level in LEVELS}
    for r in range(rounds):
        order = LEVELS if r % 2 == 0 else tuple(reversed(LEVELS))
        seconds = {}
        for level in order:
            control = JobControl()
            t0 = time.perf_counter()
            engine.denoise(jobs[level], control)
            seconds[level] = time.perf_counter() - t0 - (control.prepare_seconds or 0.0)  # the loop alone
            cached[level] = control.steps_cached
        for level in LEVELS:
            loop[level].append(seconds[level])
            ratios[level].append(seconds[level] / seconds[StepCacheLevel.OFF])
    reference = pixels(engine, jobs[StepCacheLevel.OFF])
    out: dict[str, Any] = {}
    for level in LEVELS:
        image = pixels(engine, jobs[level])
        out[level.value] = {
            "steps": steps, "steps_cached": cached[level], "steps_computed": steps - cached[level],
            "loop_seconds_median": round(median(loop[level]), 4),
            "loop_ratio_to_off_median": round(median(ratios[level]), 3),
            "loop_ratio_to_off_range": [round(min(ratios[level]), 3), round(max(ratios[level]), 3)],
            "psnr_db_vs_off": round(psnr(image, reference), 2) if level is not StepCacheLevel.OFF else None,
            "max_abs_diff_vs_off": int(np.max(np.abs(image - reference))),
        }
        log.info("%dx%d %-10s cached %2d/%d  loop %.3fs  ratio %.3f  PSNR %s  max diff %d", size, size, level.value,
                 cached[level], steps, out[level.value]["loop_seconds_median"],
                 out[level.value]["loop_ratio_to_off_median"], out[level.value]["psnr_db_vs_off"],
                 out[level.value]["max_abs_diff_vs_off"])
    return out


def plot(results: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.35
    for i, size in enumerate(results):
        levels = list(results[size])
        xs = [x + i * width for x in range(len(levels))]
        ax1.bar(xs, [results[size][lv]["loop_ratio_to_off_median"] for lv in levels], width, label=size)
        ax2.bar(xs, [results[size][lv]["steps_computed"] for lv in levels], width, label=size)
    for ax, title in ((ax1, "denoise loop time / off (median)"), (ax2, "steps computed")):
        ax.set_xticks([x + width / 2 for x in range(len(LEVELS))], [lv.value for lv in LEVELS])
        ax.set_title(title)
        ax.legend()
    fig.suptitle("Step cache on the tiny random-weight model")
    fig.tight_layout()
    fig.savefig(RESULTS / "speed_modes.png", dpi=100)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--steps", type=int, default=16)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(TORCH_THREADS)
    from services.model.tiny import ensure_tiny_checkpoint

    engine = DenoiseEngine.load(ensure_tiny_checkpoint(), device="cpu")
    results = {f"{size}x{size}": bench_size(engine, size, args.steps, args.rounds) for size in SIZES}
    plot(results)
    schedules = {level.value: schedule.spec() for level, schedule in DEFAULT_SCHEDULES.items()}
    write_result("speed_modes", {"setup": {"rounds": args.rounds, "steps": args.steps, "torch_threads": TORCH_THREADS,
                                           "schedules": schedules, "model": "tiny random weights"},
                                 "sizes": results},
                 f"python -m bench.speed_modes {' '.join(sys.argv[1:] if argv is None else argv)}".strip())


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
