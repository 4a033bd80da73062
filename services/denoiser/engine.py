"""The denoise engine: GLM-Image's DiT + VAE through diffusers.GlmImagePipeline, AR skipped.

Knows nothing of gRPC. Runs one job at a time (the pipeline keeps per-call state); callers serialize.
A job can be stopped between steps through its cancel event, checked in the pipeline's step callback.
"""
from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from PIL import Image

from services.denoiser.encoding import ImageFormat, encode
from services.model.checks import SEED_SPACE, check_prompt, check_seed, model_size, round_up
from services.model.device import resolve_device, resolve_dtype
from services.model.loading import checkpoint_root, require_parts
from services.model.tiny import DENOISER_PARTS
from services.runtime.errors import Cancelled, InvalidArgument

log = logging.getLogger(__name__)

TOKEN_PATCH = 16  # one prior token per 16x16 pixels


@dataclass(frozen=True)
class DenoiseLimits:
    max_prompt_chars: int = 8192
    max_pixels: int = 2048 * 2048
    max_steps: int = 200
    max_guidance: float = 30.0
    default_steps: int = 2  # the tiny model's sensible default; set --default-steps 50 for real weights
    default_guidance: float = 1.5


@dataclass(frozen=True)
class DenoiseJob:
    prompt: str
    token_ids: list[int]
    height: int
    width: int
    steps: int = 0
    guidance_scale: float | None = None
    seed: int | None = None
    output_format: ImageFormat = ImageFormat.PNG
    output_compression: int | None = None


@dataclass(frozen=True)
class DenoiseResult:
    image: bytes
    output_format: ImageFormat
    height: int
    width: int
    steps_completed: int
    seed: int
    denoise_seconds: float
    decode_seconds: float
    encode_seconds: float


@dataclass
class JobControl:
    """Shared between the event loop and the worker thread: cancel requests in, progress out."""

    cancel: threading.Event = field(default_factory=threading.Event)
    steps_done: int = 0
    on_step: Callable[[int, int], None] | None = None


