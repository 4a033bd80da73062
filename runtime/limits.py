"""The one limits model: every bound a request must respect, the checks that apply it, and its wire form.

Who reads it:
- the AR and the denoiser run with a ``Limits`` built from their flags (``--max-steps`` ...), check every request
  against it, and serve the part each of them applies over ``GetLimits`` (AR_FIELDS, DENOISER_FIELDS);
- the gateway reads its workers' limits when each joins and keeps them per worker (runtime.capability):
  it admits what some worker of each stage can run, never more than its own flags, and refuses the rest, the field
  named; its ``GetLimits`` serves that (what the pool can do);
- the REST front advertises the gateway's limits in /openapi.json (``maxLength``/``maximum``) and bounds bodies.

Torch-free and gRPC-free apart from the protobuf conversion, so every process imports it.
"""
from __future__ import annotations

import argparse
import dataclasses
import io
import math
import re
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from glmimage.v1 import common_pb2
from runtime.errors import InvalidArgument

# Output i of a request uses seed + i: the last one must fit the uint32 seed space too.
SEED_SPACE = 2**32
# The AR grid is H/32 x W/32 (upsampled 2x to the DiT's H/16 x W/16): both stages round sizes up to this.
SIZE_MULTIPLE = 32
# One prior token per 16x16 pixels, for the target and each reference alike.
TOKEN_PATCH = 16
# AR sampling ranges (fixed by the model's sampler, not configurable): temperature in (0, 2], top_p in (0, 1].
MAX_TEMPERATURE = 2.0
MAX_TOP_K = 1_000_000
# output_compression is a percentage for every format.
MAX_OUTPUT_COMPRESSION = 100
# The REST front reads at most this many bytes of a JSON body (--max-body-bytes) and answers 413 past it.
DEFAULT_MAX_BODY_BYTES = 1 << 20
# Identifiers a worker logs and repeats to others: DenoiseRequest.owner and request_id (WatchOccupancy sends them to
# every gateway that follows the denoiser), GenerateRequest.request_id. A gateway's are well within it: its instance
# id is host-pid-hex, a request id at most the 128 characters of x-request-id plus ".N" telling duplicates apart.
MAX_ID_CHARS = 256
# How elongated an image may be, long side over short side, the target and every reference alike: GLM-Image's
# processor keeps references within it (smart_resize), and a target past it would be a strip the model never saw.
MAX_ASPECT = 4.0
# LoRA adapter names: a file name in the denoiser's adapter directory, never a path (no '/', no '..', no NUL).
MAX_LORA_NAME_CHARS = 128
_LORA_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
# An adapter's scale multiplies its low-rank update: 0 switches it off, negative values invert it; past a few the
# image is noise, so the range is fixed like the AR's sampling ranges rather than configurable.
MAX_LORA_SCALE = 4.0


@dataclass(frozen=True)
class Limits:
    """The configurable bounds. Each server holds a complete set; on the wire it sends only the fields it applies."""

    max_prompt_chars: int = 8192
    max_n: int = 10  # outputs one request may ask for (OpenAI's n is 1-10)
    max_pixels: int = 2048 * 2048  # after rounding each side up to SIZE_MULTIPLE
    max_steps: int = 200
    max_guidance: float = 30.0
    # Output rows in one AR model batch (the sum of n over a GenerateBatch call): bounds KV-cache memory.
    max_batch_outputs: int = 32
    max_partial_images: int = 3  # OpenAI's partial_images range is 0-3
    # Edits: OpenAI's images.edit takes up to 16 images. Per file and per request byte bounds keep every hop's
    # message under the 64 MiB the gateway's worker channels carry; the pixel bound is read from the header, so a
    # small file that claims a huge image (a decompression bomb) is refused before anything decodes it.
    max_reference_images: int = 16
    max_reference_bytes: int = 8 << 20
    max_reference_total_bytes: int = 32 << 20
    max_reference_pixels: int = 4096 * 4096
    # Not a bound but a capability, kept per denoiser like the bounds (the gateway serves the cached levels where
    # one of them can, and places those jobs there): whether the cached StepCache levels are served. A denoiser sets
    # it from what its model and diffusers support.
    step_cache: bool = False
    # LoRA adapters (services.denoiser.adapters): how many one job may name, and the largest adapter file a denoiser
    # loads (rank from its lora_A/lora_B shapes, bytes on disk). A denoiser without an adapter directory advertises
    # max_loras_per_request 0, so the gateway never places an adapter job on it.
    max_loras_per_request: int = 4
    max_lora_rank: int = 256
    max_lora_bytes: int = 512 << 20

    @property
    def max_request_outputs(self) -> int:
        """The most outputs one request may ask for: n, and one AR batch must hold them all."""
        return min(self.max_n, self.max_batch_outputs)

    def to_proto(self, fields: Iterable[str] = ()) -> common_pb2.Limits:
        """The wire form of ``fields`` (all of them when empty)."""
        names = tuple(fields) or FIELDS
        return common_pb2.Limits(**{name: getattr(self, name) for name in names})


