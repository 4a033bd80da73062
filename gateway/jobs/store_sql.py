"""What the SQLite and PostgreSQL job stores share: the schema, and every call as SQL both dialects run.

Statements are written once with ``:name`` parameters (sqlite3's own style; the Postgres store rewrites them to
``$n``) in the SQL both speak: ``INSERT ... ON CONFLICT DO NOTHING``, ``UPDATE ... RETURNING``, row values, partial
indexes, TRUE/FALSE. A backend supplies a transaction (``_tx``) and, for Postgres, the row-locking clauses that make
claims skip rows another claimer holds; SQLite needs none, since ``BEGIN IMMEDIATE`` serialises every writer.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

from gateway.jobs.model import (
    IN_PROGRESS,
    QUEUED,
    STATUSES,
    TERMINAL,
    Delivery,
    JobRecord,
    Lease,
    NewJob,
    Outcome,
    StoredObject,
)

PENDING, DELIVERED, DELIVERY_FAILED = "pending", "delivered", "failed"
DELIVERY_STATUSES = (PENDING, DELIVERED, DELIVERY_FAILED)

JOB_COLUMNS = tuple(f.name for f in dataclasses.fields(JobRecord))
_COLS = ", ".join(JOB_COLUMNS)
_C_COLS = ", ".join(f"c.{c}" for c in JOB_COLUMNS)
_DELIVERY_COLS = "id, job_id, tenant, url, payload, attempts, created_at, give_up_at, lease_owner"

REAP_BATCH = 100  # jobs ended per reap transaction: bounds how long one holds the write lock
IN_CHUNK = 500  # ids per IN (...) list: far under SQLite's parameter limit

# {seq}, {blob}, {real}, {bool} are the dialect's types. seq orders a tenant's list and the claim queue (insertion
# order); id is the public handle. A (tenant, idempotency_key) pair is unique only where a key was given.
SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
  seq {seq},
  id TEXT NOT NULL UNIQUE,
  tenant TEXT NOT NULL,
  status TEXT NOT NULL,
  request {blob} NOT NULL,
  n INTEGER NOT NULL,
  priority INTEGER NOT NULL,
  created_at {real} NOT NULL,
  deadline {real} NOT NULL,
  started_at {real},
  finished_at {real},
  expires_at {real},
  attempts INTEGER NOT NULL DEFAULT 0,
  lease_owner TEXT,
  lease_until {real},
  step INTEGER NOT NULL DEFAULT 0,
  total_steps INTEGER NOT NULL DEFAULT 0,
  result {blob},
  error_code TEXT NOT NULL DEFAULT '',
  error_message TEXT NOT NULL DEFAULT '',
  error_field TEXT NOT NULL DEFAULT '',
  cancel_requested {bool} NOT NULL DEFAULT FALSE,
  webhook_url TEXT NOT NULL DEFAULT '',
  idempotency_key TEXT NOT NULL DEFAULT '',
  request_id TEXT NOT NULL DEFAULT '',
  edit {bool} NOT NULL DEFAULT FALSE,
  available_at {real} NOT NULL,
  released INTEGER NOT NULL DEFAULT 0
);
CREATE UNIQUE INDEX IF NOT EXISTS jobs_idempotency ON jobs (tenant, idempotency_key) WHERE idempotency_key <> '';
CREATE INDEX IF NOT EXISTS jobs_claim ON jobs (status, available_at);
CREATE INDEX IF NOT EXISTS jobs_lease ON jobs (status, lease_until);
CREATE INDEX IF NOT EXISTS jobs_deadline ON jobs (status, deadline);
CREATE INDEX IF NOT EXISTS jobs_tenant ON jobs (tenant, seq);
CREATE INDEX IF NOT EXISTS jobs_expiry ON jobs (expires_at) WHERE expires_at IS NOT NULL;
CREATE TABLE IF NOT EXISTS objects (
  key TEXT PRIMARY KEY,
  tenant TEXT NOT NULL,
  size BIGINT NOT NULL,
  expires_at {real} NOT NULL,
  job_id TEXT
);
CREATE INDEX IF NOT EXISTS objects_tenant ON objects (tenant, expires_at);
CREATE INDEX IF NOT EXISTS objects_expiry ON objects (expires_at);
CREATE TABLE IF NOT EXISTS deliveries (
  id TEXT PRIMARY KEY,
  job_id TEXT NOT NULL,
  tenant TEXT NOT NULL,
  url TEXT NOT NULL,
  payload {blob} NOT NULL,
  status TEXT NOT NULL DEFAULT 'pending',
  attempts INTEGER NOT NULL DEFAULT 0,
  created_at {real} NOT NULL,
  give_up_at {real} NOT NULL,
  next_at {real} NOT NULL,
  lease_owner TEXT,
  lease_until {real},
  finished_at {real},
  last_error TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS deliveries_due ON deliveries (status, next_at);
CREATE INDEX IF NOT EXISTS deliveries_job ON deliveries (job_id);
"""

