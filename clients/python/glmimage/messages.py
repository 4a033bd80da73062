"""The request messages of GatewayService built from Python arguments: sizes, formats, step-cache levels, LoRA
adapters (`Lora`, ``"NAME[:SCALE]"``), priority classes, reference images read from paths, bytes or files, and the
admin requests.
Shared by `Client`, `AsyncClient` and the CLI; nothing here opens a channel."""
from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, Any, TypedDict

from glmimage.results import ROLES
from glmimage.v1 import common_pb2, gateway_service_pb2
from glmimage.wire import formats, sizes

__all__ = ["PRIORITIES", "STEP_CACHE_LEVELS", "ImageInput", "ImageOptions", "Lora", "LoraInput", "PriorityInput",
           "build_add_worker", "build_load_loras", "build_request", "build_stream_request", "build_unload_loras",
           "lora_refs", "parse_size", "priority_value", "read_images", "step_cache_value"]


def parse_size(size: str | Sequence[int] | None) -> tuple[int, int]:
    """``"WxH"`` (glmimage.wire.sizes) or ``(w, h)`` -> (width, height); None -> (0, 0), the gateway default."""
    if size is None:
        return 0, 0
    if isinstance(size, str):
        return sizes.parse_size(size)
    width, height = size
    return int(width), int(height)


@dataclass(frozen=True)
class Lora:
    """A LoRA adapter a generation runs with: a name from `Client.list_loras` and the scale of its update (None: the
    adapter's default; 0 switches it off; the gateway admits -4 to 4 and refuses an unknown name, naming loras)."""

    name: str
    scale: float | None = None

    @classmethod
    def parse(cls, text: str) -> Lora:
        """``"NAME"`` or ``"NAME:SCALE"`` (what the CLI's --lora takes). Adapter names never hold a ':'."""
        name, sep, scale = text.partition(":")
        if not name or (sep and not scale):
            raise ValueError(f"loras: {text!r} is not NAME[:SCALE], e.g. tiny-style or tiny-style:0.8")
        if not sep:
            return cls(name)
        try:
            value = float(scale)
        except ValueError:
            raise ValueError(f"loras: {text!r}: the scale {scale!r} is not a number") from None
        if not math.isfinite(value):
            raise ValueError(f"loras: {text!r}: the scale must be a finite number")
        return cls(name, value)


# An adapter for ``loras=``: a Lora, or its "NAME[:SCALE]" string as shorthand.
LoraInput = Lora | str

# The classes a request may ask for, highest first (the gateway admits up to its tenant's max_priority).
PRIORITIES = ("interactive", "default", "batch")
# A priority for ``priority=``: a name of PRIORITIES, or a glmimage.v1.Priority value.
PriorityInput = str | int



def lora_refs(loras: LoraInput | Sequence[LoraInput]) -> list[common_pb2.LoraRef]:
    """The LoraRefs of ``loras`` (one may be passed alone), in order. Only the form is checked here: names, count,
    duplicates and ranges are the gateway's to judge (INVALID_ARGUMENT on loras), against its own directory."""
    items = [loras] if isinstance(loras, Lora | str) else list(loras)
    refs = []
    for item in items:
        lora = Lora.parse(item) if isinstance(item, str) else item
        if not isinstance(lora, Lora):
            raise TypeError(f"loras: each must be a Lora or a 'NAME[:SCALE]' string, got {type(item).__name__}")
        # Unset, not 0, when no scale is given: the adapter's own default applies (0 would switch it off).
        refs.append(common_pb2.LoraRef(name=lora.name) if lora.scale is None
                    else common_pb2.LoraRef(name=lora.name, scale=lora.scale))
    return refs


# A reference image of an edit: a path, the file's bytes, or a binary file object (read to its end).
ImageInput = str | os.PathLike[str] | bytes | bytearray | memoryview | IO[bytes]


class GenerationOptions(TypedDict, total=False):
    """A generation's options besides its prompt, count and size: what `submit_job` takes as keywords."""

    output_format: str | None
    output_compression: int | None
    seed: int | None
    steps: int | None
    guidance: float | None
    step_cache: str | None
    loras: LoraInput | Sequence[LoraInput]
    priority: PriorityInput | None


class ImageOptions(GenerationOptions, total=False):
    """The keyword arguments of `Client.edit` and `edit_stream` (and their async twins), as `generate` takes them."""

    n: int
    size: str | Sequence[int] | None


def read_images(images: ImageInput | Sequence[ImageInput]) -> list[bytes]:
    """The encoded bytes of each reference image, as given: nothing is decoded or checked here (the gateway
    checks count, sizes and formats). One image may be passed alone; an empty list is a ValueError."""
    single = isinstance(images, str | os.PathLike | bytes | bytearray | memoryview) or hasattr(images, "read")
    items = [images] if single else list(images)  # type: ignore[list-item]
    if not items:
        raise ValueError("an edit needs at least one reference image")
    return [_read_image(item) for item in items]


