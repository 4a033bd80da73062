"""Reference images of an edit, as both model servers prepare them, so the AR's tokens and the DiT's VAE latents
describe the same pixels.

The AR decides each reference's model size (``reference_model_size``: multiples of 32, the aspect ratio kept, an
area its image processor will not rescale) and reports it as the reference's token grid (ReferenceTokens, size/16
after the 2x upsampling). The denoiser resizes the same bytes to exactly grid x 16 (``prepare``), whatever policy
the AR used: the DiT's patch grid of each reference must equal its doubled AR grid, or it fails.

Headers were checked against the limits at every edge before anything here runs (runtime.limits
.check_reference_images); decoding errors of a sound header (a truncated file) are refused here, field named.
"""
from __future__ import annotations

import io
import math
from dataclasses import dataclass

from PIL import Image

from runtime.errors import InvalidArgument
from runtime.limits import MAX_ASPECT, SIZE_MULTIPLE, TOKEN_PATCH


@dataclass(frozen=True)
class ReferenceTokens:
    """One reference's AR codes, row-major on grid_height x grid_width (its model size / 16)."""

    token_ids: list[int]
    grid_height: int
    grid_width: int

    @property
    def size(self) -> tuple[int, int]:
        """(width, height) in pixels the reference is resized to, as PIL sizes go."""
        return self.grid_width * TOKEN_PATCH, self.grid_height * TOKEN_PATCH


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
    """(width, height) the model sees a reference at, each side a multiple of 32, the aspect ratio kept as far as
    that allows, such that the image processor leaves it as it is.

    ``min_pixels``/``max_pixels`` are the processor's own (``size.shortest_edge``/``size.longest_edge``), read as its
    smart_resize reads them: bounds on the short side (``sqrt(min_pixels)``) and on the long side
    (``sqrt(max_pixels)``), not on the area. Within them smart_resize does not rescale, so its grid is exactly
    size / 32 (size / 16 once doubled), and at most 4:1, which it refuses past.
    """
    shortest, longest = round(math.sqrt(min_pixels)), round(math.sqrt(max_pixels))
    # smart_resize's scale: the short side up to `shortest`, then the long side down to `longest` (which wins).
    scale = 1.0
    if min(width, height) < shortest:
        scale = shortest / min(width, height)
    if max(width, height) * scale > longest:
        scale = longest / max(width, height)
    low = -(-shortest // SIZE_MULTIPLE) * SIZE_MULTIPLE
    high = max(SIZE_MULTIPLE, longest // SIZE_MULTIPLE * SIZE_MULTIPLE)
    # Rounding may cross a bound: clamp each side (the long-side bound wins should they conflict, as in smart_resize).
    w, h = (min(max(_multiple(side * scale), low), high) for side in (width, height))
    # Rounding a 4:1 image can pass 4:1 (188x47 -> 192x32): widen the short side, or shorten the long one.
    while max(w, h) > MAX_ASPECT * min(w, h):
        grow_w = w < h
        if min(w, h) + SIZE_MULTIPLE <= high:
            w, h = (w + SIZE_MULTIPLE, h) if grow_w else (w, h + SIZE_MULTIPLE)
        else:
            w, h = (w, h - SIZE_MULTIPLE) if grow_w else (w - SIZE_MULTIPLE, h)
    return w, h


def _multiple(value: float) -> int:
    return max(SIZE_MULTIPLE, round(value / SIZE_MULTIPLE) * SIZE_MULTIPLE)


def prepare(data: bytes, field: str, width: int, height: int) -> Image.Image:
    """The reference decoded and resized to exactly (width, height)."""
    return _resized(decode(data, field), width, height)


def prepare_for_model(data: bytes, field: str, min_pixels: int, max_pixels: int) -> Image.Image:
    """The AR's side: the reference decoded once and resized to its ``reference_model_size``."""
    image = decode(data, field)
    return _resized(image, *reference_model_size(*image.size, min_pixels, max_pixels))


def _resized(image: Image.Image, width: int, height: int) -> Image.Image:
    return image if image.size == (width, height) else image.resize((width, height), RESAMPLE)
