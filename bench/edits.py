"""What an edit costs against text-to-image, per stage, on the tiny model (`make bench`, edits part).

In one process, torch at 2 threads, through the real engines:
- AR: one request at 256x256 and 512x512, text-to-image against an edit with one reference of the target's size
  (the edit's prompt carries the reference's image tokens; it generates the target grid only, no preview grid);
  and the AR time of an n=4 edit over an n=1 edit at 256x256 (target: at most 1.5x, the n rows share one batch);
- denoiser: the denoising loop (N steps) at both sizes, text-to-image against the same job conditioned on the
  reference (VAE-encoded, the DiT's reference KV cache written once, then read every step).
Rounds are interleaved (every configuration once per round); figures are medians. Writes bench/results/edits.json.

The weights are random: these are the serving costs around the model, not GLM-Image's real speed.

    .venv/bin/python -m bench.edits [--repeats 5] [--steps 4]
"""
from __future__ import annotations

import argparse
import io
import logging
import os
import sys
from collections.abc import Callable

import torch
from PIL import Image

from bench.common import median, timed, write_result

TORCH_THREADS = 2
SIZES = (256, 512)
PROMPT = 'the same street at night, a sign that says "OPEN"'
N_TARGET = 1.5


def reference(size: int) -> bytes:
    """A smooth gradient PNG, the reference an edit starts from."""
    image = Image.linear_gradient("L").resize((size, size)).convert("RGB")
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5, help="measured rounds after one warm-up round")
    p.add_argument("--steps", type=int, default=4, help="denoising steps per timed run")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(TORCH_THREADS)

    from services.ar.domain import ArRequest
    from services.ar.engine import ArEngine
    from services.denoiser.engine import DenoiseEngine, DenoiseJob, JobControl

    ar = ArEngine.load(None, device="cpu")  # the tiny default checkpoint, built offline on first use
    dn = DenoiseEngine.load(None, device="cpu")
    refs = {size: reference(size) for size in SIZES}

    def ar_request(size: int, n: int = 1, edit: bool = True) -> ArRequest:
        return ar.validate(ArRequest(prompt=PROMPT, n=n, height=size, width=size, seed=1,
                                     reference_images=(refs[size],) if edit else ()))

    runs: dict[str, Callable[[], object]] = {}
    jobs: dict[str, DenoiseJob] = {}
    for size in SIZES:
        t2i, edit = ar_request(size, edit=False), ar_request(size)
        runs[f"ar_t2i_{size}"] = lambda r=t2i: ar.generate([r])
        runs[f"ar_edit_{size}"] = lambda r=edit: ar.generate([r])
        (result,) = ar.generate([edit])
        tokens = list(result.references)  # the AR's reference tokens are what the denoiser takes
        prior = list(result.outputs[0].token_ids)
        base = DenoiseJob(prompt=PROMPT, token_ids=prior, height=size, width=size, steps=args.steps, seed=1)
        jobs[f"dn_t2i_{size}"] = dn.validate(base)
        jobs[f"dn_edit_{size}"] = dn.validate(DenoiseJob(prompt=PROMPT, token_ids=prior, height=size, width=size,
                                                         steps=args.steps, seed=1, reference_images=[refs[size]],
                                                         references=tokens))
    n4 = ar_request(256, n=4)
    runs["ar_edit_256_n4"] = lambda: ar.generate([n4])
    for name, job in jobs.items():
        runs[name] = lambda job=job: dn.denoise(job, JobControl())

    load_before = os.getloadavg()
    for fn in runs.values():  # warm-up round: first-call allocations at each size
        fn()
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, fn in runs.items():
            seconds[name] += timed(fn, 1)
    med = {name: round(median(s), 4) for name, s in seconds.items()}

    def ratio(a: str, b: str) -> float:
        return round(med[a] / med[b], 3)

    stages = {f"{size}x{size}": {
        "ar_t2i_s": med[f"ar_t2i_{size}"], "ar_edit_s": med[f"ar_edit_{size}"],
        "ar_edit_over_t2i": ratio(f"ar_edit_{size}", f"ar_t2i_{size}"),
        "denoise_t2i_s": med[f"dn_t2i_{size}"], "denoise_edit_s": med[f"dn_edit_{size}"],
        "denoise_edit_over_t2i": ratio(f"dn_edit_{size}", f"dn_t2i_{size}"),
    } for size in SIZES}
    n4_over_n1 = ratio("ar_edit_256_n4", "ar_edit_256")
    write_result("edits", {
        "setup": {"model": "tiny random-weight GLM-Image (services.model.tiny), float32 on the CPU",
                  "torch_threads": TORCH_THREADS, "repeats": args.repeats, "denoise_steps": args.steps,
                  "reference": "one PNG of the target's size",
                  "load_average_1m_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)]},
        "by_size": stages,
        "ar_edit_n4_over_n1_256": n4_over_n1,
        "target": f"ar_edit_n4_over_n1_256 <= {N_TARGET}",
        "meets_target": n4_over_n1 <= N_TARGET,
    }, command=" ".join(["python -m bench.edits", *(sys.argv[1:] if argv is None else argv)]))
    for size, row in stages.items():
        print(f"{size}: AR t2i {row['ar_t2i_s']:.3f} s, edit {row['ar_edit_s']:.3f} s ({row['ar_edit_over_t2i']}x); "
              f"denoise t2i {row['denoise_t2i_s']:.3f} s, edit {row['denoise_edit_s']:.3f} s "
              f"({row['denoise_edit_over_t2i']}x)")
    print(f"AR n=4 edit over n=1 edit at 256x256: {n4_over_n1}x (target <= {N_TARGET})")


if __name__ == "__main__":
    main()
