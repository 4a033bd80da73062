"""What the clients hand back: results, stream events and status, built from the gateway's protobuf replies.

Shared by `Client` and `AsyncClient` (glmimage.client), so both parse every reply the same way.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from pathlib import Path

from glmimage.ratelimits import RateLimits
from glmimage.v1 import common_pb2, gateway_service_pb2
from glmimage.wire import formats

_ROLE_NAMES = {gateway_service_pb2.WORKER_ROLE_AR: "ar", gateway_service_pb2.WORKER_ROLE_DENOISER: "denoiser"}
ROLES = {v: k for k, v in _ROLE_NAMES.items()}
_STATE_NAMES = {gateway_service_pb2.WORKER_STATE_AVAILABLE: "available", gateway_service_pb2.WORKER_STATE_BUSY: "busy",
                gateway_service_pb2.WORKER_STATE_UNHEALTHY: "unhealthy",
                gateway_service_pb2.WORKER_STATE_DRAINING: "draining"}


# --- results -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    reasoning_tokens: int = 0
    cached_tokens: int = 0
    image_tokens: int = 0  # of prompt_tokens, those from an edit's reference images (0 for text-to-image)

    @classmethod
    def from_proto(cls, u: common_pb2.Usage) -> Usage:
        return cls(**{f.name: getattr(u, f.name) for f in fields(cls)})

    def as_dict(self) -> dict[str, int]:
        """The proto's field names and values (what grpcurl and the Node client print)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class GenerationResult:
    """Images in output order (encoded bytes), the seed of each, per-image and summed usage, and the tenant's
    quotas as the gateway reported them with the call (``rate_limits``; empty without quotas)."""

    images: list[bytes]
    seeds: list[int]
    usage: Usage
    image_usages: list[Usage]
    width: int
    height: int
    output_format: str
    request_id: str = ""
    rate_limits: RateLimits = field(default_factory=RateLimits)

    @classmethod
    def from_proto(cls, r: gateway_service_pb2.GenerateImagesResponse,
                   rate_limits: RateLimits | None = None) -> GenerationResult:
        ordered = sorted(r.images, key=lambda im: im.index)
        return cls(images=[im.image for im in ordered], seeds=[im.seed for im in ordered],
                   usage=Usage.from_proto(r.usage), image_usages=[Usage.from_proto(im.usage) for im in ordered],
                   width=r.width, height=r.height, output_format=formats.name_of(r.output_format),
                   request_id=r.request_id, rate_limits=RateLimits() if rate_limits is None else rate_limits)

    @property
    def extension(self) -> str:
        fmt = formats.BY_NAME.get(self.output_format)
        return self.output_format if fmt is None else fmt.extension

    def save(self, directory: str | Path, stem: str = "image", *, overwrite: bool = True) -> list[Path]:
        """Write ``<stem>-<i>.<ext>`` into ``directory`` (created if missing); returns the paths. With
        ``overwrite=False`` a file that exists already raises FileExistsError instead."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        paths = []
        for i, data in enumerate(self.images):
            path = out / f"{stem}-{i}.{self.extension}"
            with open(path, "wb" if overwrite else "xb") as f:
                f.write(data)
            paths.append(path)
        return paths


@dataclass(frozen=True)
class Progress:
    """A denoising step finished for one image."""

    image_index: int
    step: int
    total_steps: int


@dataclass(frozen=True)
class PartialImage:
    """A preview of one image part-way through denoising."""

    image_index: int
    partial_image_index: int
    image: bytes


@dataclass(frozen=True)
class Completed:
    """The last event of a successful stream."""

    result: GenerationResult


StreamEvent = Progress | PartialImage | Completed


@dataclass(frozen=True)
class WorkerInfo:
    address: str  # empty unless the caller has the admin role (or the gateway checks no keys)
    role: str  # "ar" or "denoiser"
    state: str  # "available", "busy", "unhealthy", "draining"
    inflight: int
    current_job: str
    health: str = ""  # why it is (not) usable: "serving", "unreachable", "not answering health checks (hung)", ...
    stuck: bool = False  # connected but making no progress (hung, or a call to it timed out), not gone
    held_elsewhere: bool = False  # a denoiser busy with another gateway's job
    health_detail: str = ""  # what the worker said, e.g. its refusal of the gateway's credential (admin role only)
    loras_loaded: list[str] = field(default_factory=list)  # a denoiser's adapters in memory, least recently used first


@dataclass(frozen=True)
class TenantInfo:
    """One tenant as the gateway sees it (GetStatus: every tenant to the admin role, else the caller's own). Quotas
    are 0 when the tenant has none."""

    name: str
    weight: float
    pending_ar_requests: int
    pending_denoise_outputs: int
    active_requests: int
    inflight_images: int
    oldest_wait_seconds: float
    requests_total: int
    images_total: int
    requests_per_minute: int
    images_per_minute: int
    max_inflight_images: int
    remaining_requests: int
    remaining_images: int
    max_priority: str  # "interactive", "default" or "batch"

    @classmethod
    def from_proto(cls, t: gateway_service_pb2.TenantStatus) -> TenantInfo:
        values = {f.name: getattr(t, f.name) for f in fields(cls) if f.name != "max_priority"}
        return cls(**values, max_priority=_PRIORITY_NAMES.get(t.max_priority, "default"))


_PRIORITY_NAMES = {gateway_service_pb2.PRIORITY_INTERACTIVE: "interactive",
                   gateway_service_pb2.PRIORITY_DEFAULT: "default", gateway_service_pb2.PRIORITY_BATCH: "batch"}


@dataclass(frozen=True)
class Status:
    pending_ar_requests: int
    pending_ar_outputs: int
    pending_denoise_outputs: int
    active_requests: int
    workers: list[WorkerInfo] = field(default_factory=list)
    tenants: list[TenantInfo] = field(default_factory=list)

    @classmethod
    def from_proto(cls, s: gateway_service_pb2.GetStatusResponse) -> Status:
        return cls(s.pending_ar_requests, s.pending_ar_outputs, s.pending_denoise_outputs, s.active_requests,
                   [WorkerInfo(w.address, _ROLE_NAMES.get(w.role, "unspecified"),
                               _STATE_NAMES.get(w.state, "unspecified"), w.inflight, w.current_job, w.health,
                               w.stuck, w.held_elsewhere, w.health_detail, list(w.loras_loaded))
                    for w in s.workers],
                   [TenantInfo.from_proto(t) for t in s.tenants])


@dataclass(frozen=True)
class Limits:
    """The limits in force at the gateway (GetLimits): a request past any of them is refused with INVALID_ARGUMENT
    naming the field. max_pixels counts after each side is rounded up to a multiple of 32."""

    max_prompt_chars: int
    max_n: int
    max_pixels: int
    max_steps: int
    max_guidance: float
    max_batch_outputs: int
    max_partial_images: int
    # Edits: reference images per request, bytes per image and in all, pixels an image's header may declare.
    max_reference_images: int
    max_reference_bytes: int
    max_reference_total_bytes: int
    max_reference_pixels: int
    # Whether step_cache balanced and aggressive are served (a denoiser of the pool can cache steps: they run there).
    step_cache: bool = False
    # LoRA adapters on the denoisers: per request (0: none served), their rank and file size.
    max_loras_per_request: int = 0
    max_lora_rank: int = 0
    max_lora_bytes: int = 0

    @classmethod
    def from_proto(cls, m: common_pb2.Limits) -> Limits:
        return cls(**{f.name: getattr(m, f.name) for f in fields(cls)})


@dataclass(frozen=True)
class LoraInfo:
    """An adapter requests may name (`Lora`), as its sidecar describes it."""

    name: str
    description: str  # empty without a sidecar
    default_scale: float  # what a Lora without a scale runs at (a float32 on the wire)
    size_bytes: int  # of its weights file

    @classmethod
    def from_proto(cls, m: common_pb2.LoraInfo) -> LoraInfo:
        return cls(m.name, m.description, m.default_scale, m.size_bytes)


@dataclass(frozen=True)
class LoraPlacement:
    """One denoiser's adapters in memory (least recently used first), and why it could not do what was asked."""

    worker: str
    loaded: list[str] = field(default_factory=list)
    error: str = ""  # empty when it could


def placements_from_proto(placement: Iterable[gateway_service_pb2.LoraPlacement]) -> list[LoraPlacement]:
    return [LoraPlacement(p.worker, list(p.loaded), p.error) for p in placement]


@dataclass(frozen=True)
class LoraCatalogue:
    """ListLoras: the adapters by name, and (admin role only; empty otherwise) each denoiser's loaded ones."""

    loras: list[LoraInfo] = field(default_factory=list)
    placement: list[LoraPlacement] = field(default_factory=list)

    @classmethod
    def from_proto(cls, r: gateway_service_pb2.ListLorasResponse) -> LoraCatalogue:
        return cls([LoraInfo.from_proto(m) for m in r.loras], placements_from_proto(r.placement))

    @property
    def names(self) -> list[str]:
        return [info.name for info in self.loras]


def event_from_proto(msg: gateway_service_pb2.GenerateImagesStreamResponse) -> StreamEvent | None:
    kind = msg.WhichOneof("event")
    if kind == "progress":
        p = msg.progress
        return Progress(p.image_index, p.step, p.total_steps)
    if kind == "partial_image":
        p = msg.partial_image
        return PartialImage(p.image_index, p.partial_image_index, p.image)
    if kind == "completed":
        return Completed(GenerationResult.from_proto(msg.completed))
    return None  # an event kind newer than this client: skip it rather than fail


