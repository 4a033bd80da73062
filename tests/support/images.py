"""Small real image files for tests: what a client would upload as a reference."""
from __future__ import annotations

import io

from PIL import Image


def image_file(size: tuple[int, int] = (64, 64), fmt: str = "PNG", color: tuple[int, int, int] = (200, 30, 30)
               ) -> bytes:
    """A solid ``color`` image of ``size`` (width, height), encoded as ``fmt``."""
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format=fmt)
    return buf.getvalue()
