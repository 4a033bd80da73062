"""The scheduler's exchange types: events in, actions out, and what it is configured and observed with.

gateway/scheduler/core.py holds the state machine that consumes these (``Scheduler.handle(event) -> list[Action]``);
every user imports them from here. Like the scheduler, this module imports only the standard library and
runtime.errors.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

# Failure classes are shared with the gRPC edge, which maps them to status codes (that module is stdlib-only).
from runtime.errors import ErrorKind
from runtime.priority import BATCH, DEFAULT, INTERACTIVE, PRIORITY_NAMES

__all__ = [
    "Action",
    "ArBatchFailed",
    "ArBatchSucceeded",
    "CancelArBatch",
    "CancelDenoise",
    "CompleteRequest",
    "Counters",
    "DenoiseFailed",
    "DenoiseRefusedBusy",
    "DenoiseSucceeded",
    "BATCH",
    "DEFAULT",
    "DenoiserOccupancy",
    "DispatchArBatch",
    "DispatchDenoise",
    "Event",
    "FailRequest",
    "INTERACTIVE",
    "PRIORITY_NAMES",
    "Gauges",
    "JobId",
    "RequestArrived",
    "RequestCancelled",
    "RequestError",
    "SchedulerConfig",
    "Snapshot",
    "TenantSnapshot",
    "Tick",
    "WorkerAdded",
    "WorkerCapabilities",
    "WorkerDown",
    "WorkerHealthy",
    "WorkerNotServing",
    "WorkerRemoved",
    "WorkerRole",
    "WorkerSnapshot",
    "WorkerState",
    "WorkerUnhealthy",
]


class WorkerRole(enum.Enum):
    AR = "AR"
    DENOISER = "DENOISER"


class WorkerState(enum.Enum):
    """Externally visible worker state (snapshots only; internally health and draining are separate flags)."""

    AVAILABLE = "AVAILABLE"  # healthy, not draining, has room for work
    BUSY = "BUSY"  # healthy, not draining, no room
    UNHEALTHY = "UNHEALTHY"
    DRAINING = "DRAINING"  # removed while busy, or said NOT_SERVING: finishes what it holds, takes nothing new


@dataclass(frozen=True)
class SchedulerConfig:
    # Admission bound in output slots, over both queues: outputs waiting for an AR batch plus outputs waiting for
    # a denoiser (work in flight is not queued). Bounding the AR queue alone let the denoise backlog grow unchecked.
    max_queued_outputs: int = 256
    ar_batch_max_outputs: int = 8  # AR batch capacity in output slots
    ar_batch_delay: float = 0.005  # a batch leaves when full or when its oldest member waited this long
    ar_max_inflight_batches: int = 1  # per AR worker
    # Extra tries of a failed AR batch before its requests fail: one, so a batch whose AR died or hung goes to another
    # AR server (with no other, fail-fast answers 503 at once all the same).
    ar_retries: int = 1
    max_attempts: int = 3  # per denoise output (the first try counts)
    # Fail fast with UNAVAILABLE when a stage has no ready worker, instead of holding requests until their deadline:
    # new requests are refused at admission, and requests waiting for the AR fail when the last AR worker goes.
    fail_fast_without_workers: bool = False
    # The reference deployment's policy, kept as the benchmark baseline: a request's outputs run one after
    # another instead of fanning out (the next output starts when the previous one is done).
    serial_outputs: bool = False
    # LoRA placement: a job naming adapters goes to a free denoiser that holds them all; where none is free, it
    # waits for a busy holder only when that one is expected to free up before a load elsewhere would end (and
    # never longer than one load), else it loads on the free denoiser that holds most of them. Off: the next free
    # denoiser, as for a plain job (the random-placement baseline of bench/lora_sim.py).
    lora_affinity: bool = True
    # Seconds one job's adapter loads take, until a job that loaded says (DenoiseSucceeded.lora_load_s): learned.
    lora_load_cost: float = 2.0

    def __post_init__(self) -> None:
        if self.max_queued_outputs < 1:
            raise ValueError("max_queued_outputs must be >= 1")
        if self.ar_batch_max_outputs < 1:
            raise ValueError("ar_batch_max_outputs must be >= 1")
        if self.ar_batch_delay < 0:
            raise ValueError("ar_batch_delay must be >= 0")
        if self.ar_max_inflight_batches < 1:
            raise ValueError("ar_max_inflight_batches must be >= 1")
        if self.ar_retries < 0:
            raise ValueError("ar_retries must be >= 0")
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        if not self.lora_load_cost >= 0:
            raise ValueError("lora_load_cost must be >= 0")


@dataclass(frozen=True, order=True)
class JobId:
    """Fencing token for one denoise dispatch: a result is accepted only for the current attempt."""

    request_id: str
    index: int  # output index within the request
    attempt: int  # 1, 2, ... (continues above an earlier request with the same id, see Scheduler)


# ---------------------------------------------------------------------------------------------------------------
# Events (inputs). Every event carries ``now``, so the core never reads a clock.


@dataclass(frozen=True)
class RequestArrived:
    now: float
    request_id: str
    n: int
    height: int
    width: int
    deadline: float | None = None  # absolute, same monotonic clock as ``now``
    # Its AR batch holds it alone (an edit: its reference images make its prompt unlike any other's).
    solo: bool = False
    # The LoRA adapters its denoise jobs name (placement only: the driver sends the scales).
    loras: frozenset[str] = frozenset()
    # Whose it is (the tenants file's name), that tenant's weight when it was admitted (its share of both stages
    # while several tenants wait; the latest arrival's weight is the tenant's from then on), and its class within
    # the tenant: INTERACTIVE, DEFAULT or BATCH (BATCH runs only on capacity nothing else waits for).
    tenant: str = "default"
    weight: float = 1.0
    priority: int = 1
    # What it asks of the workers that run it (runtime.capability.Needs; opaque here): its AR batch goes only to an
    # AR server, and its denoise jobs only to denoisers, whose capabilities the scheduler's ``fits`` accepts for it.
    # None: any worker can run it.
    needs: object = None


# Priority classes (RequestArrived.priority): lower runs first within a tenant (defined with their names in
# runtime/priority.py, which the REST front and the tenants file share).


@dataclass(frozen=True)
class ArBatchSucceeded:
    now: float
    batch_id: int
    outputs: dict[str, list[object]]  # request_id -> n opaque per-output AR results, in index order


@dataclass(frozen=True)
class ArBatchFailed:
    now: float
    batch_id: int
    message: str
    # INVALID_ARGUMENT: the AR refused the batch's input; INTERNAL: the gateway itself failed handling it. Neither
    # is the worker's fault nor worth a retry as is: a lone request fails with the message; a shared batch is split
    # so only the request at fault fails.
    kind: ErrorKind = ErrorKind.UNAVAILABLE
    # For INVALID_ARGUMENT: the request field the AR refused (as the client names it, no batch index), if it said.
    field: str | None = None


@dataclass(frozen=True)
class DenoiseSucceeded:
    now: float
    job: JobId
    worker: str
    result: object
    # Of the job's time, the seconds its denoiser spent loading adapter files (0: it held them all).
    lora_load_s: float = 0.0


@dataclass(frozen=True)
class DenoiseFailed:
    now: float
    job: JobId
    worker: str
    message: str
    retryable: bool
    # For a non-retryable failure: the status the request fails with (the worker's own verdict, e.g. bad input).
    kind: ErrorKind = ErrorKind.INTERNAL
    # For INVALID_ARGUMENT: the request field the denoiser refused, if it said.
    field: str | None = None


@dataclass(frozen=True)
class DenoiseRefusedBusy:
    """The denoiser refused ``job`` because a job of another gateway holds its slot: a collision, not a failed
    attempt. The job goes to another free denoiser at once, and this one counts as busy until its occupancy
    stream says it is free."""

    now: float
    job: JobId
    worker: str
    # The denoiser's occupancy sequence at the refusal (None: it sent none): a newer state already seen wins.
    sequence: int | None = None


@dataclass(frozen=True)
class DenoiserOccupancy:
    """What a denoiser's occupancy stream says: its slot is held by another gateway's job (``elsewhere``), or it
    is free or held by a job of this gateway's own (which the scheduler follows itself)."""

    now: float
    worker: str
    elsewhere: bool
    # Grows with every change of the denoiser's state; a state older than one already applied is ignored. None:
    # not ordered (the stream broke or does not exist): applied as is.
    sequence: int | None = None
    # The LoRA adapters it holds loaded; None: not said (the stream broke, or an older denoiser).
    loras: frozenset[str] | None = None


