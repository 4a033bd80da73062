"""Short-hands for the scheduler core tests (tests/test_scheduler_*.py): build a scheduler, feed it events, pick
the actions out of what it returns.
"""

from __future__ import annotations

from gateway.scheduler.core import Scheduler
from gateway.scheduler.types import (
    Action,
    ArBatchSucceeded,
    DispatchArBatch,
    JobId,
    RequestArrived,
    SchedulerConfig,
    WorkerAdded,
    WorkerHealthy,
    WorkerRole,
    WorkerSnapshot,
)
from tests.support.scheduler_model import AR, DN, SIZE


def make(**kw: object) -> Scheduler:
    return Scheduler(SchedulerConfig(**kw))  # type: ignore[arg-type]


def up(s: Scheduler, name: str, role: WorkerRole, now: float = 0.0) -> list[Action]:
    """Add a worker and mark it healthy; return the actions of the health event."""
    assert s.handle(WorkerAdded(now, name, role)) == []
    return s.handle(WorkerHealthy(now, name))


def arrive(
    s: Scheduler,
    rid: str,
    n: int = 1,
    now: float = 0.0,
    size: tuple[int, int] = SIZE,
    deadline: float | None = None,
) -> list[Action]:
    return s.handle(RequestArrived(now, rid, n, size[0], size[1], deadline))


def only(actions: list[Action], cls: type) -> list:
    return [a for a in actions if isinstance(a, cls)]


def ar_outputs(rid: str, n: int) -> list[object]:
    return [f"{rid}/ar{i}" for i in range(n)]


def ar_ok(s: Scheduler, batch: DispatchArBatch, ns: dict[str, int], now: float = 0.0) -> list[Action]:
    return s.handle(
        ArBatchSucceeded(now, batch.batch_id, {rid: ar_outputs(rid, ns[rid]) for rid in batch.request_ids})
    )


def to_denoise(s: Scheduler, rid: str, n: int = 1, now: float = 0.0) -> list[Action]:
    """Admit a request, take it through the AR stage; return the actions of the AR result.

    Needs ar_batch_delay=0 (or a full batch) and a free AR worker."""
    (batch,) = only(arrive(s, rid, n, now), DispatchArBatch)
    assert batch.request_ids == (rid,)
    return ar_ok(s, batch, {rid: n}, now)


def worker(s: Scheduler, name: str) -> WorkerSnapshot | None:
    for w in s.snapshot().workers:
        if w.address == name:
            return w
    return None


def job(rid: str, index: int = 0, attempt: int = 1) -> JobId:
    return JobId(rid, index, attempt)


def ready(**kw: object) -> Scheduler:
    """One AR worker and denoisers d0..d3, no batching delay."""
    cfg: dict[str, object] = {"ar_batch_delay": 0.0}
    cfg.update(kw)
    s = make(**cfg)
    up(s, "ar0", AR)
    for i in range(4):
        up(s, f"d{i}", DN)
    return s
