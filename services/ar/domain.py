"""The AR service's domain: requests, results, usage, limits and validation, shared by every backend.

Torch-free and gRPC-free, so the local engine, the external (srt) backend and the servicer all speak it.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, fields
from typing import Protocol

from runtime.errors import Cancelled, DeadlineExceeded, InvalidArgument, ServiceError
from runtime.limits import (
    SEED_SPACE,
    Limits,
    check_n,
    check_prompt,
    check_reference_images,
    check_sampling,
    check_seed,
    model_size,
)
from services.model.references import ReferenceTokens


@dataclass(frozen=True)
class Sampling:
    """Per-request sampling controls; None takes the model's generation config."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None


@dataclass(frozen=True)
class ArRequest:
    prompt: str
    n: int
    height: int
    width: int
    seed: int | None = None
    sampling: Sampling = field(default_factory=Sampling)
    # An edit: the reference files as the client sent them (encoded); empty for text-to-image.
    reference_images: tuple[bytes, ...] = ()


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    cached_tokens: int = 0
    image_tokens: int = 0  # of prompt_tokens, those the reference images contributed

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def __add__(self, other: Usage) -> Usage:
        # Every field, so one added later is summed too.
        return Usage(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})


@dataclass(frozen=True)
class PriorOutput:
    token_ids: list[int]
    seed: int
    usage: Usage


@dataclass(frozen=True)
class ArResult:
    outputs: list[PriorOutput]
    height: int
    width: int
    # An edit: its references' tokens, in request order, shared by every output.
    references: tuple[ReferenceTokens, ...] = ()

    @property
    def grid(self) -> tuple[int, int]:
        """The token grid the denoiser receives: (H/16, W/16)."""
        return self.height // 16, self.width // 16

    @property
    def usage(self) -> Usage:
        return sum((o.usage for o in self.outputs), Usage())


@dataclass(frozen=True)
class GridPlan:
    """What the AR generates for one target size: a preview grid (text-to-image only; 0 for an edit), then the
    large grid, then the end token."""

    preview_tokens: int
    grid_h: int
    grid_w: int

    @property
    def large_tokens(self) -> int:
        return self.grid_h * self.grid_w

    @property
    def max_new_tokens(self) -> int:
        return self.preview_tokens + self.large_tokens + 1


@dataclass
class RunControl:
    """Shared between the event loop and the worker thread: lets a run stop early when nobody waits any more."""

    deadline: float | None = None  # on the time.monotonic() clock
    cancel: threading.Event = field(default_factory=threading.Event)
    stepped: threading.Event = field(default_factory=threading.Event)  # set after the first decoding step
    steps_done: int = 0
    queue_seconds: float = 0.0  # the call waited this long for the model before its batch began

    def stop_error(self) -> ServiceError | None:
        if self.cancel.is_set():
            return Cancelled("the caller cancelled the request")
        if self.deadline is not None and time.monotonic() >= self.deadline:
            return DeadlineExceeded("the deadline passed")
        return None

    def check(self) -> None:
        if (error := self.stop_error()) is not None:
            raise error


class ArBackend(Protocol):
    """What the servicer needs from a backend: the local torch engine or an external server."""

    limits: Limits  # only AR_FIELDS apply here
    device_name: str  # what runs the model, as GetLimits says it ("cpu", "cuda:0"; "srt": another server)

    def validate(self, req: ArRequest) -> ArRequest: ...

    def generate(self, requests: Sequence[ArRequest], control: RunControl | None = None) -> list[ArResult]:
        """Run one model batch. ``requests`` come from ``validate`` and form a batch that passed ``check_batch``
        (the servicer checks every call; the merger only joins calls of one merge key up to the row cap), so a
        backend does not check them again."""
        ...

    def warm_up(self) -> None: ...