@dataclass(frozen=True)
class WorkerAdded:
    now: float
    worker: str
    role: WorkerRole


@dataclass(frozen=True)
class WorkerRemoved:
    now: float
    worker: str


@dataclass(frozen=True)
class WorkerHealthy:
    now: float
    worker: str


class WorkerDown(enum.Enum):
    """Why a worker stopped taking work, as the client's message says it (after "it"). What it held goes
    elsewhere; CREDENTIAL_REFUSED costs none of its attempts: the worker refused the call before running it."""

    GONE = "went away"
    HUNG = "is not answering (hung)"
    TIMED_OUT = "did not answer in time"
    CREDENTIAL_REFUSED = "refuses the gateway's credential (its internal token)"
    INCOMPATIBLE = "speaks no contract revision the gateway does (a release too old or too new)"


@dataclass(frozen=True)
class WorkerUnhealthy:
    now: float
    worker: str
    # Only the messages depend on it, and, for CREDENTIAL_REFUSED, whether what it held used an attempt. Sent for a
    # worker that never was healthy too (it refused the credential when it joined): the reason is kept for the
    # messages of requests that find no worker of its stage.
    why: WorkerDown = WorkerDown.GONE


@dataclass(frozen=True)
class WorkerNotServing:
    """The worker answers health checks with NOT_SERVING: it is draining (SIGTERM, rolling update). It gets no
    new work, and the work it holds is left to finish; if it then goes away, WorkerUnhealthy follows."""

    now: float
    worker: str


