"""The denoise engine: GLM-Image's DiT + VAE through diffusers.GlmImagePipeline, AR skipped.

Knows nothing of gRPC. Runs one job at a time (the pipeline keeps per-call state); callers serialize.
A job can be stopped between steps through its JobControl (cancel event, deadline), checked in the
pipeline's step callback, which also reports progress and takes the partial previews. An edit (reference images
with their AR tokens: services.denoiser.conditioning) runs the same loop, the references VAE-encoded into the DiT's
KV cache first.
"""
from __future__ import annotations

import io
import logging
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from PIL import Image

from runtime.errors import Cancelled, DeadlineExceeded, InvalidArgument
from runtime.limits import (
    SEED_SPACE,
    Limits,
    check_guidance,
    check_lora_names,
    check_output_compression,
    check_partial_images,
    check_prompt,
    check_seed,
    check_steps,
    model_size,
    round_up,
)
from services.denoiser.adapters import AdapterCache, AdapterDirectory, AdapterInfo, LoraRef, base_only
from services.denoiser.compiled import CompileCounter, CompileSettings, WarmUpJob, compile_blocks, warm_up_plan
from services.denoiser.conditioning import (
    check_codes,
    check_references,
    is_reference_pass,
    pipeline_inputs,
    prepare_images,
)
from services.denoiser.encoding import DEFAULT_PNG_LEVEL, ImageFormat, encode
from services.denoiser.step_cache import DEFAULT_SCHEDULES, Schedule, StepCacheLevel, StepCacheRun, supported
from services.model.device import device_name, resolve_device, resolve_dtype
from services.model.loading import checkpoint_root, require_parts
from services.model.references import TOKEN_PATCH, ReferenceTokens
from services.model.tiny import DENOISER_PARTS, tiny_lora_dir

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class DenoiseSettings:
    limits: Limits = Limits()  # only DENOISER_FIELDS apply here
    default_steps: int = 2  # the tiny model's sensible default; set --default-steps 50 for real weights
    default_guidance: float = 1.5
    png_compress_level: int = DEFAULT_PNG_LEVEL  # zlib level when a PNG request gives no output_compression
    # The schedule of each cached StepCache level (services.denoiser.step_cache).
    step_cache: Mapping[StepCacheLevel, Schedule] = field(default_factory=lambda: dict(DEFAULT_SCHEDULES))
    compile: CompileSettings | None = None  # --compile: the DiT's blocks compiled and warmed up (compiled.py)
    lora_dir: Path | None = None  # LoRA adapters (services.denoiser.adapters); None: none served
    max_loaded_loras: int = 4


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
    partial_images: int = 0
    # An edit: each reference's file and its AR tokens, one of each per reference in the same order (as on the
    # wire: validate() refuses mismatched counts). Both empty: text-to-image.
    reference_images: Sequence[bytes] = ()
    references: Sequence[ReferenceTokens] = ()
    step_cache: StepCacheLevel = StepCacheLevel.OFF
    loras: Sequence[LoraRef] = ()  # validate() fills each default scale


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
    prepare_seconds: float = 0.0  # of denoise_seconds: before the first step (glyphs, an edit's references)
    steps_cached: int = 0  # of steps_completed, those extrapolated (step_cache)
    lora_load_seconds: float = 0.0  # of prepare_seconds: loading adapter files the job named and were not loaded
    step_cache_note: str = ""  # a cached level asked for and no step cached: why (Schedule.uncached_note)


@dataclass(frozen=True)
class StepProgress:
    step: int  # 1-based step just finished
    total_steps: int


@dataclass(frozen=True)
class PartialPreview:
    index: int  # 0-based, in the order taken
    step: int
    image: bytes  # encoded in the job's format, at the requested size


JobEvent = StepProgress | PartialPreview


@dataclass
class JobControl:
    """Shared between the caller and the worker thread: stop requests in, progress out.

    on_event runs on the worker thread; a caller living on an event loop must hand events over thread-safely.
    """

    cancel: threading.Event = field(default_factory=threading.Event)
    deadline: float | None = None  # time.monotonic() value after which the job stops at the next step
    on_event: Callable[[JobEvent], None] | None = None
    steps_done: int = 0
    steps_cached: int = 0  # of steps_done, those the step cache extrapolated
    step_seconds: list[float] = field(default_factory=list)
    prepare_seconds: float | None = None  # from the start of denoise() to its first step
    lora_load_seconds: float = 0.0  # of prepare_seconds: loading adapter files

    def emit(self, event: JobEvent) -> None:
        if self.on_event is not None:
            self.on_event(event)

    def check(self, where: str) -> None:
        if self.cancel.is_set():
            raise Cancelled(f"cancelled {where}")
        if self.deadline is not None and time.monotonic() >= self.deadline:
            raise DeadlineExceeded(f"deadline passed {where}")