# Live leases per tenant: the claim order's first key, so one tenant's flood cannot fill every runner slot.
_RUNNING = ("SELECT tenant, COUNT(*) AS running FROM jobs WHERE status = 'in_progress' AND lease_until >= :now "
            "GROUP BY tenant")
_CLAIMABLE = ("((c.status = 'queued' AND c.available_at <= :now) OR "
              "(c.status = 'in_progress' AND c.lease_until < :now)) "
              "AND c.deadline > :now AND c.attempts - c.released < :max_attempts")
# A lease's writes: only while the job is still in progress under this owner and attempt.
_FENCED = "id = :id AND status = 'in_progress' AND lease_owner = :owner AND attempts = :attempt"
_END = ("UPDATE jobs SET status = :status, finished_at = :finished_at, expires_at = :expires_at, result = :result, "
        "error_code = :error_code, error_message = :error_message, error_field = :error_field, "
        "step = COALESCE(:step, step), total_steps = COALESCE(:total_steps, total_steps), "
        "lease_owner = NULL, lease_until = NULL WHERE {where} RETURNING " + _COLS)


class Tx(Protocol):
    """One transaction's statements; rows are mappings by column name."""

    async def fetch(self, sql: str, params: Mapping[str, Any]) -> Sequence[Mapping[str, Any]]: ...

    async def execute(self, sql: str, params: Mapping[str, Any]) -> int: ...  # rows changed


_FLOATS = ("created_at", "deadline", "started_at", "finished_at", "expires_at", "lease_until", "available_at")


def job_from_row(row: Mapping[str, Any]) -> JobRecord:
    values = {c: row[c] for c in JOB_COLUMNS}
    # SQLite keeps a whole REAL as an integer on disk and RETURNING hands it back so: times are floats again here.
    for c in _FLOATS:
        if values[c] is not None:
            values[c] = float(values[c])
    values["cancel_requested"] = bool(values["cancel_requested"])
    values["edit"] = bool(values["edit"])
    values["request"] = bytes(values["request"])
    if values["result"] is not None:
        values["result"] = bytes(values["result"])
    return JobRecord(**values)


def _in_list(prefix: str, values: Sequence[str]) -> tuple[str, dict[str, str]]:
    params = {f"{prefix}{i}": v for i, v in enumerate(values)}
    return ", ".join(f":{k}" for k in params), params


