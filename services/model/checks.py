"""Input checks both model services apply the same way, so the AR and the DiT always agree on sizes."""
from __future__ import annotations

from services.runtime.errors import InvalidArgument

SEED_SPACE = 2**32
# Default limits, shared by the AR, the denoiser and the gateway's edge checks (each server can lower or raise its
# own with flags; the gateway's must not admit what its workers refuse).
MAX_PROMPT_CHARS = 8192
MAX_PIXELS = 2048 * 2048
MAX_STEPS = 200
MAX_GUIDANCE = 30.0
MAX_TOP_K = 1_000_000
MAX_TEMPERATURE = 2.0
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
        # Named after the larger side: 32x4294967296 is the width's fault, not the height's.
        raise InvalidArgument("height" if h >= w else "width",
                              f"{h}x{w} (after rounding up to multiples of {SIZE_MULTIPLE}) exceeds the limit of "
                              f"{max_pixels} pixels")
    return h, w


def check_seed(seed: int | None, n: int = 1) -> None:
    """Output i uses seed + i: the last one must fit the seed space too (never wrapped silently)."""
    if seed is not None and not 0 <= seed < SEED_SPACE:
        raise InvalidArgument("seed", f"must be in [0, {SEED_SPACE}), got {seed}")
    if seed is not None and seed + n - 1 >= SEED_SPACE:
        raise InvalidArgument("seed", f"seed + n - 1 = {seed + n - 1} exceeds {SEED_SPACE - 1} "
                                      "(output i uses seed + i)")


def check_sampling(temperature: float | None, top_p: float | None, top_k: int | None) -> None:
    """AR sampling ranges; the gateway applies them at its edge so a bad request never reaches a shared batch."""
    # `not (a < x <= b)` also rejects NaN.
    if temperature is not None and not 0.0 < temperature <= MAX_TEMPERATURE:
        raise InvalidArgument("sampling.temperature", f"must be in (0, {MAX_TEMPERATURE:g}], got {temperature}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise InvalidArgument("sampling.top_p", f"must be in (0, 1], got {top_p}")
    if top_k is not None and not 0 <= top_k <= MAX_TOP_K:
        raise InvalidArgument("sampling.top_k", f"must be in [0, {MAX_TOP_K}] (0 disables it), got {top_k}")