def preview_steps(steps: int, partial_images: int) -> list[int]:
    """Evenly spaced steps (1-based) after which to take previews, never the last one (that is the result).

    k previews over S steps are taken after round(S*(i+1)/(k+1)); a job too short for k distinct earlier
    steps gets one preview per earlier step, as OpenAI allows fewer partials than asked for.
    """
    k = min(partial_images, steps - 1)
    # floor(x + 0.5), not round(): banker's rounding would put two previews on one step.
    return [int(steps * (i + 1) / (k + 1) + 0.5) for i in range(k)]


class DenoiseEngine:
    def __init__(self, pipe, device: torch.device, settings: DenoiseSettings = DenoiseSettings()) -> None:
        self.pipe = pipe
        self.device = device
        self.device_name = device_name(device)
        # (height, width) of the jobs its compiled blocks are warmed up for before SERVING; none without --compile.
        self.compiled_sizes = settings.compile.sizes if settings.compile is not None else ()
        self.settings = settings
        # The step cache is advertised (Limits.step_cache) only where this transformer and diffusers support it.
        self.limits = replace(settings.limits, step_cache=supported(pipe.transformer))
        self.adapters: AdapterCache | None = None
        if settings.lora_dir is None:  # advertised, so a gateway refuses adapters before sending a job here
            self.limits = replace(self.limits, max_loras_per_request=0)
        else:
            # A job's adapters must all fit in the DiT at once.
            self.limits = replace(self.limits, max_loras_per_request=min(self.limits.max_loras_per_request,
                                                                         settings.max_loaded_loras))
            self.adapters = AdapterCache(pipe.transformer, AdapterDirectory(settings.lora_dir), self.limits,
                                         settings.max_loaded_loras)
        self.codebook_size = int(pipe.transformer.config.prior_vq_quantizer_codebook_size)
        self.compilations = CompileCounter()
        if settings.compile is not None:
            compile_blocks(pipe.transformer, settings.compile, self.compilations)

    @classmethod
    def load(cls, model_path: str | Path | None, device: str = "auto", dtype: str = "auto",
             settings: DenoiseSettings = DenoiseSettings()) -> DenoiseEngine:
        """Load everything but the AR (glyph tokenizer + encoder, transformer, VAE, scheduler)."""
        from diffusers import GlmImagePipeline

        root = checkpoint_root(model_path)
        require_parts(root, DENOISER_PARTS, "denoiser service")
        if model_path is None and settings.lora_dir is None and tiny_lora_dir(root).is_dir():
            settings = replace(settings, lora_dir=tiny_lora_dir(root))  # the tiny model's demo adapter
        dev = resolve_device(device)
        torch_dtype = resolve_dtype(dtype, dev)
        t0 = time.perf_counter()
        pipe = GlmImagePipeline.from_pretrained(root, vision_language_encoder=None, processor=None,
                                                dtype=torch_dtype).to(dev)
        pipe.set_progress_bar_config(disable=True)
        log.info("DiT + VAE loaded from %s on %s/%s in %.1fs", root, dev, torch_dtype, time.perf_counter() - t0)
        return cls(pipe, dev, settings)

    def validate(self, job: DenoiseJob) -> DenoiseJob:
        """Check a job and fill defaults; sizes that are not multiples of 32 are allowed (cropped afterwards)."""
        lim = self.limits
        check_prompt(job.prompt, lim, "the glyph text comes from it")
        h, w = model_size(job.height, job.width, lim)
        expected = (h // TOKEN_PATCH) * (w // TOKEN_PATCH)
        if len(job.token_ids) != expected:
            raise InvalidArgument("prior_tokens", f"has {len(job.token_ids)} ids; {h}x{w} needs "
                                                  f"({h}/16)*({w}/16) = {expected}")
        check_codes(job.token_ids, "prior_tokens", self.codebook_size)
        check_references(job.reference_images, job.references, lim, self.codebook_size)
        check_steps(job.steps, lim)
        steps = job.steps or self.settings.default_steps
        guidance = self.settings.default_guidance if job.guidance_scale is None else job.guidance_scale
        check_guidance(guidance, lim)
        check_seed(job.seed)
        check_output_compression(job.output_compression)
        check_partial_images(job.partial_images, lim)
        if job.step_cache is not StepCacheLevel.OFF and not lim.step_cache:
            raise InvalidArgument("step_cache", f"this denoiser cannot cache steps ({job.step_cache.value}); "
                                                "use off")
        loras = tuple(job.loras)
        if loras and self.adapters is None:
            raise InvalidArgument("loras", "this denoiser serves no LoRA adapters (no --lora-dir)")
        if self.adapters is not None:
            loras = self.adapters.resolve(loras)
        seed = job.seed if job.seed is not None else secrets.randbelow(SEED_SPACE)
        return replace(job, steps=steps, guidance_scale=guidance, seed=seed, loras=loras)

    # ---- adapters outside a job (DenoiserService.ListLoras/LoadLoras/UnloadLoras) ----

    def available_loras(self) -> list[AdapterInfo]:
        """Every adapter of the directory, by name, read afresh (never the weights); empty without --lora-dir."""
        return [] if self.adapters is None else self.adapters.directory.listing()

    def loras_loaded(self) -> tuple[str, ...]:
        """The adapters held loaded, least recently used first (any thread)."""
        return () if self.adapters is None else self.adapters.loaded()

    def check_lora_names(self, names: Sequence[str], load: bool) -> None:
        """Check a LoadLoras (``load``) or UnloadLoras request's names on the caller's thread: InvalidArgument naming
        ``names`` or ``names[i]``. A load must name adapters of the directory, at most max_loras_per_request."""
        if not load:
            check_lora_names(names, None)
        elif self.adapters is None:
            if names:
                raise InvalidArgument("names", "this denoiser serves no LoRA adapters (no --lora-dir)")
        else:
            self.adapters.check_names(names)

    def load_loras(self, names: Sequence[str]) -> tuple[str, ...]:
        """Load checked adapters ahead of the jobs naming them (on the worker thread, between jobs): all of them,
        or none with InvalidArgument naming ``names[i]``; what is loaded afterwards, least recently used first."""
        if self.adapters is None or not names:
            return self.loras_loaded()
        # Outside inference mode, as in denoise(): peft's layers must stay tensors later loads and deletes may edit.
        with torch.inference_mode(False), torch.no_grad():
            return self.adapters.preload(names)

    def unload_loras(self, names: Sequence[str]) -> tuple[str, ...]:
        """Drop those of ``names`` that are loaded (on the worker thread, between jobs); what stays loaded."""
        if self.adapters is None:
            return ()
        with torch.inference_mode(False), torch.no_grad():
            return self.adapters.unload(names)

    @torch.inference_mode()
    def run(self, job: DenoiseJob, control: JobControl | None = None) -> DenoiseResult:
        """Denoise, decode and encode a validated job; raises Cancelled or DeadlineExceeded once control asks, and
        InvalidArgument for a reference whose header passed validate() but whose data does not decode."""
        control = control or JobControl()
        t0 = time.perf_counter()
        latents = self.denoise(job, control)
        t1 = time.perf_counter()
        control.check("before decoding")  # nobody waits for the image any more: skip the VAE too
        image = self._image(latents, job)
        t2 = time.perf_counter()
        data = self._encode(image, job)
        t3 = time.perf_counter()
        return DenoiseResult(image=data, output_format=job.output_format, height=job.height, width=job.width,
                             steps_completed=control.steps_done, seed=job.seed, denoise_seconds=t1 - t0,
                             decode_seconds=t2 - t1, encode_seconds=t3 - t2,
                             prepare_seconds=control.prepare_seconds or 0.0, steps_cached=control.steps_cached,
                             lora_load_seconds=control.lora_load_seconds,
                             step_cache_note=self._cache_note(job, control))

    def _cache_note(self, job: DenoiseJob, control: JobControl) -> str:
        if job.step_cache is StepCacheLevel.OFF or control.steps_cached:
            return ""
        return self.settings.step_cache[job.step_cache].uncached_note(job.step_cache, control.steps_done)

    @torch.inference_mode()
    def denoise(self, job: DenoiseJob, control: JobControl | None = None) -> torch.Tensor:
        """The denoising loop alone (after encoding an edit's references): the final latents at the model size
        (multiples of 32)."""
        control = control or JobControl()
        begun = time.perf_counter()
        h, w = round_up(job.height), round_up(job.width)
        # Decoded here, on the worker thread, rather than in validate() on the caller's event loop.
        conditioning = pipeline_inputs(prepare_images(job.reference_images, job.references), job.references,
                                       self.device)
        previews = {step: index for index, step in enumerate(preview_steps(job.steps, job.partial_images))}
        # A step is timed from its first transformer call to its callback, so neither the glyph encoding nor an
        # edit's reference passes before the loop, nor preview decoding inside a callback, counts as step time.
        step_start: list[float | None] = [None]
        schedule = None if job.step_cache is StepCacheLevel.OFF else self.settings.step_cache[job.step_cache]
        cache = StepCacheRun(self.pipe.transformer, schedule)

        def on_transformer_call(module, args, kwargs) -> None:
            if is_reference_pass(kwargs):
                # Before the loop: neither step time nor a place to wait, so many references still stop promptly.
                control.check("while encoding the references")
                return
            cache.before_call(kwargs)
            if step_start[0] is None:
                step_start[0] = time.perf_counter()
                if control.prepare_seconds is None:  # the first step begins: what came before was preparation
                    control.prepare_seconds = step_start[0] - begun

        def on_step_end(pipe, index: int, timestep, callback_kwargs: dict) -> dict:
            now, step = time.perf_counter(), index + 1
            control.step_seconds.append(now - (step_start[0] or now))
            step_start[0] = None
            cache.step_done()
            control.steps_done, control.steps_cached = step, cache.cached
            control.emit(StepProgress(step=step, total_steps=job.steps))
            control.check(f"after {step} of {job.steps} steps")
            if step in previews:
                preview = self._encode(self._image(callback_kwargs["latents"], job), job)
                control.emit(PartialPreview(index=previews[step], step=step, image=preview))
            return callback_kwargs

        control.check("before the first step")
        # Every job sets the adapters it runs with, so nothing of the previous job's carries over.
        # Outside inference mode: peft's new layers must stay ordinary tensors that later loads and deletes may edit.
        with torch.inference_mode(False), torch.no_grad():
            if self.adapters is not None:
                control.lora_load_seconds = self.adapters.activate(job.loras)
            else:
                base_only(self.pipe.transformer)
        hook = self.pipe.transformer.register_forward_pre_hook(on_transformer_call, with_kwargs=True)
        try:
            return self.pipe(
                prompt=job.prompt,
                prior_token_ids=torch.tensor([job.token_ids], dtype=torch.long, device=self.device),
                height=h, width=w, num_inference_steps=job.steps, guidance_scale=job.guidance_scale,
                generator=torch.Generator(device=self.device).manual_seed(job.seed),
                output_type="latent", callback_on_step_end=on_step_end, **conditioning,
            ).images
        finally:
            hook.remove()
            cache.close()  # however the job ended: the next one starts from a clean cache state

    def _image(self, latents: torch.Tensor, job: DenoiseJob) -> Image.Image:
        image = self.decode(latents)
        if image.size != (job.width, job.height):
            # The model needs multiples of 32; the client asked for exactly this size: center-crop back.
            top, left = (image.height - job.height) // 2, (image.width - job.width) // 2
            image = image.crop((left, top, left + job.width, top + job.height))
        return image

    def _encode(self, image: Image.Image, job: DenoiseJob) -> bytes:
        return encode(image, job.output_format, job.output_compression, self.settings.png_compress_level)

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor) -> Image.Image:
        """Latents -> PIL, as the pipeline's own tail does (un-normalize, VAE decode, postprocess)."""
        vae = self.pipe.vae
        latents = latents.to(vae.dtype)
        mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.latent_channels, 1, 1).to(latents)
        std = torch.tensor(vae.config.latents_std).view(1, vae.config.latent_channels, 1, 1).to(latents)
        pixels = vae.decode(latents * std + mean, return_dict=False)[0]
        return self.pipe.image_processor.postprocess(pixels, output_type="pil")[0]

    def warm_up(self) -> None:
        if self.settings.compile is None:
            n = (64 // TOKEN_PATCH) ** 2
            self.run(self.validate(DenoiseJob(prompt="warm-up", token_ids=[0] * n, height=64, width=64, seed=0)))
            return
        t0 = time.perf_counter()
        plan = warm_up_plan(self.settings.compile, self.settings.step_cache, self.limits.step_cache)
        for item in plan:
            self.run(self.validate(self._warm_up_job(item)))
        log.info("compiled the DiT's blocks (%s) and warmed up %d jobs at %s in %.1fs: %d graphs, %.1fs compiling",
                 self.settings.compile.backend, len(plan),
                 ", ".join(f"{w}x{h}" for h, w in self.settings.compile.sizes), time.perf_counter() - t0,
                 self.compilations.graphs, self.compilations.seconds)

    def _warm_up_job(self, item: WarmUpJob) -> DenoiseJob:
        h, w = round_up(item.height), round_up(item.width)
        tokens = [(7 * i) % self.codebook_size for i in range((h // TOKEN_PATCH) * (w // TOKEN_PATCH))]
        images, refs = [], []
        for i in range(item.references):
            # Grids of distinct sizes: equal lengths would be traced as one symbol, leaving unequal ones to a request.
            grid_w = 4 + 2 * i
            png = io.BytesIO()
            Image.new("RGB", (16 * grid_w, 64), (90, 120, 150)).save(png, "PNG")
            images.append(png.getvalue())
            refs.append(ReferenceTokens(token_ids=[(3 * j) % self.codebook_size for j in range(4 * grid_w)],
                                        grid_height=4, grid_width=grid_w))
        return DenoiseJob(prompt=item.prompt, token_ids=tokens, height=item.height, width=item.width,
                          steps=item.steps, seed=0, step_cache=item.step_cache, reference_images=images,
                          references=refs)