@dataclass(frozen=True)
class WorkerCapabilities:
    """What a worker can run (its limits, its adapter directory...: runtime.capability.Capabilities, opaque
    and hashable here), as it last said; sent before it is first healthy, and again whenever that changes. None:
    not known (it runs anything, as before it said)."""

    now: float
    worker: str
    capabilities: object = None


@dataclass(frozen=True)
class RequestCancelled:
    now: float
    request_id: str
    message: str = "cancelled by client"
    # DEADLINE_EXCEEDED when the caller's own deadline ended the call: its client reads that, and so does the outcome.
    kind: ErrorKind = ErrorKind.CANCELLED


@dataclass(frozen=True)
class Tick:
    now: float


Event = (
    RequestArrived
    | ArBatchSucceeded
    | ArBatchFailed
    | DenoiseSucceeded
    | DenoiseFailed
    | DenoiseRefusedBusy
    | DenoiserOccupancy
    | WorkerAdded
    | WorkerRemoved
    | WorkerHealthy
    | WorkerUnhealthy
    | WorkerNotServing
    | WorkerCapabilities
    | RequestCancelled
    | Tick
)

# ---------------------------------------------------------------------------------------------------------------
# Actions (outputs), performed by the driver in list order.


@dataclass(frozen=True)
class DispatchArBatch:
    batch_id: int
    worker: str
    height: int
    width: int
    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class CancelArBatch:
    """Stop an AR batch. Either its worker went unhealthy (the slot is already free and a late result is fenced),
    or ``abandoned``: every request in it has ended, so nobody waits for it; the slot stays held until the driver
    reports the RPC's end (ArBatchFailed), so the AR is never handed more than it can run."""

    batch_id: int
    worker: str
    abandoned: bool = False


@dataclass(frozen=True)
class DispatchDenoise:
    job: JobId
    worker: str
    ar_output: object


@dataclass(frozen=True)
class CancelDenoise:
    """Cancel the RPC. The worker slot stays held until a result for ``job`` arrives or the worker goes
    unhealthy/removed, so a denoiser that is still computing is never handed a second job."""

    job: JobId
    worker: str


