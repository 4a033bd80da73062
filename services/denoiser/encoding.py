"""Image encoding with Pillow: PNG, JPEG and WebP. Names, ImageFormat values and Pillow format names come from
the suite's one format map, glmimage.formats; the encoder options (quality, zlib level) are this module's."""
from __future__ import annotations

import enum
import io

from PIL import Image

from glmimage import formats


class ImageFormat(enum.Enum):
    PNG = formats.PNG.name
    JPEG = formats.JPEG.name
    WEBP = formats.WEBP.name

    @property
    def spec(self) -> formats.Format:
        return formats.BY_NAME[self.value]


DEFAULT_QUALITY = 90  # JPEG/WebP when the request gives no output_compression
DEFAULT_PNG_LEVEL = 6  # zlib's own default: a good size/time balance
PNG_LEVELS = range(10)


def png_level(compression: int | None, default: int = DEFAULT_PNG_LEVEL) -> int:
    """OpenAI's output_compression (0-100) scaled to zlib's 0-9; the server's configured level when unset."""
    return default if compression is None else round(compression * 9 / 100)


def encode(image: Image.Image, fmt: ImageFormat, compression: int | None = None,
           default_png_level: int = DEFAULT_PNG_LEVEL) -> bytes:
    """compression is OpenAI's output_compression, 0-100: quality for JPEG/WebP, scaled to zlib 0-9 for PNG."""
    buf = io.BytesIO()
    quality = DEFAULT_QUALITY if compression is None else compression
    if fmt is ImageFormat.PNG:
        image.save(buf, format=fmt.spec.pil, compress_level=png_level(compression, default_png_level))
    elif fmt is ImageFormat.JPEG:
        image.convert("RGB").save(buf, format=fmt.spec.pil, quality=quality)  # JPEG has no alpha
    else:
        image.save(buf, format=fmt.spec.pil, quality=quality)
    return buf.getvalue()
