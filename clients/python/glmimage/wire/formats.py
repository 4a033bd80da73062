"""The one image-format map of the suite: each format's API name (OpenAI's ``output_format``, the CLI's --format),
its ``glmimage.v1.ImageFormat`` value, MIME type, Pillow format name and file extension. The SDK, the REST front
and the denoiser's encoder all read it from here."""
from __future__ import annotations

from dataclasses import dataclass

from glmimage.v1 import common_pb2


@dataclass(frozen=True)
class Format:
    name: str  # as the APIs spell it: "png", "jpeg", "webp"
    proto: common_pb2.ImageFormat.ValueType
    mime: str
    pil: str  # Pillow's format name, for Image.save
    extension: str  # for file names: "jpg", not "jpeg"


PNG = Format("png", common_pb2.IMAGE_FORMAT_PNG, "image/png", "PNG", "png")
JPEG = Format("jpeg", common_pb2.IMAGE_FORMAT_JPEG, "image/jpeg", "JPEG", "jpg")
WEBP = Format("webp", common_pb2.IMAGE_FORMAT_WEBP, "image/webp", "WEBP", "webp")
DEFAULT = PNG  # what IMAGE_FORMAT_UNSPECIFIED means to the denoiser

BY_NAME: dict[str, Format] = {f.name: f for f in (PNG, JPEG, WEBP)}
BY_PROTO: dict[int, Format] = {f.proto: f for f in BY_NAME.values()}
# name -> ImageFormat value: what a request carries.
FORMATS: dict[str, common_pb2.ImageFormat.ValueType] = {f.name: f.proto for f in BY_NAME.values()}


def by_name(name: str) -> Format:
    """The format an API name (any case) names; ValueError listing the choices otherwise."""
    try:
        return BY_NAME[name.lower()]
    except KeyError:
        raise ValueError(f"output_format must be one of {sorted(BY_NAME)}, got {name!r}") from None


def name_of(value: int, default: str = DEFAULT.name) -> str:
    """The API name of an ImageFormat value; ``default`` for IMAGE_FORMAT_UNSPECIFIED and for a value this build
    does not know (proto3 enums are open, so a newer server may send one)."""
    fmt = BY_PROTO.get(value)
    return default if fmt is None else fmt.name