FIELDS = tuple(f.name for f in dataclasses.fields(Limits))  # every field on the wire
# Capabilities: advertised and merged like bounds, but set by the server itself, never by a --max-* flag.
DENOISER_CAPABILITIES = ("step_cache",)
BOUNDS = tuple(name for name in FIELDS if name not in DENOISER_CAPABILITIES)  # what the --max-* flags set

# ---- the largest legitimate request message ---------------------------------------------------------------------

# A token id on the wire: a packed int32 varint of a non-negative id takes at most 5 bytes.
TOKEN_WIRE_BYTES = 5
# A prompt character in UTF-8: at most 4 bytes.
PROMPT_CHAR_BYTES = 4
# Tags, lengths, sizes, ids and sampling fields: far less than this in any request.
MESSAGE_SLACK_BYTES = 256 << 10


def max_request_bytes(limits: Limits, *, prompts: int = 1, tokens: bool = False) -> int:
    """The largest request message a server of these limits must receive, and so its gRPC receive limit: the
    reference files of one edit, ``prompts`` prompts (an AR batch carries up to max_batch_outputs) and, with
    ``tokens`` (a denoise job), the prior tokens of the target and of every reference at their largest."""
    size = limits.max_reference_total_bytes + prompts * PROMPT_CHAR_BYTES * limits.max_prompt_chars
    if tokens:
        pixels = limits.max_pixels + limits.max_reference_images * limits.max_reference_pixels
        size += TOKEN_WIRE_BYTES * (pixels // TOKEN_PATCH**2)
    return size + MESSAGE_SLACK_BYTES
# What each server applies, and so advertises: the gateway must not take a default it never checks as a bound.
REFERENCE_FIELDS = ("max_reference_images", "max_reference_bytes", "max_reference_total_bytes", "max_reference_pixels")
AR_FIELDS = ("max_prompt_chars", "max_n", "max_pixels", "max_batch_outputs", *REFERENCE_FIELDS)
LORA_FIELDS = ("max_loras_per_request", "max_lora_rank", "max_lora_bytes")
DENOISER_FIELDS = ("max_prompt_chars", "max_pixels", "max_steps", "max_guidance", "max_partial_images",
                   *REFERENCE_FIELDS, *LORA_FIELDS)


def advertised(message: common_pb2.Limits) -> dict[str, float]:
    """The bounds a ``Limits`` message sets (unset fields bound nothing)."""
    return {name: getattr(message, name) for name in FIELDS if message.HasField(name)}


def from_proto(message: common_pb2.Limits, base: Limits = Limits()) -> Limits:
    """``base`` with the bounds ``message`` sets (a full message, such as the gateway's, sets them all)."""
    return dataclasses.replace(base, **advertised(message))


def from_advertised(bounds: Mapping[str, float], base: Limits = Limits()) -> Limits:
    """``base`` with the bounds of an advertisement (what ``advertised`` read), each in its field's own type."""
    return dataclasses.replace(base, **{name: type(getattr(Limits, name))(value) for name, value in bounds.items()})


def limits_in_force(own: Mapping[str, float], ar: Iterable[Mapping[str, float]],
                    denoisers: Iterable[Mapping[str, float]]) -> Limits:
    """What the gateway admits (and serves over GetLimits): for each role, the most any of its workers advertises
    (for a capability, whether any has it), the default for a role none has advertised yet; for a bound both roles
    apply, the lesser of the two roles' unions; never more than the gateway's own flags.

    Each role's union, not its tightest: each worker's limits are kept apart (runtime.capability), a request
    within the union but past every single worker of a stage (a combination none serves) is refused by
    ``Members.capable``, and the scheduler places each AR batch and each denoise job only on a worker that can run
    every request in it.
    """
    bounds: dict[str, float] = {}
    for fields, advertisements in ((AR_FIELDS, list(ar)), (DENOISER_FIELDS + DENOISER_CAPABILITIES, list(denoisers))):
        for name in fields:
            value = max([a[name] for a in advertisements if name in a] or [getattr(Limits, name)])
            bounds[name] = min(bounds.get(name, value), value)
    for name, value in own.items():
        bounds[name] = min(bounds.get(name, value), value)
    return from_advertised(bounds)


# ---- the checks ------------------------------------------------------------------------------------------------

def round_up(value: int, multiple: int = SIZE_MULTIPLE) -> int:
    return -(-value // multiple) * multiple


def check_prompt(prompt: str, limits: Limits, why_needed: str = "") -> None:
    if not prompt or not prompt.strip():
        raise InvalidArgument("prompt", "must not be empty" + (f" ({why_needed})" if why_needed else ""))
    if len(prompt) > limits.max_prompt_chars:
        raise InvalidArgument("prompt", f"is {len(prompt)} characters; the limit is {limits.max_prompt_chars}")


def valid_id(value: str) -> bool:
    """An identifier fit for logs and for other gateways: at most MAX_ID_CHARS printable ASCII characters."""
    return len(value) <= MAX_ID_CHARS and value.isascii() and (value.isprintable() or not value)


def check_id(value: str, field: str) -> None:
    """InvalidArgument naming ``field`` unless ``value`` is empty or a valid_id."""
    if len(value) > MAX_ID_CHARS:
        raise InvalidArgument(field, f"is {len(value)} characters; the limit is {MAX_ID_CHARS}")
    if not valid_id(value):
        raise InvalidArgument(field, "must be printable ASCII")


def check_n(n: int, limits: Limits) -> int:
    """The output count, 0 meaning 1 (proto3's unset)."""
    n = n or 1
    if not 1 <= n <= limits.max_request_outputs:
        # In the client's terms: the operator's flag (--max-batch-outputs) is not theirs to change.
        why = (f" (this server generates at most {limits.max_batch_outputs} images in one batch)"
               if limits.max_batch_outputs < limits.max_n else "")
        raise InvalidArgument("n", f"must be between 1 and {limits.max_request_outputs}{why}, got {n}")
    return n


def model_size(height: int, width: int, limits: Limits) -> tuple[int, int]:
    """The size the model runs at: each side rounded up to a multiple of 32, within the pixel budget and the aspect
    bound. Messages give the size as the suite writes it, WIDTHxHEIGHT (REST's ``size``), whichever field is named."""
    for name, value in (("height", height), ("width", width)):
        if value <= 0:
            raise InvalidArgument(name, f"must be positive, got {value}")
    size = f"{width}x{height} (width x height)"
    # Named after the larger side: 32x4294967296 is the width's fault, not the height's.
    longer = "height" if height > width else "width"
    # Checked as asked; the rounded size is then within it too (4 * round_up(short) is a multiple of 32).
    if max(height, width) > MAX_ASPECT * min(height, width):
        raise InvalidArgument(longer, f"{size} is more elongated than {MAX_ASPECT:g}:1")
    h, w = round_up(height), round_up(width)
    if h * w > limits.max_pixels:
        rounded = f"; {w}x{h} after rounding each side up to a multiple of {SIZE_MULTIPLE}" if (h, w) != (
            height, width) else ""
        raise InvalidArgument("height" if h >= w else "width",
                              f"{size} exceeds the limit of {limits.max_pixels} pixels{rounded}")
    return h, w


def check_steps(steps: int, limits: Limits) -> None:
    """Denoising steps; 0 (unset) takes the server's default, so it is not checked here."""
    if steps and not 1 <= steps <= limits.max_steps:
        raise InvalidArgument("num_inference_steps",
                              f"must be between 1 and {limits.max_steps} (0: the default), got {steps}")


_FLOAT32 = struct.Struct("f")
_FLOAT32_MAX = 3.4028234663852886e38


def _as_float32(value: float) -> float:
    return float(_FLOAT32.unpack(_FLOAT32.pack(value))[0])


def float_text(value: float) -> str:
    """A float in the client's terms: the shortest decimal that is the same float32. Proto floats (guidance, and the
    max_guidance GetLimits carries) are float32: 30.01 comes back as 30.010000228881836, and is shown as 30.01."""
    if not math.isfinite(value) or abs(value) > _FLOAT32_MAX:
        return f"{value:g}"
    target = _as_float32(value)
    number = next(n for n in (float(f"{value:.{digits}g}") for digits in range(1, 10)) if _as_float32(n) == target)
    return str(int(number)) if number.is_integer() and abs(number) < 1e16 else repr(number)


def check_guidance(guidance: float | None, limits: Limits) -> None:
    # `not (a <= x <= b)` also refuses NaN.
    if guidance is not None and not 0.0 <= guidance <= limits.max_guidance:
        raise InvalidArgument("guidance_scale", f"must be between 0 and {float_text(limits.max_guidance)}, "
                                                f"got {float_text(guidance)}")


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


def check_step_cache(level: int, limits: Limits) -> None:
    """A StepCache value on the wire (proto3 enums are open): a declared level, and a cached one only where the
    denoiser (for the gateway: one of its denoisers) can cache (``limits.step_cache``)."""
    if level not in common_pb2.StepCache.values():
        raise InvalidArgument("step_cache", f"unknown level {level}; expected off, balanced or aggressive")
    if level not in (common_pb2.STEP_CACHE_UNSPECIFIED, common_pb2.STEP_CACHE_OFF) and not limits.step_cache:
        name = common_pb2.StepCache.Name(level).removeprefix("STEP_CACHE_").lower()
        raise InvalidArgument("step_cache", f"{name} is not served here: the denoisers cannot cache steps; use off")


def unknown_lora(index: int, name: str) -> InvalidArgument:
    """A request naming an adapter the pool (or the one denoiser asked) does not serve."""
    return InvalidArgument("loras", f"loras[{index}]: no adapter named {name!r} is served here (ListLoras, or GET "
                                    "/v1/models on the REST front, lists those that are)")


def check_lora_name(name: str, field: str) -> None:
    """An adapter name is a file name in the adapter directory: never a path, a parent or a hidden file."""
    if not 1 <= len(name) <= MAX_LORA_NAME_CHARS:
        raise InvalidArgument(field, f"must be 1 to {MAX_LORA_NAME_CHARS} characters, got {len(name)}")
    if not _LORA_NAME.fullmatch(name) or ".." in name:
        raise InvalidArgument(field, f"{name!r} is not an adapter name: letters, digits, '.', '_' and '-', starting "
                                     "with a letter or digit, no '..'")


def check_loras(refs: Sequence[Any], limits: Limits) -> None:
    """A request's adapters (anything with ``name`` and ``scale``: LoraRef messages or the denoiser's own): how many,
    each name's form (not whether it exists: the denoiser knows that), no name twice, each scale finite and within
    [-MAX_LORA_SCALE, MAX_LORA_SCALE]. A scale of None (unset on the wire) takes the adapter's default."""
    if len(refs) > limits.max_loras_per_request:
        why = " (this server serves no LoRA adapters)" if limits.max_loras_per_request == 0 else ""
        raise InvalidArgument("loras", f"{len(refs)} adapters; a request takes at most "
                                       f"{limits.max_loras_per_request}{why}")
    seen: dict[str, int] = {}
    for i, ref in enumerate(refs):
        check_lora_name(ref.name, f"loras[{i}].name")
        if ref.name in seen:
            raise InvalidArgument(f"loras[{i}].name", f"{ref.name!r} is already loras[{seen[ref.name]}]")
        seen[ref.name] = i
        # `not a <= x <= b` also refuses NaN; infinity is past the bound.
        if ref.scale is not None and not -MAX_LORA_SCALE <= ref.scale <= MAX_LORA_SCALE:
            raise InvalidArgument(f"loras[{i}].scale", f"must be between {-MAX_LORA_SCALE:g} and "
                                                       f"{MAX_LORA_SCALE:g}, got {float_text(ref.scale)}")


def check_lora_names(names: Sequence[str], limits: Limits | None, field: str = "names") -> None:
    """The adapter names of a LoadLoras/UnloadLoras request: each name's form (``names[i]``), no name twice, and with
    ``limits`` (a load: what one job could name at once) how many (``names``). Torch-free, for the gateway too."""
    if limits is not None and len(names) > limits.max_loras_per_request:
        why = " (this server serves no LoRA adapters)" if limits.max_loras_per_request == 0 else ""
        raise InvalidArgument(field, f"{len(names)} adapters; a request takes at most "
                                     f"{limits.max_loras_per_request}{why}")
    seen: dict[str, int] = {}
    for i, name in enumerate(names):
        check_lora_name(name, f"{field}[{i}]")
        if name in seen:
            raise InvalidArgument(f"{field}[{i}]", f"{name!r} is already {field}[{seen[name]}]")
        seen[name] = i


def check_partial_images(count: int, limits: Limits) -> None:
    if not 0 <= count <= limits.max_partial_images:
        raise InvalidArgument("partial_images", f"must be between 0 and {limits.max_partial_images}, got {count}")


# Reference images are decoded by Pillow; these are the formats the API accepts (OpenAI's: PNG, JPEG, WebP).
REFERENCE_FORMATS = ("PNG", "JPEG", "WEBP")


def check_reference_totals(count: int, total_bytes: int, limits: Limits) -> None:
    """An edit's references as a whole: how many, and their bytes together (both on ``reference_images``). One rule
    for the images themselves (check_reference_images) and for a summary of them (runtime.capability)."""
    if count > limits.max_reference_images:
        raise InvalidArgument("reference_images",
                              f"{count} images; an edit takes at most {limits.max_reference_images}")
    if total_bytes > limits.max_reference_total_bytes:
        raise InvalidArgument("reference_images", f"{total_bytes} bytes in all; the limit is "
                                                  f"{limits.max_reference_total_bytes}")


def check_reference_images(images: Sequence[bytes], limits: Limits) -> list[tuple[int, int]]:
    """Each reference's (width, height) from its header, or InvalidArgument naming it (``reference_images[i]``).

    Only the header is read here: nothing is decoded, so a file that claims more than max_reference_pixels costs
    nothing. A file whose header is sound but whose data is not (truncated) fails where it is decoded, with the
    same field named.
    """
    from PIL import Image, UnidentifiedImageError  # servers only: the SDK never checks images

    check_reference_totals(len(images), sum(len(data) for data in images), limits)
    sizes = []
    for i, data in enumerate(images):
        name = f"reference_images[{i}]"
        if len(data) > limits.max_reference_bytes:
            raise InvalidArgument(name, f"is {len(data)} bytes; the limit is {limits.max_reference_bytes}")
        try:
            with Image.open(io.BytesIO(data)) as image:  # lazy: parses the header, decodes nothing
                fmt, (width, height) = image.format, image.size
        except Image.DecompressionBombError:  # Pillow's own guard, far above ours: the header claims a huge image
            raise InvalidArgument(name, f"declares more pixels than the limit of {limits.max_reference_pixels}"
                                  ) from None
        except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
            raise InvalidArgument(name, "is not a PNG, JPEG or WebP image") from None
        if fmt not in REFERENCE_FORMATS:
            raise InvalidArgument(name, f"is {fmt}; use PNG, JPEG or WebP")
        if width < 1 or height < 1 or width * height > limits.max_reference_pixels:
            raise InvalidArgument(name, f"declares {width}x{height} pixels; the limit is "
                                        f"{limits.max_reference_pixels} pixels")
        if max(width, height) > MAX_ASPECT * min(width, height):
            raise InvalidArgument(name, f"{width}x{height} is more elongated than {MAX_ASPECT:g}:1")
        sizes.append((width, height))
    return sizes


def check_output_compression(value: int | None) -> None:
    if value is not None and not 0 <= value <= MAX_OUTPUT_COMPRESSION:
        raise InvalidArgument("output_compression",
                              f"must be between 0 and {MAX_OUTPUT_COMPRESSION}, got {value}")



# ---- flags -----------------------------------------------------------------------------------------------------

FLAG_HELP = {
    "max_prompt_chars": "characters of a prompt",
    "max_n": "outputs one request may ask for",
    "max_pixels": "height x width after rounding each side up to a multiple of 32",
    "max_steps": "denoising steps of one image",
    "max_guidance": "guidance scale",
    "max_batch_outputs": "output rows in one AR model batch (the sum of n over a GenerateBatch call)",
    "max_partial_images": "partial previews of one streamed image",
    "max_reference_images": "reference images of one edit",
    "max_reference_bytes": "bytes of one reference image file",
    "max_reference_total_bytes": "bytes of all the reference images of one edit",
    "max_reference_pixels": "pixels a reference image may declare in its header (checked before decoding)",
    "max_loras_per_request": "LoRA adapters one job may name (0: none)",
    "max_lora_rank": "rank of a LoRA adapter, read from its lora_A/lora_B shapes before it is loaded",
    "max_lora_bytes": "bytes of a LoRA adapter file",
}


def add_limit_args(parser: argparse.ArgumentParser, fields: Iterable[str], *, follow_workers: bool = False) -> None:
    """``--max-*`` flags for ``fields``. A worker's default is the model's default; with ``follow_workers`` (the
    gateway) a flag left out means "whatever the workers apply"."""
    for name in fields:
        default = getattr(Limits, name)
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=None,
                            help=FLAG_HELP[name] + (" (default: what the workers apply)" if follow_workers
                                                    else f" (default {default})"))


# The largest value each limit's wire field carries: a flag past it could not be served over GetLimits.
_WIRE_MAX = {f.name: {f.TYPE_UINT32: 2**32 - 1, f.TYPE_UINT64: 2**64 - 1}.get(f.type, 3.4e38)
             for f in common_pb2.Limits.DESCRIPTOR.fields}


# Bounds whose 0 refuses only what asks for them: no guidance, no adapters.
_ZERO_ALLOWED = ("max_guidance", "max_loras_per_request")


def limits_from_args(args: argparse.Namespace, fields: Iterable[str]) -> dict[str, float]:
    """The ``--max-*`` flags given; SystemExit with a message for one that would refuse everything, or that is
    beyond what GetLimits can carry (the worker would then fail every gateway's limits read)."""
    given = {name: getattr(args, name) for name in fields if getattr(args, name) is not None}
    for name, value in given.items():
        low = 0 if name in _ZERO_ALLOWED else 1
        # `not a <= x <= b` also refuses NaN (and infinity, past the float maximum).
        if not low <= value <= _WIRE_MAX[name]:
            raise SystemExit(f"--{name.replace('_', '-')} must be between {low} and {_WIRE_MAX[name]:g}, "
                             f"got {value}")
    return given
