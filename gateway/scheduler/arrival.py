"""Whether an arriving request is admitted: the scheduler's own refusals (what the driver's checks cannot know: the
queues, the pool, ids in use), each with the status and the client's message, and the operator's note for the log.

core.Scheduler calls ``refusal`` first thing for every RequestArrived and admits the request when it says nothing.
"""

from __future__ import annotations

from runtime.errors import ErrorKind

from .fairness import Shares
from .pool import Pool
from .speed import AR, DENOISER
from .types import BATCH, DEFAULT, INTERACTIVE, RequestArrived, SchedulerConfig

_CLASSES = (INTERACTIVE, DEFAULT, BATCH)


def refusal(ev: RequestArrived, cfg: SchedulerConfig, pool: Pool, shares: Shares, in_use: bool,
            queued: int) -> tuple[ErrorKind, str, str] | None:
    """Why ``ev`` is refused (status, the client's message, the operator's note), or None: it is admitted.
    ``in_use``: its id is an active request's; ``queued``: the outputs waiting in either queue now."""
    if not isinstance(ev.n, int) or ev.n < 1:
        return ErrorKind.INVALID_ARGUMENT, f"n must be >= 1, got {ev.n!r}", ""
    if ev.height <= 0 or ev.width <= 0:
        return ErrorKind.INVALID_ARGUMENT, f"size must be positive, got {ev.width}x{ev.height}", ""
    if in_use:
        return ErrorKind.INVALID_ARGUMENT, f"request id {ev.request_id!r} is already in use", ""
    if ev.priority not in _CLASSES or not ev.weight > 0:  # (the driver's to get right)
        return ErrorKind.INVALID_ARGUMENT, f"bad priority {ev.priority!r} or weight {ev.weight!r}", ""
    if ev.n > cfg.max_queued_outputs:
        # Could never be admitted: INVALID_ARGUMENT, not RESOURCE_EXHAUSTED, so clients do not retry it.
        return (ErrorKind.INVALID_ARGUMENT, f"n={ev.n} is more images than this server queues at once; ask for at "
                                            f"most {cfg.max_queued_outputs}",
                f"--max-queued-outputs={cfg.max_queued_outputs}")
    if cfg.fail_fast_without_workers and not pool.any_ready(AR):
        return ErrorKind.UNAVAILABLE, pool.none_ready(AR, None), ""
    if cfg.fail_fast_without_workers and not pool.any_ready(DENOISER):
        return ErrorKind.UNAVAILABLE, pool.none_ready(DENOISER, None), ""
    if queued + ev.n > cfg.max_queued_outputs and (
            queued + ev.n > 2 * cfg.max_queued_outputs
            or not shares.within_share(ev.tenant, ev.weight, ev.n, cfg.max_queued_outputs)):
        # Past the bound only a tenant within its share gets in (fairness.Shares.within_share), up to twice the
        # bound. The client's terms (retry later, or fewer images); the operator's flag goes to the gateway log.
        return (ErrorKind.RESOURCE_EXHAUSTED, f"the server is busy ({queued} images queued; {ev.n} more would pass "
                                              "what it queues); retry later, or ask for fewer images",
                f"{queued} queued outputs + n={ev.n} > --max-queued-outputs={cfg.max_queued_outputs}")
    return None
