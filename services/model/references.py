"""Reference images of an edit, as both model servers prepare them, so the AR's tokens and the DiT's VAE latents
describe the same pixels.

The AR decides each reference's model size (``reference_model_size``: multiples of 32, the aspect ratio kept, an
area its image processor will not rescale) and reports it as the reference's token grid (ReferenceTokens, size/16
after the 2x upsampling). The denoiser resizes the same bytes to exactly grid x 16 (``prepare``), whatever policy
the AR used: the DiT's patch grid of each reference must equal its doubled AR grid, or it fails.

Headers were checked against the limits at every edge before anything here runs (services.runtime.limits
.check_reference_images); decoding errors of a sound header (a truncated file) are refused here, field named.
"""
from __future__ import annotations

import io
import math

from PIL import Image

from services.runtime.errors import InvalidArgument
from services.runtime.limits import SIZE_MULTIPLE

# What the reference is resized with: the processor itself uses bicubic.
RESAMPLE = Image.Resampling.BICUBIC


def decode(data: bytes, field: str) -> Image.Image:
    """The reference's pixels as RGB; InvalidArgument naming ``field`` if the file does not decode whole."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()  # a truncated or corrupt file fails here, not later inside the model
            return image.convert("RGB")
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError):
        raise InvalidArgument(field, "could not be decoded (truncated or corrupt image data)") from None


def reference_model_size(width: int, height: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(width, height) the model sees a reference at: each side a multiple of 32, the aspect ratio kept as far as
    that allows, the area within [min_pixels, max_pixels] so the image processor does not resize it again."""
    area = width * height
    scale = 1.0
    if area > max_pixels:
        scale = math.sqrt(max_pixels / area)
    elif area < min_pixels:
        scale = math.sqrt(min_pixels / area)
    w, h = _multiple(width * scale), _multiple(height * scale)
    while w * h > max_pixels and max(w, h) > SIZE_MULTIPLE:  # rounding may have pushed it over: shave the longer
        if w >= h:
            w -= SIZE_MULTIPLE
        else:
            h -= SIZE_MULTIPLE
    while w * h < min_pixels:
        if w <= h:
            w += SIZE_MULTIPLE
        else:
            h += SIZE_MULTIPLE
    return w, h


def _multiple(value: float) -> int:
    return max(SIZE_MULTIPLE, round(value / SIZE_MULTIPLE) * SIZE_MULTIPLE)


def prepare(data: bytes, field: str, width: int, height: int) -> Image.Image:
    """The reference decoded and resized to exactly (width, height)."""
    image = decode(data, field)
    return image if image.size == (width, height) else image.resize((width, height), RESAMPLE)