def validate(req: ArRequest, limits: Limits) -> ArRequest:
    """Check a request and normalize it (n default, sizes rounded up to multiples of 32)."""
    check_prompt(req.prompt, limits)
    n = check_n(req.n, limits)
    height, width = model_size(req.height, req.width, limits)
    s = req.sampling
    check_sampling(s.temperature, s.top_p, s.top_k)
    check_seed(req.seed, n)
    if req.reference_images:  # headers only: count, bytes, format, declared pixels, aspect
        check_reference_images(req.reference_images, limits)
    return ArRequest(prompt=req.prompt, n=n, height=height, width=width, seed=req.seed, sampling=s,
                     reference_images=req.reference_images)


def check_batch(requests: Sequence[ArRequest], limits: Limits, *, single: bool = False) -> None:
    """Batch-level checks on validated requests: one resolution, and at most --max-batch-outputs rows."""
    if not requests:
        raise InvalidArgument("requests", "must not be empty")
    if len({(r.height, r.width) for r in requests}) > 1:
        raise InvalidArgument("requests", "all requests of a batch must have the same height and width")
    if len({len(r.reference_images) for r in requests}) > 1:
        # One model batch generates one plan: an edit's (target grid only) differs from text-to-image's.
        raise InvalidArgument("requests", "all requests of a batch must give the same number of reference images")
    total = sum(r.n for r in requests)
    if total > limits.max_batch_outputs:
        raise InvalidArgument("n" if single else "requests",
                              f"{total} outputs exceed the batch cap (--max-batch-outputs "
                              f"{limits.max_batch_outputs}); split the batch")


class RequestInvalid(InvalidArgument):
    """A request of a batch refused while the batch ran (its reference data would not decode): ``index`` lets the
    servicer name the field as the caller sent it (``requests[i].`` in a GenerateBatch)."""

    def __init__(self, index: int, error: InvalidArgument) -> None:
        super().__init__(error.field or "", error.description)
        self.index = index


def row_seeds(req: ArRequest, draw: int) -> list[int]:
    """Output i uses seed + i; an unseeded request uses `draw` (a random seed), reported back per output."""
    base = req.seed if req.seed is not None else draw
    return [(base + i) % SEED_SPACE for i in range(req.n)]


def completion_length(generated: Sequence[int], eos_token_ids: Collection[int]) -> int:
    """Tokens a row really generated: up to and including its first end token; what follows is padding."""
    for i, token in enumerate(generated):
        if token in eos_token_ids:
            return i + 1
    return len(generated)


def upsample_grid(large: Sequence[int], grid_h: int, grid_w: int) -> list[int]:
    """Nearest 2x upsampling of the (grid_h, grid_w) AR grid to the DiT's (2*grid_h, 2*grid_w), row-major."""
    out: list[int] = []
    for r in range(grid_h):
        row = large[r * grid_w:(r + 1) * grid_w]
        doubled = [t for t in row for _ in (0, 1)]
        out.extend(doubled)
        out.extend(doubled)
    return out


def prior_output(generated: Sequence[int], plan: GridPlan, *, seed: int, prompt_tokens: int, cached_tokens: int = 0,
                 image_tokens: int = 0, eos_token_ids: Collection[int], codebook_size: int | None,
                 index: int) -> PriorOutput:
    """Turn one generated row into the denoiser's prior tokens plus its usage; errors name the output."""
    used = completion_length(generated, eos_token_ids)
    large = list(generated[plan.preview_tokens:plan.preview_tokens + plan.large_tokens])
    if used < plan.preview_tokens + plan.large_tokens or len(large) != plan.large_tokens:
        raise ServiceError(f"output {index}: the AR model stopped after {used} of {plan.max_new_tokens} tokens")
    if codebook_size is not None and any(not 0 <= t < codebook_size for t in large):
        raise ServiceError(f"output {index}: the AR model produced ids outside the codebook [0, {codebook_size})")
    return PriorOutput(token_ids=upsample_grid(large, plan.grid_h, plan.grid_w), seed=seed,
                       usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=used, cached_tokens=cached_tokens,
                                   image_tokens=image_tokens))