def _read_image(image: ImageInput) -> bytes:
    if isinstance(image, bytes | bytearray | memoryview):
        return bytes(image)
    if isinstance(image, str | os.PathLike):
        with open(image, "rb") as f:
            return f.read()
    data = image.read()
    if not isinstance(data, bytes):
        raise TypeError(f"a reference image file must be opened in binary mode, got {type(data).__name__}")
    return data


def build_request(prompt: str, *, n: int = 1, size: str | Sequence[int] | None = None,
                  output_format: str | None = None, output_compression: int | None = None,
                  seed: int | None = None, steps: int | None = None, guidance: float | None = None,
                  request_id: str = "", images: Sequence[bytes] = (), step_cache: str | None = None,
                  loras: LoraInput | Sequence[LoraInput] = (), priority: PriorityInput | None = None
                  ) -> gateway_service_pb2.GenerateImagesRequest:
    """A GenerateImagesRequest; ``images`` (encoded files, see `read_images`) make it an edit. ``step_cache``:
    ``off``, ``balanced`` or ``aggressive`` (None: off). ``loras``: the adapters the DiT runs with (`Lora`s or
    ``"NAME[:SCALE]"`` strings; none: the base model). ``priority``: ``interactive``, ``default`` or ``batch`` (or
    the Priority enum; None: unspecified, which the gateway takes as default)."""
    width, height = parse_size(size)
    fmt = common_pb2.IMAGE_FORMAT_UNSPECIFIED if output_format is None else formats.by_name(output_format).proto
    req = gateway_service_pb2.GenerateImagesRequest(
        prompt=prompt, n=n, height=height, width=width, output_format=fmt, num_inference_steps=steps or 0,
        request_id=request_id, reference_images=[common_pb2.ReferenceImage(data=data) for data in images],
        step_cache=step_cache_value(step_cache), loras=lora_refs(loras), priority=priority_value(priority))
    if output_compression is not None:
        req.output_compression = output_compression
    if seed is not None:
        req.seed = seed
    if guidance is not None:
        req.guidance_scale = guidance
    return req


STEP_CACHE_LEVELS = ("off", "balanced", "aggressive")


def step_cache_value(level: str | None) -> int:
    """The StepCache enum value of a level name (None: unspecified, which the servers take as off)."""
    if level is None:
        return common_pb2.STEP_CACHE_UNSPECIFIED
    if level not in STEP_CACHE_LEVELS:
        raise ValueError(f"step_cache must be one of {', '.join(STEP_CACHE_LEVELS)}, got {level!r}")
    return common_pb2.StepCache.Value(f"STEP_CACHE_{level.upper()}")


def priority_value(priority: PriorityInput | None) -> int:
    """The Priority enum value of a class name or enum value (None: unspecified). Anything else is a ValueError
    naming ``priority``, raised before any call."""
    if priority is None:
        return gateway_service_pb2.PRIORITY_UNSPECIFIED
    if isinstance(priority, str) and priority in PRIORITIES:
        return gateway_service_pb2.Priority.Value(f"PRIORITY_{priority.upper()}")
    # bool is an int to Python, but True is no class anyone means.
    if isinstance(priority, int) and not isinstance(priority, bool) \
            and priority in gateway_service_pb2.Priority.values():
        return priority
    raise ValueError(f"priority must be one of {', '.join(PRIORITIES)} (or a glmimage.v1.Priority value), "
                     f"got {priority!r}")


def build_stream_request(prompt: str, *, partial_images: int = 0, **fields: Any
                         ) -> gateway_service_pb2.GenerateImagesStreamRequest:
    return gateway_service_pb2.GenerateImagesStreamRequest(request=build_request(prompt, **fields),
                                                           partial_images=partial_images)


def _names(names: str | Sequence[str], method: str) -> list[str]:
    """Adapter names for LoadLoras/UnloadLoras: one may be passed alone (not as its characters); none is an error."""
    items = [names] if isinstance(names, str) else list(names)
    if not items:
        raise ValueError(f"{method} needs at least one adapter name")
    return items


def build_load_loras(names: str | Sequence[str], workers: str | Sequence[str] = ()
                     ) -> gateway_service_pb2.LoadLorasRequest:
    return gateway_service_pb2.LoadLorasRequest(names=_names(names, "load_loras"),
                                                workers=[workers] if isinstance(workers, str) else list(workers))


def build_unload_loras(names: str | Sequence[str], workers: str | Sequence[str] = ()
                       ) -> gateway_service_pb2.UnloadLorasRequest:
    return gateway_service_pb2.UnloadLorasRequest(names=_names(names, "unload_loras"),
                                                  workers=[workers] if isinstance(workers, str) else list(workers))


def build_add_worker(address: str, role: str) -> gateway_service_pb2.AddWorkerRequest:
    if role not in ROLES:
        raise ValueError(f"role must be one of {sorted(ROLES)}, got {role!r}")
    return gateway_service_pb2.AddWorkerRequest(address=address, role=ROLES[role])
