"""The job domain's data: what the store keeps and what its users exchange with it. No I/O here."""
from __future__ import annotations

import secrets
from dataclasses import dataclass

QUEUED, IN_PROGRESS, COMPLETED, FAILED, CANCELLED = "queued", "in_progress", "completed", "failed", "cancelled"
STATUSES = (QUEUED, IN_PROGRESS, COMPLETED, FAILED, CANCELLED)
TERMINAL = frozenset({COMPLETED, FAILED, CANCELLED})


def new_job_id() -> str:
    """Unguessable: an id is all another tenant would need to probe for a job (they get NOT_FOUND either way)."""
    return f"job_{secrets.token_hex(16)}"


def new_delivery_id() -> str:
    return f"msg_{secrets.token_hex(16)}"


@dataclass(frozen=True)
class NewJob:
    """What SubmitJob writes."""
    id: str
    tenant: str
    request: bytes  # serialized glmimage.v1.GenerateImagesRequest
    n: int
    priority: int  # scheduler class, 0 (interactive) to 2 (batch)
    created_at: float  # unix seconds
    deadline: float  # unix seconds: not done by then, it fails DEADLINE_EXCEEDED
    webhook_url: str = ""
    idempotency_key: str = ""
    request_id: str = ""
    edit: bool = False


@dataclass(frozen=True)
class JobRecord:
    """A job as the store holds it."""
    id: str
    tenant: str
    status: str
    request: bytes
    n: int
    priority: int
    created_at: float
    deadline: float
    started_at: float | None
    finished_at: float | None
    expires_at: float | None
    attempts: int  # times a runner took it
    lease_owner: str | None
    lease_until: float | None
    step: int
    total_steps: int
    result: bytes | None  # serialized GenerateImagesResponse: images' bytes empty, GeneratedImage.url = object key
    error_code: str
    error_message: str
    error_field: str
    cancel_requested: bool
    webhook_url: str
    idempotency_key: str
    request_id: str
    edit: bool
    available_at: float  # not claimable before (backoff after a transient failure)
    # Takes given back (a runner stopping cleanly, a failure that heals): attempts - released - 1 of the takes before
    # this one ended with their runner's death, which is what --job-max-attempts bounds.
    released: int = 0

    @property
    def ended(self) -> bool:
        return self.status in TERMINAL


@dataclass(frozen=True)
class Lease:
    """A runner's hold on a job; every later write names it, so a runner that lost the job (it was taken over after
    the lease ran out) can record nothing."""
    job: JobRecord
    owner: str
    attempt: int


@dataclass(frozen=True)
class StoredObject:
    """One stored image: a job's, or a synchronous response_format=url answer's."""
    key: str
    tenant: str
    size: int
    expires_at: float
    job_id: str | None = None


@dataclass(frozen=True)
class NewDelivery:
    """A webhook outbox row, written in the transaction that ends its job: the job cannot end without it."""
    id: str  # the webhook-id header, the same over every try
    job_id: str
    tenant: str
    url: str
    payload: bytes  # the exact body; each try signs it with a fresh timestamp
    created_at: float
    give_up_at: float


@dataclass(frozen=True)
class Outcome:
    """How a job ends: recorded once, with its images' objects and its webhook."""
    status: str  # COMPLETED, FAILED or CANCELLED
    finished_at: float
    expires_at: float
    result: bytes | None = None
    error_code: str = ""
    error_message: str = ""
    error_field: str = ""
    objects: tuple[StoredObject, ...] = ()
    webhook: NewDelivery | None = None
    # The job's last progress, as its runner saw it (None: as the row has it).
    step: int | None = None
    total_steps: int | None = None


@dataclass(frozen=True)
class Delivery:
    """A claimed webhook outbox row."""
    id: str
    job_id: str
    tenant: str
    url: str
    payload: bytes
    attempts: int
    created_at: float
    give_up_at: float
    owner: str
