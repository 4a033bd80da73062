"""The local AR engine: GLM-Image's autoregressive stage through the real transformers classes.

Every prompt of a batch and all their outputs run as one left-padded `model.generate` call; each row samples with
its own generator (see sampling.py), so an output depends only on its prompt, size, sampling and seed.
Knows nothing of gRPC: it takes and returns dataclasses and raises domain errors.
Not thread-safe (the model keeps per-call position caches): callers serialize calls.
"""
from __future__ import annotations

import copy
import logging
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList

from services.ar.domain import (
    ArRequest,
    ArResult,
    RunControl,
    Sampling,
    check_batch,
    prior_output,
    row_seeds,
    validate,
)
from services.ar.prompts import EncodedPrompt, PromptEncoder
from services.ar.sampling import ControlStop, RowParams, RowSampler, resolve
from services.model.device import resolve_device, resolve_dtype
from services.model.loading import checkpoint_root, require_parts
from services.model.tiny import AR_PARTS
from services.runtime.limits import SEED_SPACE, Limits

# Kept importable from here: the engine's public vocabulary.
__all__ = ["ArEngine", "ArRequest", "ArResult", "Sampling"]

log = logging.getLogger(__name__)

DEFAULT_LIMITS = Limits()

# Warpers generate() would apply from a checkpoint's generation config that RowSampler does not implement.
_UNSUPPORTED_WARPERS = {"min_p": None, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "top_h": None}


@dataclass(frozen=True)
class _Row:
    request: int  # index into the batch's requests
    prompt: EncodedPrompt
    seed: int
    params: RowParams


class ArEngine:
    def __init__(self, processor, model, device: torch.device, limits: Limits = DEFAULT_LIMITS) -> None:
        self.processor = processor
        self.prompts = PromptEncoder(processor)
        self.model = model
        self.device = device
        self.limits = limits
        gc = model.generation_config
        self.model_sampling = Sampling(temperature=gc.temperature, top_p=gc.top_p, top_k=gc.top_k)
        eos = gc.eos_token_id if gc.eos_token_id is not None else model.config.image_end_token_id
        self.eos_token_ids = frozenset([eos] if isinstance(eos, int) else eos)
        self.codebook_size: int = model.config.vq_config.num_embeddings
        for name, neutral in _UNSUPPORTED_WARPERS.items():
            if getattr(gc, name, None) not in (None, neutral):
                log.warning("generation_config.%s=%r is not applied by the AR service's sampler",
                            name, getattr(gc, name))
        # generate() only argmaxes RowSampler's one-hot scores; neutral sampling fields keep it from warning.
        self._greedy = copy.deepcopy(gc)
        self._greedy.update(do_sample=False, temperature=1.0, top_p=1.0, top_k=50, num_beams=1,
                            num_return_sequences=1)

    @classmethod
    def load(cls, model_path: str | Path | None, device: str = "auto", dtype: str = "auto",
             limits: Limits = DEFAULT_LIMITS) -> ArEngine:
        """Load `processor` + `vision_language_encoder` from a full checkpoint, or from a directory that holds
        just that pair; the tiny default goes through the same path."""
        from transformers import GlmImageForConditionalGeneration, GlmImageProcessor

        dev = resolve_device(device)  # before any weights are read: a missing accelerator fails fast
        torch_dtype = resolve_dtype(dtype, dev)
        root = checkpoint_root(model_path)
        require_parts(root, AR_PARTS, "AR service")
        t0 = time.perf_counter()
        processor = GlmImageProcessor.from_pretrained(root / "processor")
        model = GlmImageForConditionalGeneration.from_pretrained(
            root / "vision_language_encoder", dtype=torch_dtype).to(dev).eval()
        log.info("AR model loaded from %s on %s/%s in %.1fs", root, dev, torch_dtype, time.perf_counter() - t0)
        return cls(processor, model, dev, limits)

    def validate(self, req: ArRequest) -> ArRequest:
        return validate(req, self.limits)

    def _rows(self, requests: Sequence[ArRequest]) -> list[_Row]:
        rows = []
        for i, req in enumerate(requests):
            encoded = self.prompts.encode(req.prompt, req.height, req.width)  # once per prompt, not per output
            params = resolve(req.sampling, self.model_sampling)
            rows += [_Row(i, encoded, seed, params) for seed in row_seeds(req, secrets.randbelow(SEED_SPACE))]
        return rows

    def _batch_inputs(self, rows: Sequence[_Row]) -> dict[str, torch.Tensor]:
        """Left-pad every row to the longest prompt; the mask keeps padding out of attention and mrope positions
        (GLM-Image computes each row's 3D positions from its unmasked tokens and its own image_grid_thw)."""
        width = max(r.prompt.prompt_tokens for r in rows)
        input_ids = torch.full((len(rows), width), self.prompts.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            n = r.prompt.prompt_tokens
            input_ids[i, width - n:] = torch.tensor(r.prompt.input_ids, dtype=torch.long)
            attention_mask[i, width - n:] = 1
        grids = torch.cat([r.prompt.image_grid_thw for r in rows])
        images_per_sample = torch.tensor([r.prompt.image_grid_thw.shape[0] for r in rows], dtype=torch.long)
        return {k: v.to(self.device) for k, v in (("input_ids", input_ids), ("attention_mask", attention_mask),
                                                  ("image_grid_thw", grids), ("images_per_sample", images_per_sample))}

    @torch.inference_mode()
    def generate(self, requests: Sequence[ArRequest], control: RunControl | None = None) -> list[ArResult]:
        """Run validated requests of one resolution as one model batch; output i of a request uses seed + i."""
        check_batch(requests, self.limits)
        if control is not None:
            control.check()  # dropped before it starts: the caller is gone
        t0 = time.perf_counter()
        rows = self._rows(requests)
        plan = rows[0].prompt.plan
        inputs = self._batch_inputs(rows)
        generators = [torch.Generator(device=self.device).manual_seed(r.seed) for r in rows]
        config = copy.deepcopy(self._greedy)
        config.max_new_tokens = plan.max_new_tokens
        stopping = StoppingCriteriaList([ControlStop(control)] if control is not None else [])
        out = self.model.generate(
            **inputs, generation_config=config, stopping_criteria=stopping,
            logits_processor=LogitsProcessorList([RowSampler([r.params for r in rows], generators, self.device)]))
        if control is not None:
            control.check()
        generated = out[:, inputs["input_ids"].shape[1]:].tolist()
        outputs: list[list] = [[] for _ in requests]
        for i, (row, tokens) in enumerate(zip(rows, generated, strict=True)):
            outputs[row.request].append(prior_output(
                tokens, plan, seed=row.seed, prompt_tokens=row.prompt.prompt_tokens,
                eos_token_ids=self.eos_token_ids, codebook_size=self.codebook_size, index=i))
        r0 = requests[0]
        log.info("AR batch: %d request(s), %d row(s) at %dx%d in %.2fs", len(requests), len(rows), r0.width,
                 r0.height, time.perf_counter() - t0)
        return [ArResult(outputs=o, height=r.height, width=r.width) for o, r in zip(outputs, requests, strict=True)]

    def warm_up(self) -> None:
        self.generate([ArRequest(prompt="warm-up", n=1, height=64, width=64, seed=0)])
