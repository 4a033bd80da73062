"""--compile on the denoiser, on the tiny model on this CPU: does compiling the DiT's blocks pay?

For each backend (none: uncompiled; eager: dynamo's tracing alone; inductor: torch.compile's default, generated C++),
in a fresh process each (dynamo's caches are process-wide), with torch at 1 thread:
- warm-up seconds: DenoiseEngine.warm_up() with --compile-sizes 256x256,512x512 and no edits (the compile cost a
  server pays before SERVING; uncompiled: its one 64x64 warm-up job), and the graphs compiled. Inductor runs twice:
  cold, with an empty on-disk cache (TORCHINDUCTOR_CACHE_DIR), then "inductor_cached" on the cache the first run left,
  as a restart on the same disk would;
- denoise-loop seconds per job at 256x256 and 512x512 (engine.denoise: glyph encoding + every step, CFG on),
  median of the repeats, after one untimed job at that size; and the graphs compiled during the timed jobs (0 is
  the contract).

The weights are random, so these are the tiny model's costs, not real GLM-Image speed. Writes
bench/results/compile.json.

    .venv/bin/python -m bench.compile [--repeats 5] [--steps 10] [--backends none,eager,inductor]
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

from bench.common import median, write_result

TORCH_THREADS = 1
SIZES = ((256, 256), (512, 512))
PROMPT = 'A red sign that says "HELLO"'


def one(backend: str, repeats: int, steps: int) -> dict[str, Any]:
    from services.denoiser.compiled import CompileSettings
    from services.denoiser.engine import TOKEN_PATCH, DenoiseEngine, DenoiseJob, DenoiseSettings

    torch.set_num_threads(TORCH_THREADS)
    compile_settings = None if backend == "none" else CompileSettings(sizes=SIZES, references=0, backend=backend)
    engine = DenoiseEngine.load(None, device="cpu", settings=DenoiseSettings(compile=compile_settings))
    t0 = time.perf_counter()
    engine.warm_up()
    out: dict[str, Any] = {"warm_up_seconds": time.perf_counter() - t0, "warm_up_graphs": engine.compilations.graphs,
                           "sizes": {}}
    for height, width in SIZES:
        n = (height // TOKEN_PATCH) * (width // TOKEN_PATCH)
        job = engine.validate(DenoiseJob(prompt=PROMPT, token_ids=[(7 + i) % engine.codebook_size for i in range(n)],
                                         height=height, width=width, steps=steps, seed=1))
        engine.denoise(job)
        before, seconds = engine.compilations.graphs, []
        for _ in range(repeats):
            t0 = time.perf_counter()
            engine.denoise(job)
            seconds.append(time.perf_counter() - t0)
        out["sizes"][f"{width}x{height}"] = {"denoise_seconds_median": median(seconds), "denoise_seconds": seconds,
                                            "graphs_compiled_while_timed": engine.compilations.graphs - before}
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=10, help="denoising steps per timed job")
    p.add_argument("--backends", default="none,eager,inductor")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the child process: one backend, JSON out
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.one:
        print(json.dumps(one(args.one, args.repeats, args.steps)))
        return
    load_before = os.getloadavg()
    backends: dict[str, Any] = {}
    runs = [(b, b) for b in args.backends.split(",")]
    if "inductor" in args.backends.split(","):
        runs.append(("inductor_cached", "inductor"))
    with tempfile.TemporaryDirectory(prefix="bench-inductor-") as cache:
        for name, backend in runs:
            child = subprocess.run([sys.executable, "-m", "bench.compile", "--one", backend, "--repeats",
                                    str(args.repeats), "--steps", str(args.steps)], capture_output=True, text=True,
                                   check=True, env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache})
            backends[name] = row = json.loads(child.stdout.strip().splitlines()[-1])
            print(f"{name}: warm-up {row['warm_up_seconds']:.1f} s ({row['warm_up_graphs']} graphs); " + ", ".join(
                f"{size} {r['denoise_seconds_median']:.3f} s/job" for size, r in row["sizes"].items()), flush=True)
    write_result("compile", {
        "model": "tiny random-weight GLM-Image (services.model.tiny), float32 on the CPU",
        "torch": torch.__version__, "torch_threads": TORCH_THREADS, "repeats": args.repeats, "steps": args.steps,
        "load_average_1m": {"before": load_before[0], "after": os.getloadavg()[0]},
        "backends": backends,
        "notes": ("warm-up: DenoiseEngine.warm_up() (compiled: --compile-sizes 256x256,512x512, no edits; none: one "
                  "64x64 job); denoise: glyph encoding + the loop, CFG on (two DiT calls per step), median"),
    }, command=" ".join(["python -m bench.compile", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    main()
