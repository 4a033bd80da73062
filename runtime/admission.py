"""Admission of GatewayService requests: every field range-checked before any arithmetic or queueing. The rules
over the limits model (runtime.limits) that both the gateway servicer and the REST front apply.

Whatever a worker would refuse is refused here, with the field named, so a bad request never reaches a shared AR
batch, never holds a slot and never costs AR or denoiser work. The limits are those in force (the gateway driver's
``limits()``: what some worker of each stage advertised over GetLimits, within the gateway's flags; whether one
single worker serves the whole request is runtime.capability's); the checks themselves are the workers'
own, from runtime.limits.
"""
from __future__ import annotations

from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass

from glmimage.v1 import common_pb2, gateway_service_pb2
from runtime.errors import InvalidArgument
from runtime.limits import (
    Limits,
    check_guidance,
    check_loras,
    check_n,
    check_output_compression,
    check_partial_images,
    check_prompt,
    check_reference_images,
    check_sampling,
    check_seed,
    check_step_cache,
    check_steps,
    model_size,
    unknown_lora,
)

__all__ = ["Admitted", "LoraChoice", "check_generate", "check_partial_images", "lora_refs"]


@dataclass(frozen=True)
class Admitted:
    """A request the gateway admitted, checked once: what every later step reads. The proto is kept as the client
    sent it (never written to); the values admission settled (n for 0, the default size) are fields here."""

    request: gateway_service_pb2.GenerateImagesRequest
    n: int
    height: int  # as asked (the workers round up to multiples of 32 and crop back)
    width: int
    reference_pixels: int = 0  # what the reference images' headers declare, in all
    largest_reference_pixels: int = 0  # of them, the largest (what each worker's max_reference_pixels bounds)

    @property
    def edit(self) -> bool:
        return bool(self.request.reference_images)


@dataclass(frozen=True)
class LoraChoice:
    """A LoraRef as the checks read it: ``scale`` None when unset on the wire (the adapter's default)."""

    name: str
    scale: float | None


def lora_refs(refs: Iterable[common_pb2.LoraRef]) -> list[LoraChoice]:
    return [LoraChoice(ref.name, ref.scale if ref.HasField("scale") else None) for ref in refs]


def check_generate(r: gateway_service_pb2.GenerateImagesRequest, limits: Limits, *, default_height: int,
                   default_width: int, reference_sizes: Sequence[tuple[int, int]] | None = None,
                   known_loras: Container[str] | None = None) -> Admitted:
    """The request admitted, or InvalidArgument naming the first field past ``limits``. ``reference_sizes``: what
    check_reference_images answered for these very images, when the caller needed their sizes first (REST's
    `size: auto`), so that no header is read twice. ``known_loras``: the adapter names the pool serves (the
    gateway's catalogue); None: not checked here (the gateway behind checks them)."""
    check_prompt(r.prompt, limits)
    n = check_n(r.n, limits)
    if (r.height == 0) != (r.width == 0):
        raise InvalidArgument("height" if r.height == 0 else "width", "give both height and width, or neither")
    height = r.height or default_height
    width = r.width or default_width
    model_size(height, width, limits)  # the rounded size must fit the pixel budget (and uint32)
    if r.output_format not in common_pb2.ImageFormat.values():
        raise InvalidArgument("output_format", f"unknown format {r.output_format}")
    check_output_compression(r.output_compression if r.HasField("output_compression") else None)
    check_steps(r.num_inference_steps, limits)
    check_step_cache(r.step_cache, limits)
    loras = lora_refs(r.loras)
    check_loras(loras, limits)
    if known_loras is not None:
        for i, ref in enumerate(loras):
            if ref.name not in known_loras:
                raise unknown_lora(i, ref.name)
    check_guidance(r.guidance_scale if r.HasField("guidance_scale") else None, limits)
    check_seed(r.seed if r.HasField("seed") else None, n)
    if r.HasField("sampling"):  # a bad value reaching the AR would stall a shared batch
        sp = r.sampling
        check_sampling(sp.temperature if sp.HasField("temperature") else None,
                       sp.top_p if sp.HasField("top_p") else None,
                       sp.top_k if sp.HasField("top_k") else None)
    reference_pixels = largest = 0
    if r.reference_images:  # an edit: count, bytes and each header's format and pixels, before anything decodes
        sizes = (check_reference_images([image.data for image in r.reference_images], limits)
                 if reference_sizes is None else reference_sizes)
        reference_pixels = sum(w * h for w, h in sizes)
        largest = max(w * h for w, h in sizes)
    return Admitted(r, n=n, height=height, width=width, reference_pixels=reference_pixels,
                    largest_reference_pixels=largest)
