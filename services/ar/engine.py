"""The local AR engine: GLM-Image's autoregressive stage through the real transformers classes.

Every prompt of a batch and all their outputs run as one left-padded `model.generate` call; each row samples with
its own generator (see sampling.py), so an output depends only on its prompt, references, size, sampling and seed.
An edit's rows carry its reference images (the model encodes them into the prompt) and generate the target grid
only; the references' own tokens, which the denoiser needs, are computed once per request, not per output.
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

from runtime.errors import InvalidArgument
from runtime.limits import SEED_SPACE, Limits
from services.ar.domain import (
    ArRequest,
    ArResult,
    ReferenceTokens,
    RequestInvalid,
    RunControl,
    Sampling,
    prior_output,
    row_seeds,
    upsample_grid,
    validate,
)
from services.ar.prompts import EncodedPrompt, PromptEncoder
from services.ar.sampling import ControlStop, RowParams, RowSampler, resolve
from services.model.device import device_name, resolve_device, resolve_dtype
from services.model.loading import checkpoint_root, require_parts
from services.model.tiny import AR_PARTS

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


# Decoding steps of the warm-up: enough to run the decoding step's kernels with a KV cache behind them, not a whole
# image's worth.
WARM_UP_TOKENS = 8


class ArEngine:
    def __init__(self, processor, model, device: torch.device, limits: Limits = DEFAULT_LIMITS) -> None:
        self.processor = processor
        self.prompts = PromptEncoder(processor)
        self.model = model
        self.device = device
        self.device_name = device_name(device)
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

    def _encode(self, requests: Sequence[ArRequest]) -> list[EncodedPrompt]:
        """Each request's prompt, once per request, not per output; a reference that does not decode fails the
        batch, naming its request."""
        prompts = []
        for i, req in enumerate(requests):
            try:
                prompts.append(self.prompts.encode(req.prompt, req.height, req.width, req.reference_images))
            except InvalidArgument as exc:
                raise RequestInvalid(i, exc) from None
        return prompts

    def _rows(self, requests: Sequence[ArRequest], prompts: Sequence[EncodedPrompt]) -> list[_Row]:
        rows = []
        for i, (req, encoded) in enumerate(zip(requests, prompts, strict=True)):
            params = resolve(req.sampling, self.model_sampling)
            rows += [_Row(i, encoded, seed, params) for seed in row_seeds(req, secrets.randbelow(SEED_SPACE))]
        return rows

    def _reference_tokens(self, prompt: EncodedPrompt) -> tuple[ReferenceTokens, ...]:
        """An edit's references as the denoiser takes them: each one's VQ codes, upsampled 2x, grid doubled."""
        if not prompt.references or prompt.pixel_values is None:
            return ()
        grids = prompt.reference_grids.to(self.device)
        features = self.model.get_image_features(prompt.pixel_values.to(self.device), grids).pooler_output
        codes = self.model.get_image_tokens(features, grids)
        return tuple(ReferenceTokens(upsample_grid(chunk.tolist(), h, w), grid_height=2 * h, grid_width=2 * w)
                     for chunk, (_, h, w) in zip(torch.split(codes, grids.prod(-1).tolist()), grids.tolist(),
                                                 strict=True))

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
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "image_grid_thw": grids,
                  "images_per_sample": images_per_sample}
        pixels = [r.prompt.pixel_values for r in rows if r.prompt.pixel_values is not None]
        if pixels:  # an edit: every row's references, in row order (the model splits them by images_per_sample)
            inputs["pixel_values"] = torch.cat(pixels)
        return {k: v.to(self.device) for k, v in inputs.items()}

    @torch.inference_mode()
    def generate(self, requests: Sequence[ArRequest], control: RunControl | None = None) -> list[ArResult]:
        """Run validated requests of one resolution as one model batch; output i of a request uses seed + i."""
        if control is not None:
            control.check()  # dropped before it starts: the caller is gone
        t0 = time.perf_counter()
        prompts = self._encode(requests)
        rows = self._rows(requests, prompts)
        plan = rows[0].prompt.plan
        inputs = self._batch_inputs(rows)
        out = self._generate_tokens(inputs, rows, plan.max_new_tokens, control)
        if control is not None:
            control.check()
        generated = out[:, inputs["input_ids"].shape[1]:].tolist()
        outputs: list[list] = [[] for _ in requests]
        for i, (row, tokens) in enumerate(zip(rows, generated, strict=True)):
            outputs[row.request].append(prior_output(
                tokens, plan, seed=row.seed, prompt_tokens=row.prompt.prompt_tokens,
                image_tokens=row.prompt.image_tokens, eos_token_ids=self.eos_token_ids,
                codebook_size=self.codebook_size, index=i))
        references = [self._reference_tokens(p) for p in prompts]
        r0 = requests[0]
        log.info("AR batch: %d request(s) (%d reference image(s)), %d row(s) at %dx%d in %.2fs", len(requests),
                 sum(p.references for p in prompts), len(rows), r0.width, r0.height, time.perf_counter() - t0)
        return [ArResult(outputs=o, height=r.height, width=r.width, references=refs)
                for o, r, refs in zip(outputs, requests, references, strict=True)]

    def _generate_tokens(self, inputs: dict[str, torch.Tensor], rows: Sequence[_Row], max_new_tokens: int,
                         control: RunControl | None) -> torch.Tensor:
        generators = [torch.Generator(device=self.device).manual_seed(r.seed) for r in rows]
        config = copy.deepcopy(self._greedy)
        config.max_new_tokens = max_new_tokens
        stopping = StoppingCriteriaList([ControlStop(control)] if control is not None else [])
        return self.model.generate(
            **inputs, generation_config=config, stopping_criteria=stopping,
            logits_processor=LogitsProcessorList([RowSampler([r.params for r in rows], generators, self.device)]))

    @torch.inference_mode()
    def warm_up(self) -> None:
        """A text-to-image prompt's prefill and its first WARM_UP_TOKENS decoding steps: every kernel and path a
        request runs (its other tokens repeat the decoding step), for a few percent of even a 64x64 image's some 260
        tokens (the ~256-token preview grid is generated at every size)."""
        t0 = time.perf_counter()
        request = ArRequest(prompt="warm-up", n=1, height=64, width=64, seed=0)
        prompts = self._encode([request])
        rows = self._rows([request], prompts)
        self._generate_tokens(self._batch_inputs(rows), rows, WARM_UP_TOKENS, None)
        log.info("AR warmed up (%d tokens) in %.2fs", WARM_UP_TOKENS, time.perf_counter() - t0)
