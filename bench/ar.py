"""AR stage throughput on the tiny model at 256x256: the service engine at batch 1, 2, 4, 8, and the diffusers
pipeline's own batched `generate_prior_tokens` at batch 1 and 8 for reference. Writes bench/results/ar.json.

Run from the repo root: `.venv/bin/python -m bench.ar`. Rounds are interleaved (every configuration once per
round), so a change in machine load during the run hits all of them alike; figures are medians over the rounds.
"""
from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable

import torch

from bench.common import median, timed, write_result

SIZE = 256
BATCH_SIZES = (1, 2, 4, 8)
PIPELINE_SIZES = (1, 8)
# Different lengths, as a gateway batch has: left padding is part of what is measured.
PROMPTS = [
    'a red "STOP" sign',
    "a lighthouse on a cliff at dawn, waves breaking below",
    "cat",
    'a hand-painted shop sign that reads "OPEN ALL NIGHT" above a small bakery',
    "mountains",
    "an astronaut riding a horse across a salt flat, photographed at noon",
    "two cups of coffee on a wooden table",
    'a poster with the words "GLM-Image" in bold letters',
]


def summarize(seconds: list[float], batch: int, tokens_per_output: int) -> dict[str, float]:
    m = median(seconds)
    return {"batch_seconds_median": round(m, 4), "per_output_seconds": round(m / batch, 4),
            "tokens_per_second": round(batch * tokens_per_output / m, 1), "runs": len(seconds)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=7, help="measured rounds after one warm-up round (>= 5)")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)

    from diffusers import GlmImagePipeline

    from services.ar.domain import ArRequest
    from services.ar.engine import ArEngine

    engine = ArEngine.load(None, device="cpu")  # the tiny default checkpoint, built offline on first use
    pipe = GlmImagePipeline(tokenizer=None, processor=engine.processor, text_encoder=None,
                            vision_language_encoder=engine.model, vae=None, transformer=None, scheduler=None)
    cpu = torch.device("cpu")

    def service(b: int) -> Callable[[], object]:
        reqs = [ArRequest(prompt=PROMPTS[i], n=1, height=SIZE, width=SIZE, seed=i) for i in range(b)]
        return lambda: engine.generate(reqs)

    def pipeline(b: int) -> Callable[[], object]:
        return lambda: pipe.generate_prior_tokens(PROMPTS[:b], SIZE, SIZE, device=cpu,
                                                  generator=torch.Generator().manual_seed(0))

    runs = {("service", b): service(b) for b in BATCH_SIZES} | {("pipeline", b): pipeline(b) for b in PIPELINE_SIZES}
    tokens_per_output = engine.generate([ArRequest(PROMPTS[0], 1, SIZE, SIZE, seed=0)])[0].outputs[0] \
        .usage.completion_tokens
    load_before = os.getloadavg()
    for fn in runs.values():  # warm-up round
        fn()
    seconds: dict[tuple[str, int], list[float]] = {key: [] for key in runs}
    for _ in range(args.repeats):
        for key, fn in runs.items():
            seconds[key] += timed(fn, 1)
    load_after = os.getloadavg()

    def table(kind: str, sizes: tuple[int, ...]) -> dict[str, dict[str, float]]:
        return {str(b): summarize(seconds[(kind, b)], b, tokens_per_output) for b in sizes}

    service_table, pipeline_table = table("service", BATCH_SIZES), table("pipeline", PIPELINE_SIZES)

    def speedup(t: dict[str, dict[str, float]]) -> float:
        return round(t["1"]["per_output_seconds"] / t["8"]["per_output_seconds"], 2)

    data = {
        "setup": {"model": "tiny random-weight GLM-Image (services.model.tiny)", "size": f"{SIZE}x{SIZE}",
                  "device": "cpu", "torch_threads": args.threads, "rounds": args.repeats,
                  "tokens_per_output": tokens_per_output,
                  "load_average_1m_before_after": [round(load_before[0], 2), round(load_after[0], 2)],
                  "note": "per_output_seconds = median batch time / batch size; the service runs every prompt and "
                          "output of a batch as one model.generate with per-row generators"},
        "service_engine": {"by_batch_size": service_table, "speedup_b8_over_b1": speedup(service_table)},
        "diffusers_pipeline": {"by_batch_size": pipeline_table, "speedup_b8_over_b1": speedup(pipeline_table)},
        "target": "service speedup_b8_over_b1 >= 4",
    }
    write_result("ar", data, "python -m bench.ar")
    for kind, t in (("service", service_table), ("pipeline", pipeline_table)):
        for b, row in t.items():
            print(f"{kind:8s} batch {b}: {row['per_output_seconds']:.3f} s/output, "
                  f"{row['tokens_per_second']:.0f} tok/s")
    print(f"speed-up at batch 8 over batch 1 (per output): service {data['service_engine']['speedup_b8_over_b1']}x, "
          f"pipeline {data['diffusers_pipeline']['speedup_b8_over_b1']}x")


if __name__ == "__main__":
    main()
