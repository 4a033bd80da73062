"""End-to-end comparison on the real tiny model, in one run (issue 8).

- ours: the whole stack as `make run` starts it (1 AR + 2 denoisers, one torch thread per process), 24 requests at
  256x256 from 8 concurrent REST clients;
- monolithic diffusers.GlmImagePipeline in one process with 2 torch threads, called once per request (as its docs
  show) and with batches of 8 prompts.

Each setup runs REPEATS times, interleaved, and the figures are medians; ratios are taken per round, side by side.
Run: .venv/bin/python -m bench.e2e
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import median, write_result

REQUESTS = 24
CONCURRENCY = 8
SIZE = 256
STEPS = 2
REPEATS = 3
PROMPTS = [f'poster {i} with the words "SALE {i}"' for i in range(REQUESTS)]


def monolithic(mode: str) -> float:
    """Images/s of the one-process pipeline (runs in a fresh subprocess)."""
    import torch
    from diffusers import GlmImagePipeline

    from services.model.tiny import ensure_tiny_checkpoint

    torch.set_num_threads(2)
    pipe = GlmImagePipeline.from_pretrained(ensure_tiny_checkpoint())
    pipe.set_progress_bar_config(disable=True)
    call = dict(height=SIZE, width=SIZE, num_inference_steps=STEPS)
    pipe(prompt="warm-up", generator=torch.Generator().manual_seed(0), **call)
    t0 = time.perf_counter()
    if mode == "loop":
        for i, prompt in enumerate(PROMPTS):
            pipe(prompt=prompt, generator=torch.Generator().manual_seed(i), **call)
    else:
        for start in range(0, REQUESTS, 8):
            batch = PROMPTS[start:start + 8]
            pipe(prompt=batch, generator=[torch.Generator().manual_seed(start + j) for j in range(len(batch))],
                 **call)
    return REQUESTS / (time.perf_counter() - t0)


def run_monolithic(mode: str) -> float:
    out = subprocess.run([sys.executable, "-m", "bench.e2e", "--monolithic", mode], check=True,
                         capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1])


class Stack:
    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="bench-e2e-"))
        ready = self.dir / "ready.json"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.launcher", "--rest-port", "0", "--gateway-port", "0", "--ar-port", "0",
             "--denoiser-ports", "0,0", "--torch-threads", "1", "--ready-file", str(ready), "--log-level", "WARNING"],
            stdout=subprocess.PIPE, text=True)
        for line in self.proc.stdout:
            if line.startswith("GLM-Image stack is up"):
                break
        else:
            raise RuntimeError("the stack did not start")
        self.rest = json.loads(ready.read_text())["rest"]

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


async def _load(rest: str) -> tuple[float, list[float]]:
    import httpx

    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(REQUESTS):
        queue.put_nowait(i)
    latencies: list[float] = []

    async def client(http: httpx.AsyncClient) -> None:
        while not queue.empty():
            i = queue.get_nowait()
            t0 = time.perf_counter()
            r = await http.post(f"http://{rest}/v1/images/generations",
                                json={"prompt": PROMPTS[i], "size": f"{SIZE}x{SIZE}", "seed": i,
                                      "num_inference_steps": STEPS})
            r.raise_for_status()
            latencies.append(time.perf_counter() - t0)

    async with httpx.AsyncClient(timeout=300) as http:
        await http.post(f"http://{rest}/v1/images/generations", json={"prompt": "warm-up", "size": "256x256"})
        t0 = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(CONCURRENCY)))
        return REQUESTS / (time.perf_counter() - t0), latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--monolithic", choices=["loop", "batch"], help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=REPEATS)
    args = parser.parse_args()
    if args.monolithic:
        print(monolithic(args.monolithic))
        return
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    rounds = []
    for r in range(args.repeats):
        loop_ips = run_monolithic("loop")
        batch_ips = run_monolithic("batch")
        stack = Stack()
        try:
            ours_ips, lat = asyncio.run(_load(stack.rest))
        finally:
            stack.close()
        rounds.append({"ours_img_s": ours_ips, "monolithic_loop_img_s": loop_ips, "monolithic_batch8_img_s": batch_ips,
                       "ours_over_loop": ours_ips / loop_ips, "ours_over_batch8": ours_ips / batch_ips,
                       "ours_latency_median_s": median(lat)})
        print(f"round {r + 1}: ours {ours_ips:.2f} img/s, loop {loop_ips:.2f}, batch8 {batch_ips:.2f}")
    keys = rounds[0].keys()
    summary = {k: median([rd[k] for rd in rounds]) for k in keys}
    write_result("e2e", {"setup": {"requests": REQUESTS, "concurrency": CONCURRENCY, "size": SIZE, "steps": STEPS,
                                   "ours": "1 AR + 2 denoisers, 1 torch thread each, via REST",
                                   "monolithic": "diffusers.GlmImagePipeline, 2 torch threads, one process"},
                         "median": summary, "rounds": rounds, "target": {"ours_over_loop": 2.0}},
                 command=".venv/bin/python -m bench.e2e")


if __name__ == "__main__":
    main()
