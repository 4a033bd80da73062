"""What one request needs of a worker, what one worker can do, and the one rule that says whether it fits.

A pool is rarely uniform for long (a rolling upgrade, an adapter directory on half the denoisers, a larger GPU
beside the old ones), so the gateway keeps each worker's capabilities apart instead of merging them into the
tightest of all: admission accepts what some member of each stage can run (``limits_in_force`` is then the union,
bounded by the gateway's own flags, and ``Members.capable`` asks ``unmet`` of each member), and the scheduler places
each AR batch only on an AR server, and each denoise job only on a denoiser, for which ``unmet`` says nothing of
any request in it (the driver hands it ``fits``).

``unmet`` reuses the checks of runtime.limits, so a request no worker can run is refused with the very
field and words a worker would use. Torch-free, protobuf-free apart from what limits.py imports.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from runtime.admission import Admitted
from runtime.errors import InvalidArgument
from runtime.limits import (
    AR_FIELDS,
    DENOISER_CAPABILITIES,
    DENOISER_FIELDS,
    Limits,
    check_guidance,
    check_loras,
    check_n,
    check_partial_images,
    check_reference_totals,
    check_step_cache,
    check_steps,
    from_advertised,
    model_size,
    unknown_lora,
)

AR = "AR"
DENOISER = "DENOISER"
# The bounds each role applies: only these of a worker's limits can refuse a request.
ROLE_FIELDS = {AR: frozenset(AR_FIELDS), DENOISER: frozenset(DENOISER_FIELDS + DENOISER_CAPABILITIES)}


@dataclass(frozen=True, slots=True)
class Needs:
    """What one admitted request asks of the worker that runs it, in numbers (what admission settled)."""

    prompt_chars: int = 1
    n: int = 1
    height: int = 32  # as asked: model_size rounds it the way the workers do
    width: int = 32
    steps: int = 0  # 0: the denoiser's default
    guidance: float | None = None
    partial_images: int = 0
    references: int = 0
    reference_bytes: int = 0  # of the largest file
    reference_total_bytes: int = 0
    reference_pixels: int = 0  # of the largest image, as its header declares
    loras: tuple[str, ...] = ()  # the adapter names, in the request's order
    step_cache: int = 0  # the StepCache level asked for

    @classmethod
    def of(cls, admitted: Admitted, partial_images: int = 0) -> Needs:
        r = admitted.request
        files = [len(image.data) for image in r.reference_images]
        return cls(prompt_chars=len(r.prompt), n=admitted.n, height=admitted.height, width=admitted.width,
                   steps=r.num_inference_steps, guidance=r.guidance_scale if r.HasField("guidance_scale") else None,
                   partial_images=partial_images, references=len(files), reference_bytes=max(files, default=0),
                   reference_total_bytes=sum(files), reference_pixels=admitted.largest_reference_pixels,
                   loras=tuple(ref.name for ref in r.loras), step_cache=r.step_cache)


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What one worker can run, as its GetLimits (and, for a denoiser, its ListLoras) last said. Hashable: the
    scheduler counts the distinct kinds in its pool, and caches each request's fit per kind."""

    role: str  # AR or DENOISER
    limits: Limits = Limits()  # the defaults stand in for a bound it does not advertise
    loras: frozenset[str] = frozenset()  # denoisers: the adapters its directory lists

    @classmethod
    def of(cls, role: str, advertised: Mapping[str, float], loras: frozenset[str] = frozenset()) -> Capabilities:
        return cls(role, from_advertised(advertised), frozenset(loras))


@dataclass(frozen=True)
class _Ref:  # what check_loras reads of an adapter reference
    name: str
    scale: float | None = None


def _check(needs: Needs, caps: Capabilities) -> None:
    """InvalidArgument naming the first field of ``needs`` past what ``caps`` can run."""
    limits = caps.limits
    if needs.prompt_chars > limits.max_prompt_chars:
        raise InvalidArgument("prompt", f"is {needs.prompt_chars} characters; the limit is {limits.max_prompt_chars}")
    if caps.role == AR:
        check_n(needs.n, limits)
    model_size(needs.height, needs.width, limits)
    check_reference_totals(needs.references, needs.reference_total_bytes, limits)
    if needs.reference_bytes > limits.max_reference_bytes:
        raise InvalidArgument("reference_images", f"a file of {needs.reference_bytes} bytes; the limit is "
                                                  f"{limits.max_reference_bytes}")
    if needs.reference_pixels > limits.max_reference_pixels:
        raise InvalidArgument("reference_images", f"an image of {needs.reference_pixels} pixels; the limit is "
                                                  f"{limits.max_reference_pixels} pixels")
    if caps.role != DENOISER:
        return
    check_steps(needs.steps, limits)
    check_guidance(needs.guidance, limits)
    check_partial_images(needs.partial_images, limits)
    check_step_cache(needs.step_cache, limits)
    if needs.loras:
        check_loras([_Ref(name) for name in needs.loras], limits)
        for i, name in enumerate(needs.loras):
            if name not in caps.loras:
                raise unknown_lora(i, name)


def unmet(needs: Needs, caps: Capabilities) -> InvalidArgument | None:
    """Whether a request of ``needs`` fits one worker of ``caps``: None if it does, else the refusal (the field,
    and the words the worker itself would use). The one rule: admission and placement both ask it."""
    try:
        _check(needs, caps)
    except InvalidArgument as refusal:
        return refusal
    return None


def fits(needs: object, caps: object) -> bool:
    """``unmet`` as the scheduler asks it (it treats both as opaque values)."""
    assert isinstance(needs, Needs) and isinstance(caps, Capabilities)
    return unmet(needs, caps) is None


def refusal(needs: Needs, members: Sequence[Capabilities]) -> InvalidArgument | None:
    """Why no worker of ``members`` (one stage's, in the order they joined) can run ``needs``, or None when one can
    (or none has said what it can do: the defaults, and the workers' own checks, stand in). The refusal is the first
    member's: within the union (what admission checked first) it is a combination no single worker serves."""
    if not members:
        return None
    first: InvalidArgument | None = None
    for caps in members:
        why = unmet(needs, caps)
        if why is None:
            return None
        first = first or why
    assert first is not None
    stage = "denoiser" if members[0].role == DENOISER else "AR server"
    return InvalidArgument(first.field or "", f"{first.description} (no {stage} here serves everything this "
                                              "request asks at once)")
