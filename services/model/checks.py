"""Input checks both model services apply the same way, so the AR and the DiT always agree on sizes."""
from __future__ import annotations

from services.runtime.errors import InvalidArgument

SEED_SPACE = 2**32
# The AR grid is H/32 x W/32 (upsampled 2x to the DiT's H/16 x W/16): both stages round sizes up to this.
SIZE_MULTIPLE = 32


def round_up(value: int, multiple: int = SIZE_MULTIPLE) -> int:
    return -(-value // multiple) * multiple


def check_prompt(prompt: str, max_chars: int, why_needed: str = "") -> None:
    if not prompt or not prompt.strip():
        raise InvalidArgument("prompt", "must not be empty" + (f" ({why_needed})" if why_needed else ""))
    if len(prompt) > max_chars:
        raise InvalidArgument("prompt", f"is {len(prompt)} characters; the limit is {max_chars}")


def model_size(height: int, width: int, max_pixels: int) -> tuple[int, int]:
    """The size the model runs at: each side rounded up to a multiple of 32, within the pixel budget."""
    for name, value in (("height", height), ("width", width)):
        if value <= 0:
            raise InvalidArgument(name, f"must be positive, got {value}")
    h, w = round_up(height), round_up(width)
    if h * w > max_pixels:
        raise InvalidArgument("height", f"{h}x{w} (after rounding up to multiples of {SIZE_MULTIPLE}) exceeds "
                                        f"the limit of {max_pixels} pixels")
    return h, w


def check_seed(seed: int | None) -> None:
    if seed is not None and not 0 <= seed < SEED_SPACE:
        raise InvalidArgument("seed", f"must be in [0, {SEED_SPACE}), got {seed}")
