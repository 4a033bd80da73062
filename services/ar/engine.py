"""The AR engine: GLM-Image's autoregressive stage through the real transformers classes.

Knows nothing of gRPC: it takes and returns dataclasses and raises domain errors.
Not thread-safe (the sampler reseeds torch's global RNG): callers serialize calls.
"""
from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from services.model.checks import SEED_SPACE, check_prompt, check_seed, model_size
from services.model.device import resolve_device, resolve_dtype
from services.model.loading import checkpoint_root, require_parts
from services.model.tiny import AR_PARTS
from services.runtime.errors import InvalidArgument, ServiceError

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class ArLimits:
    max_prompt_chars: int = 8192
    max_pixels: int = 2048 * 2048
    max_n: int = 16
    max_batch_outputs: int = 32


@dataclass(frozen=True)
class Sampling:
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None


@dataclass(frozen=True)
class ArRequest:
    prompt: str
    n: int
    height: int
    width: int
    seed: int | None = None
    sampling: Sampling = field(default_factory=Sampling)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def __add__(self, other: Usage) -> Usage:
        return Usage(self.prompt_tokens + other.prompt_tokens, self.completion_tokens + other.completion_tokens,
                     self.reasoning_tokens + other.reasoning_tokens, self.cached_tokens + other.cached_tokens)


@dataclass(frozen=True)
class PriorOutput:
    token_ids: list[int]
    seed: int
    usage: Usage


@dataclass(frozen=True)
class ArResult:
    outputs: list[PriorOutput]
    height: int
    width: int

    @property
    def grid(self) -> tuple[int, int]:
        """The token grid the denoiser receives: (H/16, W/16)."""
        return self.height // 16, self.width // 16

    @property
    def usage(self) -> Usage:
        return sum((o.usage for o in self.outputs), Usage())


def validate(req: ArRequest, limits: ArLimits) -> ArRequest:
    """Check a request and normalize it (n default, sizes rounded up to multiples of 32)."""
    check_prompt(req.prompt, limits.max_prompt_chars)
    n = req.n or 1
    if not 1 <= n <= limits.max_n:
        raise InvalidArgument("n", f"must be between 1 and {limits.max_n}, got {req.n}")
    height, width = model_size(req.height, req.width, limits.max_pixels)
    s = req.sampling
    if s.temperature is not None and not 0.0 < s.temperature <= 2.0:
        raise InvalidArgument("sampling.temperature", f"must be in (0, 2], got {s.temperature}")
    if s.top_p is not None and not 0.0 < s.top_p <= 1.0:
        raise InvalidArgument("sampling.top_p", f"must be in (0, 1], got {s.top_p}")
    if s.top_k is not None and s.top_k > 1_000_000:
        raise InvalidArgument("sampling.top_k", f"must be at most 1000000, got {s.top_k}")
    check_seed(req.seed)
    return ArRequest(prompt=req.prompt, n=n, height=height, width=width, seed=req.seed, sampling=s)


class ArEngine:
    def __init__(self, processor, model, device: torch.device, limits: ArLimits = ArLimits()) -> None:
        self.processor = processor
        self.model = model
        self.device = device
        self.limits = limits

    @classmethod
    def load(cls, model_path: str | Path | None, device: str = "auto", dtype: str = "auto",
             limits: ArLimits = ArLimits()) -> ArEngine:
        """Load `processor` + `vision_language_encoder` from a full checkpoint, or from a directory that holds
        just that pair; the tiny default goes through the same path."""
        from transformers import GlmImageForConditionalGeneration, GlmImageProcessor

        root = checkpoint_root(model_path)
        require_parts(root, AR_PARTS, "AR service")
        dev = resolve_device(device)
        torch_dtype = resolve_dtype(dtype, dev)
        t0 = time.perf_counter()
        processor = GlmImageProcessor.from_pretrained(root / "processor")
        model = GlmImageForConditionalGeneration.from_pretrained(
            root / "vision_language_encoder", dtype=torch_dtype).to(dev).eval()
        log.info("AR model loaded from %s on %s/%s in %.1fs", root, dev, torch_dtype, time.perf_counter() - t0)
        return cls(processor, model, dev, limits)

    def validate(self, req: ArRequest) -> ArRequest:
        return validate(req, self.limits)

    def _encode(self, prompt: str, height: int, width: int):
        messages = [[{"role": "user", "content": [{"type": "text", "text": prompt}]}]]
        return self.processor.apply_chat_template(
            messages, tokenize=True, return_dict=True,
            processor_kwargs={"padding": False, "target_h": height, "target_w": width, "return_tensors": "pt"},
        ).to(self.device)

    @staticmethod
    def _grid_plan(image_grid_thw: torch.Tensor) -> tuple[int, int, int, int]:
        """(max_new_tokens, large-grid offset, grid_h, grid_w) for text-to-image.

        The processor lists the target (large) grid first and the preview grid after it; the model emits the
        preview first, then the large grid, then the end token."""
        sizes = [(int(h), int(w)) for _, h, w in image_grid_thw.tolist()]
        total = sum(h * w for h, w in sizes)
        preview = total - sizes[0][0] * sizes[0][1]
        return total + 1, preview, sizes[0][0], sizes[0][1]

    @torch.inference_mode()
    def generate(self, requests: list[ArRequest]) -> list[ArResult]:
        """Run validated requests of one resolution; each output has its own seed (given seed + index)."""
        if len({(r.height, r.width) for r in requests}) > 1:
            raise InvalidArgument("requests", "all requests of a batch must have the same height and width")
        total = sum(r.n for r in requests)
        if total > self.limits.max_batch_outputs:
            raise InvalidArgument("requests", f"{total} outputs exceed --max-batch-outputs "
                                              f"{self.limits.max_batch_outputs}")
        return [self._generate_one(r) for r in requests]

    def _generate_one(self, req: ArRequest) -> ArResult:
        inputs = self._encode(req.prompt, req.height, req.width)
        max_new, offset, gh, gw = self._grid_plan(inputs["image_grid_thw"])
        input_len = inputs["input_ids"].shape[-1]
        prompt_tokens = int(inputs["attention_mask"].sum())
        base_seed = req.seed if req.seed is not None else secrets.randbelow(SEED_SPACE)
        sampling = {k: v for k, v in (("temperature", req.sampling.temperature), ("top_p", req.sampling.top_p),
                                      ("top_k", req.sampling.top_k)) if v is not None}
        outputs = []
        for i in range(req.n):
            seed = (base_seed + i) % SEED_SPACE
            # transformers' generate() takes no generator: seed the global RNG (calls are serialized).
            torch.manual_seed(seed)
            out = self.model.generate(**inputs, max_new_tokens=max_new, do_sample=True, **sampling)
            generated = out[0, input_len:]
            large = generated[offset:offset + gh * gw]
            if large.numel() != gh * gw:
                raise ServiceError(f"the AR model stopped after {generated.numel()} of {max_new} tokens")
            # Nearest 2x upsampling, as the pipeline does: the DiT works on the (H/16, W/16) grid.
            ids = large.view(gh, gw).repeat_interleave(2, 0).repeat_interleave(2, 1).reshape(-1)
            outputs.append(PriorOutput(token_ids=ids.tolist(), seed=seed,
                                       usage=Usage(prompt_tokens=prompt_tokens,
                                                   completion_tokens=int(generated.numel()))))
        return ArResult(outputs=outputs, height=req.height, width=req.width)

    def warm_up(self) -> None:
        self.generate([ArRequest(prompt="warm-up", n=1, height=64, width=64, seed=0)])
