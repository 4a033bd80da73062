"""The durable job store: the jobs, their stored images' objects and the webhook outbox, in SQLite or PostgreSQL.

``open_store(url)`` picks the backend: ``sqlite:///ABS/PATH`` or a bare path (the default, one file shared by the
gateways of one machine: WAL mode, every write a ``BEGIN IMMEDIATE`` transaction) or ``postgresql://...`` /
``postgres://...`` (several machines' gateways: claims are ``FOR UPDATE SKIP LOCKED``). Both keep the same rows and
answer the same ``JobStore`` calls (gateway/jobs/store_sql.py holds what they share).

Every time is unix seconds the caller passes in (``now``), so the store never reads a clock and tests control time.
A runner's writes name its ``Lease`` (owner and attempt): once the lease ran out and another runner took the job
over, the first can record nothing (fencing). A job's end (its row, its images' objects, its webhook outbox row) is
one transaction. The database unreachable, locked past its busy timeout or failing underneath raises
``StoreUnavailable``, which callers answer as UNAVAILABLE.
"""
from __future__ import annotations

import urllib.parse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from gateway.jobs.model import Delivery, JobRecord, Lease, NewJob, Outcome, StoredObject


class StoreUnavailable(Exception):
    """The job database cannot answer now (down, unreachable, locked, out of resources). Retrying later may work."""


class JobStore(Protocol):
    url_for_logs: str  # where the store is, any password removed

    async def connect(self) -> None:
        """Opens the database and creates the schema if missing (idempotent, safe with concurrent starters)."""

    async def close(self) -> None: ...

    async def insert(self, job: NewJob) -> tuple[JobRecord, bool]:
        """(record, created): an existing job of the same tenant and non-empty idempotency key is returned as is."""

    async def get(self, job_id: str, tenant: str | None) -> JobRecord | None:
        """The job, if it is ``tenant``'s (None: any tenant's, for internal callers)."""

    async def list(self, tenant: str, limit: int, after: str | None,
                   status: str | None) -> tuple[list[JobRecord], bool]:
        """The tenant's jobs newest first, those older than job ``after`` (an id of this tenant; unknown: none), and
        whether there are more."""

    async def queue_position(self, job: JobRecord) -> int:
        """How many queued jobs claim() would take before this one (0 when it is not queued)."""

    async def claim(self, owner: str, now: float, lease_s: float, max_attempts: int) -> Lease | None:
        """Takes one claimable job (queued and available, or in progress under a lease that ran out) under a lease."""

    async def reap(self, now: float, max_attempts: int,
                   outcome_for: Callable[[JobRecord, str, str], Outcome]) -> list[JobRecord]:
        """Ends the jobs no runner can finish (past their deadline, or out of attempts); returns them ended."""

    async def renew(self, lease: Lease, now: float, lease_s: float, step: int, total_steps: int) -> tuple[bool, bool]:
        """(still ours, cancel requested)."""

    async def release(self, lease: Lease, available_at: float) -> bool:
        """Gives the job back to the queue, claimable from ``available_at``; False if the lease was lost."""

    async def finish(self, lease: Lease, outcome: Outcome) -> bool:
        """Records the job's one end, its objects and its webhook in one transaction; False if the lease was lost."""

    async def cancel(self, job_id: str, tenant: str, now: float,
                     outcome_for: Callable[[JobRecord], Outcome]) -> JobRecord | None:
        """Ends a queued job now, asks a running one's runner to stop; None if no such job of ``tenant``."""

    async def record_objects(self, objects: Sequence[StoredObject]) -> None: ...

    async def stored_bytes(self, tenant: str, now: float) -> int: ...

    async def expired(self, now: float, limit: int) -> tuple[list[str], list[str]]:
        """(ids of jobs, keys of objects) whose expiry passed, up to ``limit`` of each."""

    async def delete(self, job_ids: Sequence[str], keys: Sequence[str]) -> None:
        """Deletes those jobs (with their deliveries) and those objects' rows."""

    async def counts(self) -> dict[str, int]: ...

    async def oldest_queued(self) -> float | None: ...

    async def leases(self, now: float) -> int: ...

    async def claim_delivery(self, owner: str, now: float, lease_s: float) -> Delivery | None: ...

    async def delivery_done(self, d: Delivery, now: float) -> None: ...

    async def delivery_retry(self, d: Delivery, next_at: float, error: str) -> None: ...

    async def delivery_failed(self, d: Delivery, now: float, error: str) -> None: ...

    async def delivery_counts(self) -> dict[str, int]: ...


def redact_dsn(url: str) -> str:
    """``url`` without its password, in the user info or a ``password=`` query parameter."""
    u = urllib.parse.urlsplit(url)
    netloc = u.netloc
    if "@" in netloc:
        userinfo, _, hostport = netloc.rpartition("@")
        user = userinfo.partition(":")[0]
        netloc = f"{user}@{hostport}" if user else hostport
    query = urllib.parse.urlencode([(k, "***" if k.lower() == "password" else v)
                                    for k, v in urllib.parse.parse_qsl(u.query, keep_blank_values=True)],
                                   safe="/")
    return urllib.parse.urlunsplit((u.scheme, netloc, u.path, query, u.fragment))


def open_store(url: str) -> JobStore:
    """The store ``url`` names, not yet connected. ``sqlite:///ABS/PATH`` or a path: SQLite (its directory is
    created at connect); ``postgresql://`` or ``postgres://``: PostgreSQL. Anything else: ValueError."""
    scheme = url.partition("://")[0].lower() if "://" in url else ""
    if scheme in ("postgresql", "postgres"):
        from gateway.jobs.store_postgres import PostgresJobStore
        return PostgresJobStore(url)
    if scheme == "sqlite":
        path = url[len("sqlite://"):]
        if not path.startswith("/"):
            raise ValueError(f"job store URL {url!r}: sqlite:// takes an absolute path, as in sqlite:///var/jobs.db "
                             "(or give the path alone)")
    elif scheme:
        raise ValueError(f"job store URL {redact_dsn(url)!r}: unsupported scheme {scheme!r}; use sqlite:///PATH, "
                         "a file path, or postgresql://USER@HOST/DB")
    else:
        path = url
    if not path.strip():
        raise ValueError("job store URL is empty: use sqlite:///PATH, a file path, or postgresql://USER@HOST/DB")
    from gateway.jobs.store_sqlite import SqliteJobStore
    return SqliteJobStore(Path(path).expanduser())
