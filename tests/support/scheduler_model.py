"""Reference model of the world the scheduler runs in, for the state machine test (tests/test_scheduler_machine.py).

A simulated cluster's bookkeeping, built only from the events sent to the scheduler and the actions it returned,
plus the shared constants of the scheduler tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.scheduler.types import (
    Action,
    DispatchArBatch,
    JobId,
    WorkerRole,
)

AR = WorkerRole.AR
DN = WorkerRole.DENOISER
SIZE = (256, 256)
OTHER = (512, 512)


@dataclass
class _Member:
    role: WorkerRole
    healthy: bool = False
    draining: bool = False
    serving: bool = True  # False after WorkerNotServing, until WorkerHealthy or WorkerUnhealthy


@dataclass
class _Req:
    n: int
    size: tuple[int, int]
    deadline: float | None
    batch: int | None = None  # latest AR batch dispatched for it
    denoising: bool = False  # its AR outputs were accepted
    done: set[int] = field(default_factory=set)  # indices whose result was accepted
    ar_failures: int = 0
    solo: bool = False  # it shared a batch refused as bad input: every later batch of it holds it alone
    priority: int = 1  # its class (types.INTERACTIVE, DEFAULT, BATCH)
    tenant: str = "default"
    needs: frozenset[str] | None = None  # what its AR server and denoiser must be able to do (None: anything)
    arrived: float = 0.0  # when it was admitted: its AR batch delay counts from then, over retries too


@dataclass
class _World:
    """What the simulated cluster knows, built only from events sent and actions received."""

    members: dict[str, _Member] = field(default_factory=dict)
    holding: dict[str, JobId] = field(default_factory=dict)  # denoiser -> the job whose slot it holds
    ar_owned: dict[str, set[int]] = field(default_factory=dict)  # AR worker -> batch slots it holds
    ar_rpcs: dict[int, DispatchArBatch] = field(default_factory=dict)  # outstanding, incl. cancelled
    dn_rpcs: dict[JobId, str] = field(default_factory=dict)  # outstanding, incl. cancelled
    delivered: list[tuple[JobId, str]] = field(default_factory=list)
    delivered_batches: list[int] = field(default_factory=list)
    attempts: dict[tuple[str, int], tuple[int, str]] = field(default_factory=dict)  # latest (attempt, worker)
    reqs: dict[str, _Req] = field(default_factory=dict)  # admitted
    ended: dict[str, Action] = field(default_factory=dict)
    batch_rids: dict[int, tuple[str, ...]] = field(default_factory=dict)  # every batch ever dispatched
    abandoned: set[int] = field(default_factory=set)  # batches stopped because nobody waited for them
    # Other gateways over the same denoisers: denoiser -> whether another gateway's job holds it, as the latest
    # applied occupancy state (or busy refusal) says, and that state's sequence.
    elsewhere: dict[str, bool] = field(default_factory=dict)
    occupancy_seq: dict[str, int] = field(default_factory=dict)
    refusals: dict[tuple[str, int], int] = field(default_factory=dict)  # busy refusals per output (not attempts)
    caps: dict[str, frozenset[str]] = field(default_factory=dict)  # what each member can do, as last said


# Capabilities in the model: a worker can do a set of things, a request needs a set of them (None: unknown or
# nothing asked); the scheduler is given this as its ``fits``, as the driver gives it runtime.capability's.
CAPABILITIES = frozenset({"big", "cache"})


def fits(needs: object, caps: object) -> bool:
    assert isinstance(needs, frozenset) and isinstance(caps, frozenset)
    return needs <= caps


def can_run(needs: frozenset[str] | None, caps: frozenset[str] | None) -> bool:
    return needs is None or caps is None or needs <= caps


WORKERS = ("ar0", "ar1", "d0", "d1", "d2", "d3")


def _role(name: str) -> WorkerRole:
    return AR if name.startswith("ar") else DN


def _ar_out(rid: str, i: int, batch_id: int) -> tuple[str, str, int, int]:
    return ("ar", rid, i, batch_id)


def _result(j: JobId, w: str) -> tuple[str, str, int, int, str]:
    return ("res", j.request_id, j.index, j.attempt, w)
