"""Denoiser costs on the tiny model (`make bench`, denoiser part): step time, VAE decode time, encode time.

In one process, with torch limited to 2 threads, through the real DenoiseEngine (diffusers GlmImagePipeline):
- per-step time at 256x256 and 512x512: each step timed from its first DiT forward to the end of the scheduler step
  (the same measure as the glmimage_denoiser_step_seconds metric), median over every step of every repeat;
- VAE decode time at those sizes: latents -> PIL image, median over the repeats;
- PNG (levels 1, 6, 9) vs JPEG vs WebP (quality 90) encode time at 1024x1024, for two images: the tiny model's own
  output decoded at 1024x1024 (random weights: noise-like, the hard case for PNG), and a smooth gradient with mild
  grain (compresses like a photo). Median over the repeats.

The weights are random, so these are the serving overheads around a model, not real GLM-Image speed.
Writes bench/results/denoiser.json.

    .venv/bin/python -m bench.denoiser [--repeats 5] [--steps 10]
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

import numpy as np
import torch
from PIL import Image

from bench.common import median, timed, write_result
from services.denoiser.encoding import ImageFormat, encode
from services.denoiser.engine import TOKEN_PATCH, DenoiseEngine, DenoiseJob, JobControl

log = logging.getLogger("bench.denoiser")

TORCH_THREADS = 2
SIZES = (256, 512)
ENCODE_SIZE = 1024
PROMPT = 'A red sign that says "HELLO"'
ENCODINGS = {  # name -> (format, output_compression): PNG's zlib level is (100 - output_compression) * 9 / 100
    "png_level1": (ImageFormat.PNG, 89),
    "png_level6": (ImageFormat.PNG, 33),
    "png_level9": (ImageFormat.PNG, 0),
    "jpeg_q90": (ImageFormat.JPEG, 90),
    "webp_q90": (ImageFormat.WEBP, 90),
}


def job_at(engine: DenoiseEngine, size: int, steps: int) -> DenoiseJob:
    n = (size // TOKEN_PATCH) ** 2
    return engine.validate(DenoiseJob(prompt=PROMPT, token_ids=[(7 + i) % engine.codebook_size for i in range(n)],
                                      height=size, width=size, steps=steps, seed=1))


def bench_size(engine: DenoiseEngine, size: int, steps: int, repeats: int) -> dict[str, Any]:
    job = job_at(engine, size, steps)
    engine.denoise(job)  # warm-up: first-call allocations at this size
    step_times: list[float] = []
    for _ in range(repeats):
        control = JobControl()
        latents = engine.denoise(job, control)
        step_times += control.step_seconds
    decode = timed(lambda: engine.decode(latents), repeats)
    return {"steps_per_run": steps, "runs": repeats, "step_seconds_median": median(step_times),
            "step_seconds_min": min(step_times), "step_seconds_max": max(step_times),
            "vae_decode_seconds_median": median(decode)}


def photo_like(size: int) -> Image.Image:
    y, x = np.mgrid[0:size, 0:size].astype(np.float32) / size
    rgb = np.stack([x, y, (x + y) / 2], axis=-1) * 255 + np.random.default_rng(0).normal(0, 3, (size, size, 3))
    return Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8))


def bench_encode(image: Image.Image, repeats: int) -> dict[str, Any]:
    out = {}
    for name, (fmt, compression) in ENCODINGS.items():
        data = encode(image, fmt, compression)  # warm-up, and the size
        seconds = timed(lambda fmt=fmt, compression=compression: encode(image, fmt, compression), repeats)
        out[name] = {"seconds_median": median(seconds), "bytes": len(data)}
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=10, help="denoising steps per timed run")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    for noisy in ("diffusers", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    torch.set_num_threads(TORCH_THREADS)
    load_before = os.getloadavg()
    engine = DenoiseEngine.load(None, device="cpu")
    engine.warm_up()

    sizes = {}
    for size in SIZES:
        sizes[f"{size}x{size}"] = bench_size(engine, size, args.steps, args.repeats)
        log.info("%dx%d: %s", size, size, sizes[f"{size}x{size}"])
    model_image = engine.decode(engine.denoise(job_at(engine, ENCODE_SIZE, 2)))
    encodes = {"tiny_model_output": bench_encode(model_image, args.repeats),
               "gradient_with_grain": bench_encode(photo_like(ENCODE_SIZE), args.repeats)}
    log.info("encode at %d: %s", ENCODE_SIZE, encodes)

    write_result("denoiser", {
        "model": "tiny random-weight GLM-Image (services.model.tiny), float32 on the CPU",
        "torch_threads": TORCH_THREADS, "repeats": args.repeats,
        "load_average_1m": {"before": load_before[0], "after": os.getloadavg()[0]},
        "sizes": sizes,
        "encode_1024x1024": encodes,
        "notes": ("step time: first DiT forward to end of scheduler step, CFG on (guidance 1.5: two DiT calls per "
                  "step); decode: VAE latents -> PIL; encode: Pillow, one image, in this process"),
    }, command=" ".join(["python -m bench.denoiser", *(sys.argv[1:] if argv is None else argv)]))
    for size, row in sizes.items():
        print(f"{size}: step {row['step_seconds_median'] * 1e3:.1f} ms, "
              f"VAE decode {row['vae_decode_seconds_median'] * 1e3:.1f} ms")
    for image, rows in encodes.items():
        print(f"encode {ENCODE_SIZE}x{ENCODE_SIZE} {image}: " + ", ".join(
            f"{name} {row['seconds_median'] * 1e3:.1f} ms ({row['bytes'] // 1024} KiB)" for name, row in rows.items()))


if __name__ == "__main__":
    main()
