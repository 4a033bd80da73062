"""Admission of GatewayService requests: every field range-checked before any arithmetic or queueing. The rules
over the limits model (services.runtime.limits) that both the gateway servicer and the REST front apply.

Whatever a worker would refuse is refused here, with the field named, so a bad request never reaches a shared AR
batch, never holds a slot and never costs AR or denoiser work. The limits are those in force (the gateway driver's
``limits()``: the tightest of the gateway's flags and of what every worker advertised over GetLimits); the checks
themselves are the workers' own, from services.runtime.limits.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from glmimage.v1 import common_pb2, gateway_service_pb2
from services.runtime.errors import InvalidArgument
from services.runtime.limits import (
    Limits,
    check_guidance,
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
)

__all__ = ["Admitted", "check_generate", "check_partial_images"]


@dataclass(frozen=True)
class Admitted:
    """A request the gateway admitted, checked once: what every later step reads. The proto is kept as the client
    sent it (never written to); the values admission settled (n for 0, the default size) are fields here."""

    request: gateway_service_pb2.GenerateImagesRequest
    n: int
    height: int  # as asked (the workers round up to multiples of 32 and crop back)
    width: int
    reference_pixels: int = 0  # what the reference images' headers declare, in all

    @property
    def edit(self) -> bool:
        return bool(self.request.reference_images)


def check_generate(r: gateway_service_pb2.GenerateImagesRequest, limits: Limits, *, default_height: int,
                   default_width: int, reference_sizes: Sequence[tuple[int, int]] | None = None) -> Admitted:
    """The request admitted, or InvalidArgument naming the first field past ``limits``. ``reference_sizes``: what
    check_reference_images answered for these very images, when the caller needed their sizes first (REST's
    `size: auto`), so that no header is read twice."""
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
    check_guidance(r.guidance_scale if r.HasField("guidance_scale") else None, limits)
    check_seed(r.seed if r.HasField("seed") else None, n)
    if r.HasField("sampling"):  # a bad value reaching the AR would stall a shared batch
        sp = r.sampling
        check_sampling(sp.temperature if sp.HasField("temperature") else None,
                       sp.top_p if sp.HasField("top_p") else None,
                       sp.top_k if sp.HasField("top_k") else None)
    reference_pixels = 0
    if r.reference_images:  # an edit: count, bytes and each header's format and pixels, before anything decodes
        sizes = (check_reference_images([image.data for image in r.reference_images], limits)
                 if reference_sizes is None else reference_sizes)
        reference_pixels = sum(w * h for w, h in sizes)
    return Admitted(r, n=n, height=height, width=width, reference_pixels=reference_pixels)
