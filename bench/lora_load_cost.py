"""The cost of loading a LoRA adapter, for bench/lora_sim.py: measured on the tiny model with the denoiser's own code
path (services.denoiser.adapters.AdapterCache: read, check, load_lora_adapter, LRU eviction) over adapters of several
ranks and module counts, fitted as fixed + per module + per byte, and scaled to a rank-64 adapter on the real DiT's
attention projections. The measurement is cached in bench/results/lora_sim.json (--remeasure repeats it).
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import RESULTS

# The real DiT (zai-org/GLM-Image transformer): diffusers' GlmImageTransformer2DModel with 30 layers and 32 heads of
# 128 (inner dim 4096) has 6.93e9 parameters, DESIGN.md's 6.9B (the class's defaults, 64 x 40, have 2.9e9).
REAL_LAYERS = 30
REAL_DIM = 4096
REAL_RANK = 64
REAL_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")  # square DIM x DIM projections in every block's attention
REAL_DTYPE_BYTES = 2  # bf16, as diffusers' save_lora_adapter writes a bf16 model's adapter


def real_adapter() -> dict[str, int]:
    modules = REAL_LAYERS * len(REAL_TARGETS)
    params = modules * REAL_RANK * (REAL_DIM + REAL_DIM)  # lora_A r x in, lora_B out x r
    return {"rank": REAL_RANK, "modules": modules, "params": params, "bytes": params * REAL_DTYPE_BYTES}


def measure_tiny_load(ranks: Sequence[int] = (8, 512, 4096), repeats: int = 7) -> dict[str, Any]:
    """Seconds the denoiser's AdapterCache spends on one load (a miss with capacity 1, so each also evicts) on the
    tiny DiT, the least of ``repeats`` (this machine is shared: the least is the uncontended cost), for adapters of
    each rank over its attention projections, over its blocks' linear layers and over all of them; a least
    squares fit of seconds = fixed + per_module x modules + per_byte x bytes; that fit at the real adapter's size.
    The tiny DiT is 16 wide, so large ranks are what give it megabytes to load (peft takes r > width)."""
    import numpy as np
    import torch
    from diffusers import GlmImageTransformer2DModel
    from safetensors.torch import save_file

    from runtime.limits import Limits
    from services.denoiser.adapters import AdapterCache, AdapterDirectory, LoraRef, linear_targets
    from services.model.tiny import ensure_tiny_checkpoint

    torch.set_num_threads(1)
    transformer = GlmImageTransformer2DModel.from_pretrained(ensure_tiny_checkpoint() / "transformer")
    targets = linear_targets(transformer)
    module_sets = {"attention": [m for m in targets if m.split(".")[-1] in ("to_q", "to_k", "to_v", "0")
                                 and ".attn1." in m],
                   "blocks": [m for m in targets if m.startswith("transformer_blocks.")],
                   "all": sorted(targets)}
    limits = Limits(max_lora_rank=max(ranks), max_lora_bytes=1 << 30)
    points = []
    with tempfile.TemporaryDirectory(prefix="lora-sim-") as tmp:
        root = Path(tmp)
        g = torch.Generator().manual_seed(0)
        for (kind, modules), rank in itertools.product(module_sets.items(), ranks):
            names = [f"{kind}-r{rank}-{i}" for i in range(2)]
            for name in names:
                state = {}
                for m in modules:
                    fan_in, fan_out = targets[m]
                    state[f"{m}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * 0.01
                    state[f"{m}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.01
                save_file(state, str(root / f"{name}.safetensors"))
            cache = AdapterCache(transformer, AdapterDirectory(root), limits, capacity=1)
            cache.activate([LoraRef(names[1], 1.0)])  # warm-up: the first load into a fresh cache
            seconds = [cache.activate([LoraRef(names[i % 2], 1.0)]) for i in range(repeats)]  # each one a miss
            cache.unload(names)
            size = (root / f"{names[0]}.safetensors").stat().st_size
            points.append({"modules_kind": kind, "modules": len(modules), "rank": rank, "bytes": size,
                           "seconds": round(min(seconds), 6),
                           "median_seconds": round(statistics.median(seconds), 6)})
    a = np.array([[1.0, p["modules"], p["bytes"]] for p in points])
    y = np.array([p["seconds"] for p in points])
    fixed, per_module, per_byte = (float(x) for x in np.linalg.lstsq(a, y, rcond=None)[0])
    real = real_adapter()
    load_s = fixed + per_module * real["modules"] + per_byte * real["bytes"]
    return {"points": points, "fit": {"fixed_s": fixed, "per_module_s": per_module, "per_byte_s": per_byte,
                                      "byte_rate_mb_per_s": round(1e-6 / per_byte, 1) if per_byte > 0 else None},
            "real_adapter": real, "load_s": round(load_s, 4), "torch_threads": 1, "repeats": repeats,
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def load_cost(args: argparse.Namespace) -> dict[str, Any]:
    """The load cost to simulate: --load-seconds, else the cached tiny measurement, else a fresh one."""
    if args.load_seconds is not None:
        return {"source": "--load-seconds", "load_s": args.load_seconds}
    cached = RESULTS / "lora_sim.json"
    if not args.remeasure and cached.exists():
        previous = json.loads(cached.read_text()).get("load_cost", {})
        if previous.get("source") == "tiny model, scaled":
            return previous
    print("measuring adapter loads on the tiny model ...", flush=True)
    return {"source": "tiny model, scaled", **measure_tiny_load()}