class DenoiseEngine:
    def __init__(self, pipe, device: torch.device, limits: DenoiseLimits = DenoiseLimits()) -> None:
        self.pipe = pipe
        self.device = device
        self.limits = limits
        self.codebook_size = int(pipe.transformer.config.prior_vq_quantizer_codebook_size)

    @classmethod
    def load(cls, model_path: str | Path | None, device: str = "auto", dtype: str = "auto",
             limits: DenoiseLimits = DenoiseLimits()) -> DenoiseEngine:
        """Load everything but the AR (glyph tokenizer + encoder, transformer, VAE, scheduler)."""
        from diffusers import GlmImagePipeline

        root = checkpoint_root(model_path)
        require_parts(root, DENOISER_PARTS, "denoiser service")
        dev = resolve_device(device)
        torch_dtype = resolve_dtype(dtype, dev)
        t0 = time.perf_counter()
        pipe = GlmImagePipeline.from_pretrained(root, vision_language_encoder=None, processor=None,
                                                dtype=torch_dtype).to(dev)
        pipe.set_progress_bar_config(disable=True)
        log.info("DiT + VAE loaded from %s on %s/%s in %.1fs", root, dev, torch_dtype, time.perf_counter() - t0)
        return cls(pipe, dev, limits)

    def validate(self, job: DenoiseJob) -> DenoiseJob:
        """Check a job and fill defaults; sizes that are not multiples of 32 are allowed (cropped afterwards)."""
        lim = self.limits
        check_prompt(job.prompt, lim.max_prompt_chars, "the glyph text comes from it")
        h, w = model_size(job.height, job.width, lim.max_pixels)
        expected = (h // TOKEN_PATCH) * (w // TOKEN_PATCH)
        if len(job.token_ids) != expected:
            raise InvalidArgument("prior_tokens", f"has {len(job.token_ids)} ids; {h}x{w} needs "
                                                  f"({h}/16)*({w}/16) = {expected}")
        if job.token_ids and not (0 <= min(job.token_ids) and max(job.token_ids) < self.codebook_size):
            bad = next(t for t in job.token_ids if not 0 <= t < self.codebook_size)
            raise InvalidArgument("prior_tokens", f"id {bad} is outside [0, {self.codebook_size})")
        steps = job.steps or lim.default_steps
        if not 1 <= steps <= lim.max_steps:
            raise InvalidArgument("num_inference_steps", f"must be between 1 and {lim.max_steps}, got {job.steps}")
        guidance = lim.default_guidance if job.guidance_scale is None else job.guidance_scale
        if not 0.0 <= guidance <= lim.max_guidance:
            raise InvalidArgument("guidance_scale", f"must be between 0 and {lim.max_guidance}, got {guidance}")
        check_seed(job.seed)
        if job.output_compression is not None and not 0 <= job.output_compression <= 100:
            raise InvalidArgument("output_compression", f"must be between 0 and 100, got {job.output_compression}")
        seed = job.seed if job.seed is not None else secrets.randbelow(SEED_SPACE)
        return DenoiseJob(prompt=job.prompt, token_ids=job.token_ids, height=job.height, width=job.width,
                          steps=steps, guidance_scale=guidance, seed=seed, output_format=job.output_format,
                          output_compression=job.output_compression)

    @torch.inference_mode()
    def run(self, job: DenoiseJob, control: JobControl | None = None) -> DenoiseResult:
        """Denoise a validated job. Raises Cancelled at the next step once control.cancel is set."""
        control = control or JobControl()
        h, w = round_up(job.height), round_up(job.width)

        def on_step_end(pipe, step: int, timestep, callback_kwargs: dict) -> dict:
            control.steps_done = step + 1
            if control.on_step is not None:
                control.on_step(step + 1, job.steps)
            if control.cancel.is_set():
                raise Cancelled(f"cancelled after {step + 1} of {job.steps} steps")
            return callback_kwargs

        if control.cancel.is_set():
            raise Cancelled("cancelled before the first step")
        t0 = time.perf_counter()
        latents = self.pipe(
            prompt=job.prompt,
            prior_token_ids=torch.tensor([job.token_ids], dtype=torch.long, device=self.device),
            height=h, width=w, num_inference_steps=job.steps, guidance_scale=job.guidance_scale,
            generator=torch.Generator(device=self.device).manual_seed(job.seed),
            output_type="latent", callback_on_step_end=on_step_end,
        ).images
        t1 = time.perf_counter()
        image = self.decode(latents)
        if (h, w) != (job.height, job.width):
            # The model needs multiples of 32; the client asked for exactly this size: center-crop back.
            top, left = (h - job.height) // 2, (w - job.width) // 2
            image = image.crop((left, top, left + job.width, top + job.height))
        t2 = time.perf_counter()
        data = encode(image, job.output_format, job.output_compression)
        t3 = time.perf_counter()
        return DenoiseResult(image=data, output_format=job.output_format, height=job.height, width=job.width,
                             steps_completed=control.steps_done, seed=job.seed, denoise_seconds=t1 - t0,
                             decode_seconds=t2 - t1, encode_seconds=t3 - t2)

    def decode(self, latents: torch.Tensor) -> Image.Image:
        """Latents -> PIL, as the pipeline's own tail does (un-normalize, VAE decode, postprocess)."""
        vae = self.pipe.vae
        latents = latents.to(vae.dtype)
        mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.latent_channels, 1, 1).to(latents)
        std = torch.tensor(vae.config.latents_std).view(1, vae.config.latent_channels, 1, 1).to(latents)
        pixels = vae.decode(latents * std + mean, return_dict=False)[0]
        return self.pipe.image_processor.postprocess(pixels, output_type="pil")[0]

    def warm_up(self) -> None:
        n = (64 // TOKEN_PATCH) ** 2
        self.run(self.validate(DenoiseJob(prompt="warm-up", token_ids=[0] * n, height=64, width=64, seed=0)))
