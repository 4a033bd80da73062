"""Edge checks of GatewayService requests: every field range-checked before any arithmetic or queueing.

Whatever a worker would refuse is refused here, with the field named, so a bad request never reaches a shared AR
batch, never holds a slot and never costs AR or denoiser work. The ranges are the workers' defaults
(services.model.checks), which the gateway's flags can follow when the workers are configured otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass

from gateway.config import GatewayConfig
from glmimage.v1 import common_pb2, gateway_service_pb2
from services.model.checks import check_prompt, check_sampling, check_seed, model_size
from services.runtime.errors import InvalidArgument

MAX_PARTIAL_IMAGES = 3


@dataclass(frozen=True)
class Checked:
    n: int
    height: int  # as asked (the workers round up to multiples of 32 and crop back)
    width: int


def check_generate(r: gateway_service_pb2.GenerateImagesRequest, config: GatewayConfig) -> Checked:
    check_prompt(r.prompt, config.max_prompt_chars)
    n = r.n or 1
    if not 1 <= n <= config.max_n:
        raise InvalidArgument("n", f"must be between 1 and {config.max_n}, got {r.n}")
    if (r.height == 0) != (r.width == 0):
        raise InvalidArgument("height" if r.height == 0 else "width", "give both height and width, or neither")
    height = r.height or config.default_height
    width = r.width or config.default_width
    model_size(height, width, config.max_pixels)  # the rounded size must fit the pixel budget (and uint32)
    if r.output_format not in common_pb2.ImageFormat.values():
        raise InvalidArgument("output_format", f"unknown format {r.output_format}")
    if r.HasField("output_compression") and r.output_compression > 100:
        raise InvalidArgument("output_compression", f"must be between 0 and 100, got {r.output_compression}")
    if r.num_inference_steps > config.max_steps:
        raise InvalidArgument("num_inference_steps",
                              f"must be between 1 and {config.max_steps} (0: the default), got {r.num_inference_steps}")
    # `not (a <= x <= b)` also refuses NaN.
    if r.HasField("guidance_scale") and not 0.0 <= r.guidance_scale <= config.max_guidance:
        raise InvalidArgument("guidance_scale",
                              f"must be between 0 and {config.max_guidance:g}, got {r.guidance_scale}")
    check_seed(r.seed if r.HasField("seed") else None, n)
    if r.HasField("sampling"):  # a bad value reaching the AR would stall a shared batch
        sp = r.sampling
        check_sampling(sp.temperature if sp.HasField("temperature") else None,
                       sp.top_p if sp.HasField("top_p") else None,
                       sp.top_k if sp.HasField("top_k") else None)
    return Checked(n=n, height=height, width=width)


def check_partial_images(count: int) -> None:
    if count > MAX_PARTIAL_IMAGES:
        raise InvalidArgument("partial_images", f"must be between 0 and {MAX_PARTIAL_IMAGES}, got {count}")
