"""The one ``WIDTHxHEIGHT`` parser of the suite: the SDK, its CLI, the gateway's --default-size and the REST front
(its ``size`` field and --default-size) all read sizes with it, so they accept and refuse the same texts."""
from __future__ import annotations

import argparse
import re

# Seven digits a side is far beyond any pixel budget, and keeps int() away from pathological inputs.
_SIZE = re.compile(r"([0-9]{1,7})x([0-9]{1,7})")
SIZE_FORMAT = "WIDTHxHEIGHT, e.g. 1024x1024"


def parse_size(text: str) -> tuple[int, int]:
    """``"WxH"`` (case and surrounding blanks ignored) -> (width, height), both positive; ValueError otherwise.
    Rounding to a multiple of 32 and the pixel budget are the services' business."""
    shown = repr(text[:40])  # the REST front echoes this to whoever sent the text: bounded
    m = _SIZE.fullmatch(text.strip().lower())
    if m is None:
        raise ValueError(f"size must be {SIZE_FORMAT}, got {shown}")
    width, height = int(m[1]), int(m[2])
    if width <= 0 or height <= 0:
        raise ValueError(f"size must have a positive width and height, got {shown}")
    return width, height


def size_arg(text: str) -> tuple[int, int]:
    """`parse_size` as an argparse ``type``: the error reads as the parser's own, not "invalid value"."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