class SqlJobStore:
    """The JobStore calls over a backend's ``_tx``. Subclasses set ``url_for_logs`` and the lock clauses and
    implement ``connect``, ``close`` and ``_tx``."""

    url_for_logs: str
    # Postgres: claimers skip the rows another holds (SKIP LOCKED); cancel waits for the row it changes.
    skip_locked: str = ""  # appended to a SELECT ... FROM jobs c / deliveries
    skip_locked_c: str = ""  # the same, for a SELECT joining jobs c with others
    lock_row: str = ""

    def _tx(self, write: bool) -> AbstractAsyncContextManager[Tx]:
        raise NotImplementedError

    # -- jobs ---------------------------------------------------------------------------------------------------

    async def insert(self, job: NewJob) -> tuple[JobRecord, bool]:
        params = dataclasses.asdict(job)
        async with self._tx(write=True) as tx:
            rows = await tx.fetch(
                "INSERT INTO jobs (id, tenant, status, request, n, priority, created_at, deadline, webhook_url, "
                "idempotency_key, request_id, edit, available_at) VALUES (:id, :tenant, 'queued', :request, :n, "
                ":priority, :created_at, :deadline, :webhook_url, :idempotency_key, :request_id, :edit, :created_at) "
                f"ON CONFLICT DO NOTHING RETURNING {_COLS}", params)
            if rows:
                return job_from_row(rows[0]), True
            # The same key, or the same job again (a retried insert): the row that is there.
            if job.idempotency_key:
                rows = await tx.fetch(f"SELECT {_COLS} FROM jobs WHERE tenant = :tenant AND "
                                      "idempotency_key = :idempotency_key", params)
            else:
                rows = await tx.fetch(f"SELECT {_COLS} FROM jobs WHERE id = :id AND tenant = :tenant", params)
            if not rows:
                raise ValueError(f"job id {job.id} is taken by another tenant's job")
            return job_from_row(rows[0]), False

    async def get(self, job_id: str, tenant: str | None) -> JobRecord | None:
        async with self._tx(write=False) as tx:
            if tenant is None:
                rows = await tx.fetch(f"SELECT {_COLS} FROM jobs WHERE id = :id", {"id": job_id})
            else:
                rows = await tx.fetch(f"SELECT {_COLS} FROM jobs WHERE id = :id AND tenant = :tenant",
                                      {"id": job_id, "tenant": tenant})
        return job_from_row(rows[0]) if rows else None

    async def list(self, tenant: str, limit: int, after: str | None,
                   status: str | None) -> tuple[list[JobRecord], bool]:
        if limit < 1:
            raise ValueError(f"limit must be at least 1, not {limit}")
        params: dict[str, Any] = {"tenant": tenant, "limit": limit + 1}
        where = "tenant = :tenant"
        if status:
            where += " AND status = :status"
            params["status"] = status
        async with self._tx(write=False) as tx:
            if after:
                found = await tx.fetch("SELECT seq FROM jobs WHERE id = :id AND tenant = :tenant",
                                       {"id": after, "tenant": tenant})
                if not found:
                    return [], False
                where += " AND seq < :after_seq"
                params["after_seq"] = found[0]["seq"]
            rows = await tx.fetch(f"SELECT {_COLS} FROM jobs WHERE {where} ORDER BY seq DESC LIMIT :limit", params)
        jobs = [job_from_row(r) for r in rows[:limit]]
        return jobs, len(rows) > limit

    async def queue_position(self, job: JobRecord) -> int:
        # claim()'s order as it stands now: (tenant's running jobs, priority, seq) before this job's.
        async with self._tx(write=False) as tx:
            rows = await tx.fetch(
                "WITH me AS (SELECT seq, priority, tenant FROM jobs WHERE id = :id AND status = 'queued'), "
                "running AS (SELECT tenant, COUNT(*) AS running FROM jobs WHERE status = 'in_progress' "
                "GROUP BY tenant) "
                "SELECT COUNT(*) AS ahead FROM jobs c CROSS JOIN me "
                "LEFT JOIN running rc ON rc.tenant = c.tenant LEFT JOIN running rm ON rm.tenant = me.tenant "
                "WHERE c.status = 'queued' AND c.seq <> me.seq AND (COALESCE(rc.running, 0), c.priority, c.seq) "
                "< (COALESCE(rm.running, 0), me.priority, me.seq)", {"id": job.id})
        return int(rows[0]["ahead"]) if rows else 0

    async def claim(self, owner: str, now: float, lease_s: float, max_attempts: int) -> Lease | None:
        async with self._tx(write=True) as tx:
            rows = await tx.fetch(
                "UPDATE jobs SET status = 'in_progress', lease_owner = :owner, lease_until = :lease_until, "
                "attempts = attempts + 1, started_at = COALESCE(started_at, :now), step = 0, total_steps = 0 "
                f"WHERE seq = (SELECT c.seq FROM jobs c LEFT JOIN ({_RUNNING}) r ON r.tenant = c.tenant "
                f"WHERE {_CLAIMABLE} ORDER BY COALESCE(r.running, 0), c.priority, c.seq LIMIT 1 {self.skip_locked_c}) "
                f"RETURNING {_COLS}",
                {"owner": owner, "now": now, "lease_until": now + lease_s, "max_attempts": max_attempts})
        if not rows:
            return None
        job = job_from_row(rows[0])
        return Lease(job=job, owner=owner, attempt=job.attempts)

    async def reap(self, now: float, max_attempts: int,
                   outcome_for: Callable[[JobRecord, str, str], Outcome]) -> list[JobRecord]:
        ended: list[JobRecord] = []
        while True:
            async with self._tx(write=True) as tx:
                # Queued jobs out of attempts too: claim() never takes them, so they would wait for their deadline.
                rows = await tx.fetch(
                    f"SELECT {_C_COLS} FROM jobs c WHERE (c.status = 'queued' OR (c.status = 'in_progress' "
                    "AND c.lease_until < :now)) AND (c.deadline <= :now OR c.attempts - c.released >= :max_attempts) "
                    f"ORDER BY c.seq LIMIT {REAP_BATCH} {self.skip_locked}", {"now": now, "max_attempts": max_attempts})
                for job in map(job_from_row, rows):
                    if job.deadline <= now:
                        code, message = "DEADLINE_EXCEEDED", "the job was not done by its deadline"
                    else:
                        code, message = "ABORTED", (f"the job's runners died {job.attempts - job.released} "
                                                    f"times under it (at most {max_attempts} attempts)")
                    record = await self._end(tx, job, outcome_for(job, code, message),
                                             "id = :id AND status = :old_status AND attempts = :attempt")
                    if record is not None:
                        ended.append(record)
            if len(rows) < REAP_BATCH:
                return ended

    async def renew(self, lease: Lease, now: float, lease_s: float, step: int, total_steps: int) -> tuple[bool, bool]:
        async with self._tx(write=True) as tx:
            rows = await tx.fetch(
                f"UPDATE jobs SET lease_until = :lease_until, step = :step, total_steps = :total_steps WHERE {_FENCED} "
                "RETURNING cancel_requested",
                {**_fence(lease), "lease_until": now + lease_s, "step": step, "total_steps": total_steps})
        return (True, bool(rows[0]["cancel_requested"])) if rows else (False, False)

    async def release(self, lease: Lease, available_at: float) -> bool:
        async with self._tx(write=True) as tx:
            changed = await tx.execute(
                "UPDATE jobs SET status = 'queued', lease_owner = NULL, lease_until = NULL, "
                f"available_at = :available_at, step = 0, total_steps = 0, released = released + 1 WHERE {_FENCED}",
                {**_fence(lease), "available_at": available_at})
        return changed > 0

    async def finish(self, lease: Lease, outcome: Outcome) -> bool:
        async with self._tx(write=True) as tx:
            return await self._end(tx, lease.job, outcome, _FENCED, _fence(lease)) is not None

    async def cancel(self, job_id: str, tenant: str, now: float,
                     outcome_for: Callable[[JobRecord], Outcome]) -> JobRecord | None:
        async with self._tx(write=True) as tx:
            rows = await tx.fetch(f"SELECT {_COLS} FROM jobs WHERE id = :id AND tenant = :tenant {self.lock_row}",
                                  {"id": job_id, "tenant": tenant})
            if not rows:
                return None
            job = job_from_row(rows[0])
            if job.status == QUEUED or (job.status == IN_PROGRESS and (job.lease_until or 0) < now):
                # No live runner to tell (queued, or its runner died): it ends here. A late runner's finish then
                # fails its fencing, as after a takeover.
                return await self._end(tx, job, outcome_for(job),
                                       "id = :id AND status = :old_status AND attempts = :attempt")
            if job.status == IN_PROGRESS:
                rows = await tx.fetch(f"UPDATE jobs SET cancel_requested = TRUE WHERE id = :id RETURNING {_COLS}",
                                      {"id": job_id})
                return job_from_row(rows[0])
            return job

    async def _end(self, tx: Tx, job: JobRecord, outcome: Outcome, where: str,
                   fence: Mapping[str, Any] | None = None) -> JobRecord | None:
        """Writes a job's end with its objects and webhook row, if ``where`` still holds; the ended record."""
        if outcome.status not in TERMINAL:
            raise ValueError(f"an outcome ends a job as {sorted(TERMINAL)}, not {outcome.status!r}")
        params = {"id": job.id, "old_status": job.status, "attempt": job.attempts, **(fence or {}),
                  "status": outcome.status, "finished_at": outcome.finished_at, "expires_at": outcome.expires_at,
                  "result": outcome.result, "error_code": outcome.error_code,
                  "error_message": outcome.error_message, "error_field": outcome.error_field,
                  "step": outcome.step, "total_steps": outcome.total_steps}
        rows = await tx.fetch(_END.format(where=where), params)
        if not rows:
            return None
        await self._insert_objects(tx, outcome.objects)
        if (d := outcome.webhook) is not None:
            await tx.execute(
                "INSERT INTO deliveries (id, job_id, tenant, url, payload, status, attempts, created_at, give_up_at, "
                "next_at) VALUES (:id, :job_id, :tenant, :url, :payload, 'pending', 0, :created_at, :give_up_at, "
                ":created_at) ON CONFLICT DO NOTHING", dataclasses.asdict(d))
        return job_from_row(rows[0])

    @staticmethod
    async def _insert_objects(tx: Tx, objects: Sequence[StoredObject]) -> None:
        for o in objects:
            await tx.execute("INSERT INTO objects (key, tenant, size, expires_at, job_id) VALUES (:key, :tenant, "
                             ":size, :expires_at, :job_id) ON CONFLICT DO NOTHING", dataclasses.asdict(o))

    async def record_objects(self, objects: Sequence[StoredObject]) -> None:
        if objects:
            async with self._tx(write=True) as tx:
                await self._insert_objects(tx, objects)

    async def stored_bytes(self, tenant: str, now: float) -> int:
        async with self._tx(write=False) as tx:
            rows = await tx.fetch("SELECT COALESCE(SUM(size), 0) AS total FROM objects WHERE tenant = :tenant "
                                  "AND expires_at > :now", {"tenant": tenant, "now": now})
        return int(rows[0]["total"])

    async def expired(self, now: float, limit: int) -> tuple[list[str], list[str]]:
        params = {"now": now, "limit": limit}
        async with self._tx(write=False) as tx:
            jobs = await tx.fetch("SELECT id FROM jobs WHERE expires_at < :now ORDER BY expires_at LIMIT :limit",
                                  params)
            objects = await tx.fetch("SELECT key FROM objects WHERE expires_at < :now ORDER BY expires_at "
                                     "LIMIT :limit", params)
        return [r["id"] for r in jobs], [r["key"] for r in objects]

    async def delete(self, job_ids: Sequence[str], keys: Sequence[str]) -> None:
        if not job_ids and not keys:
            return
        async with self._tx(write=True) as tx:
            for i in range(0, len(job_ids), IN_CHUNK):
                ids, params = _in_list("j", job_ids[i:i + IN_CHUNK])
                await tx.execute(f"DELETE FROM deliveries WHERE job_id IN ({ids})", params)
                await tx.execute(f"DELETE FROM jobs WHERE id IN ({ids})", params)
            for i in range(0, len(keys), IN_CHUNK):
                ks, params = _in_list("k", keys[i:i + IN_CHUNK])
                await tx.execute(f"DELETE FROM objects WHERE key IN ({ks})", params)

    async def counts(self) -> dict[str, int]:
        async with self._tx(write=False) as tx:
            rows = await tx.fetch("SELECT status, COUNT(*) AS n FROM jobs GROUP BY status", {})
        return {s: 0 for s in STATUSES} | {r["status"]: int(r["n"]) for r in rows}

    async def oldest_queued(self) -> float | None:
        async with self._tx(write=False) as tx:
            rows = await tx.fetch("SELECT MIN(created_at) AS oldest FROM jobs WHERE status = 'queued'", {})
        return None if rows[0]["oldest"] is None else float(rows[0]["oldest"])

    async def leases(self, now: float) -> int:
        async with self._tx(write=False) as tx:
            rows = await tx.fetch("SELECT COUNT(*) AS n FROM jobs WHERE status = 'in_progress' AND lease_until >= :now",
                                  {"now": now})
        return int(rows[0]["n"])

    # -- webhook outbox -----------------------------------------------------------------------------------------

    async def claim_delivery(self, owner: str, now: float, lease_s: float) -> Delivery | None:
        async with self._tx(write=True) as tx:
            rows = await tx.fetch(
                "UPDATE deliveries SET attempts = attempts + 1, lease_owner = :owner, lease_until = :lease_until "
                "WHERE id = (SELECT id FROM deliveries WHERE status = 'pending' AND next_at <= :now AND "
                "(lease_until IS NULL OR lease_until < :now) ORDER BY next_at, created_at LIMIT 1 "
                f"{self.skip_locked}) RETURNING {_DELIVERY_COLS}",
                {"owner": owner, "now": now, "lease_until": now + lease_s})
        if not rows:
            return None
        r = rows[0]
        return Delivery(id=r["id"], job_id=r["job_id"], tenant=r["tenant"], url=r["url"], payload=bytes(r["payload"]),
                        attempts=int(r["attempts"]), created_at=float(r["created_at"]),
                        give_up_at=float(r["give_up_at"]), owner=r["lease_owner"])

    async def delivery_done(self, d: Delivery, now: float) -> None:
        # Not fenced: a receiver that got it got it, even from a sender whose lease ran out meanwhile.
        async with self._tx(write=True) as tx:
            await tx.execute("UPDATE deliveries SET status = 'delivered', finished_at = :now, lease_owner = NULL, "
                             "lease_until = NULL, last_error = '' WHERE id = :id AND status = 'pending'",
                             {"id": d.id, "now": now})

    async def delivery_retry(self, d: Delivery, next_at: float, error: str) -> None:
        async with self._tx(write=True) as tx:
            await tx.execute("UPDATE deliveries SET next_at = :next_at, last_error = :error, lease_owner = NULL, "
                             f"lease_until = NULL WHERE {_DELIVERY_FENCED}",
                             {**_delivery_fence(d), "next_at": next_at, "error": error})

    async def delivery_failed(self, d: Delivery, now: float, error: str) -> None:
        async with self._tx(write=True) as tx:
            await tx.execute("UPDATE deliveries SET status = 'failed', finished_at = :now, last_error = :error, "
                             f"lease_owner = NULL, lease_until = NULL WHERE {_DELIVERY_FENCED}",
                             {**_delivery_fence(d), "now": now, "error": error})

    async def delivery_counts(self) -> dict[str, int]:
        async with self._tx(write=False) as tx:
            rows = await tx.fetch("SELECT status, COUNT(*) AS n FROM deliveries GROUP BY status", {})
        return {s: 0 for s in DELIVERY_STATUSES} | {r["status"]: int(r["n"]) for r in rows}


# A sender's retry or give-up counts only while the row is still its claim (not re-claimed after its lease ran out).
_DELIVERY_FENCED = "id = :id AND status = 'pending' AND lease_owner = :owner AND attempts = :attempt"


def _fence(lease: Lease) -> dict[str, Any]:
    return {"id": lease.job.id, "owner": lease.owner, "attempt": lease.attempt}


def _delivery_fence(d: Delivery) -> dict[str, Any]:
    return {"id": d.id, "owner": d.owner, "attempt": d.attempts}

