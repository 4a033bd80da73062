"""Image encoding with Pillow: PNG, JPEG and WebP. Names, ImageFormat values and Pillow format names come from
the suite's one format map, glmimage.wire.formats; the encoder options (quality, zlib level) are this module's."""
from __future__ import annotations

import enum
import io

from PIL import Image

from glmimage.wire import formats


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
    """OpenAI's output_compression (0-100) as zlib's level; the server's configured level when unset.

    The same direction as JPEG/WebP quality: 100 (OpenAI's default) compresses least (zlib 0, stored: fastest,
    largest), 0 compresses most (zlib 9). PNG stays lossless at every level; only size and time change."""
    return default if compression is None else round((100 - compression) * 9 / 100)


def encode(image: Image.Image, fmt: ImageFormat, compression: int | None = None,
           default_png_level: int = DEFAULT_PNG_LEVEL) -> bytes:
    """compression is OpenAI's output_compression, 0-100, 100 the least compressed: quality for JPEG/WebP, zlib
    level 9 (at 0) to 0 (at 100) for PNG."""
    buf = io.BytesIO()
    quality = DEFAULT_QUALITY if compression is None else compression
    if fmt is ImageFormat.PNG:
        image.save(buf, format=fmt.spec.pil, compress_level=png_level(compression, default_png_level))
    elif fmt is ImageFormat.JPEG:
        image.convert("RGB").save(buf, format=fmt.spec.pil, quality=quality)  # JPEG has no alpha
    else:
        image.save(buf, format=fmt.spec.pil, quality=quality)
    return buf.getvalue()