@dataclass(frozen=True)
class CompleteRequest:
    request_id: str
    results: tuple[object, ...]  # index order
    ar_outputs: tuple[object, ...]  # index order


@dataclass(frozen=True)
class RequestError:
    """Why a request failed: made here and carried unchanged to the gRPC edge (gateway.servicer), which turns it
    into the call's status, once."""

    kind: ErrorKind
    message: str  # what the client reads
    # For INVALID_ARGUMENT relayed from a worker: the request field at fault (the message names it too).
    field: str | None = None
    # For the gateway's log only (the server setting behind a refusal); never sent to the client.
    operator_note: str = ""


@dataclass(frozen=True)
class FailRequest:
    request_id: str
    error: RequestError


Action = DispatchArBatch | CancelArBatch | DispatchDenoise | CancelDenoise | CompleteRequest | FailRequest

# ---------------------------------------------------------------------------------------------------------------
# Observability


@dataclass(frozen=True)
class WorkerSnapshot:
    address: str
    role: WorkerRole
    state: WorkerState
    inflight: int  # AR: batches in flight; denoiser: 0 or 1
    current_job: JobId | None  # denoisers only
    held_elsewhere: bool = False  # a denoiser whose slot another gateway's job holds
    loras: frozenset[str] = frozenset()  # denoisers: the adapters it holds, or will once its current job has loaded


@dataclass(frozen=True)
class TenantSnapshot:
    """One tenant's share of the queues (a tenant with active requests; kept as they change, so cheap to read)."""

    name: str
    weight: float  # as its latest arrival said
    pending_ar_requests: int
    pending_ar_outputs: int
    pending_denoise_outputs: int
    active_requests: int
    active_outputs: int  # the n of its active requests, summed
    # Seconds since the earliest arrival among its requests of a class other than BATCH that have work queued in
    # either stage (0: none): how long it has been kept waiting, as of the scheduler's latest event.
    oldest_wait: float
    # That arrival (the events' monotonic clock; None: none waits), so a reader can tell the wait at any later time:
    # between events the figure above stands still, and a starved tenant's wait must not.
    oldest_since: float | None = None


@dataclass(frozen=True)
class Snapshot:
    pending_ar_requests: int
    pending_ar_outputs: int
    pending_denoise_outputs: int
    pending_denoise_requests: int  # requests with at least one output waiting for a denoiser
    active_requests: int
    workers: tuple[WorkerSnapshot, ...]
    tenants: tuple[TenantSnapshot, ...] = ()  # by name


@dataclass(frozen=True)
class Gauges:
    """What the metrics publish after every turn of the event loop: the queues, and the workers counted by role and
    state (every pair present). Unlike Snapshot, nothing in it grows with the pool."""

    pending_ar_requests: int
    pending_ar_outputs: int
    pending_denoise_outputs: int
    pending_denoise_requests: int
    active_requests: int
    workers: dict[tuple[WorkerRole, WorkerState], int]
    # Denoisers whose slot another gateway's job holds (counted as busy in ``workers``).
    denoisers_held_elsewhere: int = 0
    tenants: tuple[TenantSnapshot, ...] = ()  # by name


REQUEUE_REASONS: tuple[str, ...] = ("worker_unhealthy", "denoise_failed", "ar_failed", "ar_batch_split")


@dataclass
class Counters:
    """Monotonic counters for the driver's Prometheus metrics.

    ``admitted`` = ``completed`` + sum(``failed``) + active requests. Admission rejections are only in
    ``rejected``. ``requeues`` counts AR requeues per request and denoise requeues per output.
    """

    admitted: int = 0
    rejected: int = 0
    completed: int = 0
    failed: dict[ErrorKind, int] = field(default_factory=lambda: {c: 0 for c in ErrorKind})
    requeues: dict[str, int] = field(default_factory=lambda: {r: 0 for r in REQUEUE_REASONS})
    fenced_results: int = 0
    denoise_dispatches: int = 0
    # Denoise dispatches refused because another gateway's job held the denoiser (each went elsewhere at once).
    collisions: int = 0
