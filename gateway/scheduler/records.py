"""The scheduler's own records of a request and of each of its outputs (never handed out: see types.py for what is).

They use __slots__: their attributes are read and written on every event, and a slot is quicker to reach than an
instance __dict__ (and smaller, with 10,000 queued outputs).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


class Stage(enum.Enum):
    """Where a request is."""

    PENDING_AR = enum.auto()
    AR_INFLIGHT = enum.auto()
    DENOISING = enum.auto()


class OutState(enum.Enum):
    """Where one output of a denoising request is."""

    IDLE = enum.auto()  # neither queued nor running: before the AR result, or its attempt just ended
    QUEUED = enum.auto()
    INFLIGHT = enum.auto()
    DONE = enum.auto()


@dataclass(slots=True, eq=False)
class Output:
    index: int
    attempt: int  # JobId.attempt of the latest dispatch (starts at the request's attempt base)
    state: OutState = OutState.IDLE
    worker: str | None = None
    result: object = None
    refusals: int = 0  # dispatches a denoiser refused as busy with another gateway's job: not attempts used
    # When LoRA placement first held it back while a denoiser was free (None: not since it was queued): it is not
    # held back longer than a load from then.
    passed_at: float | None = None
    started_at: float = 0.0  # when its current attempt was dispatched (the denoise time is learned from it)


@dataclass(slots=True, eq=False)  # identity equality: deque.remove must not confuse two requests
class Request:
    request_id: str
    seq: int  # admission order; also distinguishes incarnations of a reused request_id
    n: int
    height: int
    width: int
    deadline: float | None
    arrived_at: float  # AR queue age; kept across AR retries so a retried request is not starved
    attempt_base: int
    outputs: list[Output]
    stage: Stage = Stage.PENDING_AR
    ar_batch: int | None = None
    ar_failures: int = 0
    # An edit, or it shared a batch the AR refused as bad input: it goes alone (from now on).
    solo: bool = False
    ar_outputs: tuple[object, ...] = ()
    done: int = 0
    loras: frozenset[str] = frozenset()  # the adapters its denoise jobs name
    # Fair share (fairness.py): its class; its tenant's flow of its level (a fair_queue.Flow); whether it has an entry
    # among its tenant's requests that may have queued work (BATCH ones never need one).
    priority: int = 1
    flow: Any = None
    listed: bool = True
    # Capability placement (capability.py): what it needs (opaque; None: any worker runs it), whether it fits each
    # kind of worker asked so far (capabilities -> bool), and whether some kind of denoiser (``restricted``) or of
    # AR server (``ar_restricted``) in the pool cannot run it.
    needs: object = None
    fit: dict[object, bool] | None = None
    restricted: bool = False
    ar_restricted: bool = False

    @property
    def queue_key(self) -> tuple[int, int, int]:
        """The AR queue it waits in: one per resolution, and one of its own when it goes alone (so it neither waits
        behind a batching window nor holds one up)."""
        return (self.height, self.width, self.seq if self.solo else 0)
