"""The durable job store (gateway/jobs/store*.py) on real databases: a SQLite file, and a real PostgreSQL server
(tests/support/postgres_server.py, one per module, a fresh schema per test). Every behaviour test runs on both.

What is checked: rows round-trip and stay within their tenant; idempotency keys; newest-first pages; the claim
order (a tenant's running jobs first, then priority, then age) and queue positions that agree with it; leases —
renewal, release, takeover after expiry with the attempt counted, and fencing, so a runner that lost its job records
nothing and a job ends exactly once, its objects and webhook row in the same transaction; reap (deadline, attempts);
cancel in each state; stored bytes, expiry and deletion; the gauges' counts; the webhook outbox's claims, retries
and re-claims after a sender's lease ran out; errors as StoreUnavailable; and several processes claiming from one
database at once, every job taken exactly once.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
import sqlite3
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import asyncpg
import pytest

from gateway.jobs.model import (
    CANCELLED,
    COMPLETED,
    FAILED,
    IN_PROGRESS,
    QUEUED,
    JobRecord,
    NewDelivery,
    NewJob,
    Outcome,
    StoredObject,
    new_delivery_id,
    new_job_id,
)
from gateway.jobs.store import JobStore, StoreUnavailable, open_store
from gateway.jobs.store_postgres import PostgresJobStore
from gateway.jobs.store_sqlite import SqliteJobStore
from tests.support.net import free_port
from tests.support.postgres_server import PASSWORD, PostgresServer, running_postgres

REPO = Path(__file__).resolve().parent.parent
T0 = 1_700_000_000.0
LEASE_S = 30.0
MAX_ATTEMPTS = 3
TTL = 3600.0
BACKENDS = ["sqlite", "postgres"]


@pytest.fixture(scope="module")
def pg() -> Iterator[PostgresServer]:
    with running_postgres() as server:
        yield server


@pytest.fixture(params=BACKENDS)
async def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh, empty job database of each kind."""
    if request.param == "sqlite":
        return f"sqlite://{tmp_path}/jobs/jobs.sqlite3"  # the directory does not exist yet: connect makes it
    # Postgres: a schema of its own (CREATE DATABASE costs a second on a loaded machine, a schema nothing), which
    # the DSN names: asyncpg sends unknown DSN parameters as the session's settings.
    server: PostgresServer = request.getfixturevalue("pg")
    name = f"t_{secrets.token_hex(6)}"
    admin = await asyncpg.connect(server.dsn())
    try:
        await admin.execute(f"CREATE SCHEMA {name}")
    finally:
        await admin.close()
    return f"{server.dsn()}?search_path={name}"


@pytest.fixture()
async def store(db_url: str) -> AsyncIterator[JobStore]:
    s = open_store(db_url)
    await s.connect()
    try:
        yield s
    finally:
        await s.close()


def new_job(tenant: str = "a", priority: int = 1, created_at: float = T0, deadline: float = T0 + 3600,
            key: str = "", **kw) -> NewJob:
    return NewJob(id=new_job_id(), tenant=tenant, request=b"\x08\x01req", n=1, priority=priority,
                  created_at=created_at, deadline=deadline, idempotency_key=key, **kw)


def outcome(job: JobRecord, status: str = COMPLETED, now: float = T0 + 100, objects: int = 0,
            webhook: bool = True, code: str = "", message: str = "") -> Outcome:
    objs = tuple(StoredObject(key=f"{job.tenant}/{secrets.token_hex(8)}/{i}.png", tenant=job.tenant, size=100 + i,
                              expires_at=now + TTL, job_id=job.id) for i in range(objects))
    hook = NewDelivery(id=new_delivery_id(), job_id=job.id, tenant=job.tenant, url="https://hooks.example/x",
                       payload=json.dumps({"job": job.id, "status": status}).encode(), created_at=now,
                       give_up_at=now + 3600) if webhook else None
    return Outcome(status=status, finished_at=now, expires_at=now + TTL,
                   result=b"resp" if status == COMPLETED else None, error_code=code, error_message=message,
                   objects=objs, webhook=hook)


def reaped(now: float):
    def outcome_for(job: JobRecord, code: str, message: str) -> Outcome:
        return outcome(job, FAILED, now, code=code, message=message)
    return outcome_for


def cancelled(now: float):
    def outcome_for(job: JobRecord) -> Outcome:
        return outcome(job, CANCELLED, now, code="CANCELLED", message="cancelled by the client")
    return outcome_for


async def insert(store: JobStore, *jobs: NewJob) -> list[JobRecord]:
    return [(await store.insert(j))[0] for j in jobs]


# -- rows, tenants, idempotency, pages ---------------------------------------------------------------------------


async def test_insert_get_and_tenant_isolation(store: JobStore) -> None:
    nj = new_job("a", priority=2, webhook_url="https://hooks.example/a", request_id="req-1", edit=True)
    record, created = await store.insert(nj)
    assert created
    assert (record.id, record.tenant, record.status, record.request, record.n, record.priority) == (
        nj.id, "a", QUEUED, nj.request, 1, 2)
    assert (record.webhook_url, record.request_id, record.edit, record.cancel_requested) == (
        "https://hooks.example/a", "req-1", True, False)
    assert (record.attempts, record.lease_owner, record.started_at, record.result, record.available_at) == (
        0, None, None, None, T0)
    assert await store.get(nj.id, "a") == record
    assert await store.get(nj.id, None) == record  # internal callers: any tenant
    assert await store.get(nj.id, "b") is None  # another tenant cannot see it
    assert await store.get(new_job_id(), "a") is None


async def test_idempotency_key(store: JobStore) -> None:
    first, created = await store.insert(new_job("a", key="k1"))
    assert created
    again, created = await store.insert(new_job("a", key="k1", priority=0))
    assert not created and again == first
    other, created = await store.insert(new_job("b", key="k1"))  # keys are per tenant
    assert created and other.id != first.id
    plain = new_job("a")
    assert (await store.insert(plain))[1] and (await store.insert(new_job("a")))[1]  # no key: every insert is new
    assert (await store.insert(plain)) == (await store.get(plain.id, "a"), False)  # the same job again: no copy
    assert (await store.counts())[QUEUED] == 4


async def test_list_newest_first_with_pages_and_status(store: JobStore) -> None:
    jobs = await insert(store, *(new_job("a") for _ in range(5)))
    await insert(store, new_job("b"))
    newest = [j.id for j in reversed(jobs)]
    page, more = await store.list("a", 2, None, None)
    assert [j.id for j in page] == newest[:2] and more
    page, more = await store.list("a", 2, page[-1].id, None)
    assert [j.id for j in page] == newest[2:4] and more
    page, more = await store.list("a", 2, page[-1].id, None)
    assert [j.id for j in page] == newest[4:] and not more
    page, more = await store.list("a", 5, None, None)
    assert len(page) == 5 and not more
    lease = await store.claim("r1", T0 + 1, LEASE_S, MAX_ATTEMPTS)
    assert lease is not None and lease.job.id == jobs[0].id
    assert [j.id for j in (await store.list("a", 10, None, IN_PROGRESS))[0]] == [jobs[0].id]
    assert [j.id for j in (await store.list("a", 2, None, QUEUED))[0]] == newest[:2]
    assert await store.list("a", 10, newest[1], QUEUED) == ((await store.list("a", 10, None, QUEUED))[0][2:], False)
    assert await store.list("a", 10, new_job_id(), None) == ([], False)  # an unknown cursor: nothing
    b_id = (await store.list("b", 1, None, None))[0][0].id
    assert await store.list("a", 10, b_id, None) == ([], False)  # another tenant's id is unknown here
    with pytest.raises(ValueError):
        await store.list("a", 0, None, None)


# -- claims: order, positions, leases ----------------------------------------------------------------------------


async def test_claim_order_tenant_fairness_then_priority_then_age(store: JobStore) -> None:
    a1, a2, a3, b1, c1 = await insert(store, new_job("a"), new_job("a"), new_job("a"), new_job("b"),
                                      new_job("c", priority=2))
    assert [await store.queue_position(j) for j in (a1, a2, a3, b1, c1)] == [0, 1, 2, 3, 4]
    now = T0 + 1
    first = await store.claim("r1", now, LEASE_S, MAX_ATTEMPTS)
    assert first is not None and first.job.id == a1.id
    # a runs one now: b's and c's jobs come before a's next, priority deciding between b and c.
    assert [await store.queue_position(j) for j in (b1, c1, a2, a3)] == [0, 1, 2, 3]
    assert await store.queue_position(first.job) == 0  # not queued
    order = []
    while (lease := await store.claim("r1", now, LEASE_S, MAX_ATTEMPTS)) is not None:
        order.append(lease.job.id)
    assert order == [b1.id, c1.id, a2.id, a3.id]
    # Priority within a tenant: a later class-0 job before an earlier class-1 one.
    late, urgent = await insert(store, new_job("d", priority=1), new_job("d", priority=0))
    lease = await store.claim("r1", now, LEASE_S, MAX_ATTEMPTS)
    assert lease is not None and lease.job.id == urgent.id
    assert await store.queue_position(late) == 0


async def test_claim_sets_the_lease(store: JobStore) -> None:
    job, = await insert(store, new_job("a"))
    lease = await store.claim("r1", T0 + 5, LEASE_S, MAX_ATTEMPTS)
    assert lease is not None and lease.owner == "r1" and lease.attempt == 1
    j = lease.job
    assert (j.id, j.status, j.attempts, j.lease_owner, j.lease_until, j.started_at, j.step, j.total_steps) == (
        job.id, IN_PROGRESS, 1, "r1", T0 + 5 + LEASE_S, T0 + 5, 0, 0)
    assert await store.get(job.id, "a") == j
    assert await store.claim("r2", T0 + 6, LEASE_S, MAX_ATTEMPTS) is None  # nothing else to take
    assert await store.leases(T0 + 6) == 1 and await store.leases(T0 + 5 + LEASE_S + 1) == 0


async def test_takeover_after_lease_expiry_and_fencing(store: JobStore) -> None:
    job, = await insert(store, new_job("a"))
    old = await store.claim("dead", T0 + 1, LEASE_S, MAX_ATTEMPTS)
    assert old is not None
    assert await store.claim("r2", T0 + 1 + LEASE_S, LEASE_S, MAX_ATTEMPTS) is None  # the lease holds to its end
    now = T0 + 2 + LEASE_S
    new = await store.claim("r2", now, LEASE_S, MAX_ATTEMPTS)
    assert new is not None and new.job.id == job.id and new.attempt == 2
    assert new.job.started_at == T0 + 1  # the first start stays
    # The first runner, back, can change nothing.
    assert await store.renew(old, now, LEASE_S, 5, 10) == (False, False)
    assert not await store.release(old, now)
    assert not await store.finish(old, outcome(old.job, objects=2))
    # The same owner name on a later attempt does not help a stale lease either.
    assert not await store.finish(dataclasses.replace(old, owner="r2"), outcome(old.job))
    assert await store.finish(new, outcome(new.job, now=now + 1, objects=1))
    assert not await store.finish(new, outcome(new.job, now=now + 2, objects=1))  # the end is recorded once
    ended = await store.get(job.id, "a")
    assert ended is not None
    assert (ended.status, ended.finished_at, ended.expires_at, ended.result, ended.lease_owner, ended.lease_until) == (
        COMPLETED, now + 1, now + 1 + TTL, b"resp", None, None)
    assert await store.delivery_counts() == {"pending": 1, "delivered": 0, "failed": 0}
    assert await store.stored_bytes("a", now) == 100  # only the recorded end's object
    assert await store.renew(new, now + 3, LEASE_S, 1, 1) == (False, False)  # ended: no longer anyone's


async def test_finish_writes_job_objects_and_webhook_together(store: JobStore) -> None:
    job, = await insert(store, new_job("a"))
    lease = await store.claim("r1", T0 + 1, LEASE_S, MAX_ATTEMPTS)
    assert lease is not None
    end = outcome(lease.job, objects=3)
    assert await store.finish(lease, end)
    assert await store.stored_bytes("a", T0 + 200) == 100 + 101 + 102
    d = await store.claim_delivery("w", T0 + 100, 10)
    assert d is not None
    assert (d.id, d.job_id, d.tenant, d.url, d.payload, d.attempts, d.created_at, d.give_up_at) == (
        end.webhook.id, job.id, "a", end.webhook.url, end.webhook.payload, 1, T0 + 100, T0 + 100 + 3600)
    # An outcome that is not an end is refused, and writes nothing.
    other, = await insert(store, new_job("a"))
    lease = await store.claim("r1", T0 + 2, LEASE_S, MAX_ATTEMPTS)
    with pytest.raises(ValueError):
        await store.finish(lease, dataclasses.replace(outcome(other, objects=1), status=QUEUED))
    assert (await store.get(other.id, "a")).status == IN_PROGRESS
    assert await store.stored_bytes("a", T0 + 200) == 303
    assert await store.delivery_counts() == {"pending": 1, "delivered": 0, "failed": 0}


async def test_renew_extends_the_lease_reports_progress_and_cancel(store: JobStore) -> None:
    job, = await insert(store, new_job("a"))
    lease = await store.claim("r1", T0, LEASE_S, MAX_ATTEMPTS)
    assert lease is not None
    assert await store.renew(lease, T0 + 20, LEASE_S, 7, 50) == (True, False)
    got = await store.get(job.id, "a")
    assert (got.lease_until, got.step, got.total_steps) == (T0 + 20 + LEASE_S, 7, 50)
    assert await store.claim("r2", T0 + LEASE_S + 1, LEASE_S, MAX_ATTEMPTS) is None  # renewed: still held
    await store.cancel(job.id, "a", T0 + 21, cancelled(T0 + 21))
    assert await store.renew(lease, T0 + 22, LEASE_S, 8, 50) == (True, True)


async def test_release_gives_the_job_back(store: JobStore) -> None:
    job, = await insert(store, new_job("a"))
    lease = await store.claim("r1", T0, LEASE_S, MAX_ATTEMPTS)
    assert await store.renew(lease, T0 + 1, LEASE_S, 3, 10) == (True, False)
    assert await store.release(lease, T0 + 60)
    got = await store.get(job.id, "a")
    assert (got.status, got.lease_owner, got.lease_until, got.step, got.total_steps, got.available_at) == (
        QUEUED, None, None, 0, 0, T0 + 60)
    assert not await store.release(lease, T0 + 60)  # not ours any more
    assert await store.claim("r2", T0 + 59, LEASE_S, MAX_ATTEMPTS) is None  # backing off
    again = await store.claim("r2", T0 + 60, LEASE_S, MAX_ATTEMPTS)
    assert again is not None and again.attempt == 2 and again.job.started_at == T0


# -- reap, cancel ------------------------------------------------------------------------------------------------


async def test_reap_ends_jobs_out_of_attempts_or_time(store: JobStore) -> None:
    lost, = await insert(store, new_job("a"))
    now = T0
    for attempt in range(1, MAX_ATTEMPTS + 1):
        lease = await store.claim(f"r{attempt}", now, LEASE_S, MAX_ATTEMPTS)
        assert lease is not None and lease.attempt == attempt
        now += LEASE_S + 1  # each runner dies
    assert await store.claim("r9", now, LEASE_S, MAX_ATTEMPTS) is None  # out of attempts
    running, = await insert(store, new_job("c", deadline=now + 10))
    late, = await insert(store, new_job("b", deadline=now + 10))
    live = await store.claim("rc", now, 3600, MAX_ATTEMPTS)
    assert live is not None and live.job.id == running.id
    fresh, = await insert(store, new_job("d"))
    ended = await store.reap(now, MAX_ATTEMPTS, reaped(now))
    assert [(j.id, j.status, j.error_code) for j in ended] == [(lost.id, FAILED, "ABORTED")]
    assert "died 3 times" in ended[0].error_message
    assert await store.reap(now, MAX_ATTEMPTS, reaped(now)) == []
    later = now + 11  # late's and running's deadlines passed; running's lease is alive: its runner ends it
    ended = await store.reap(later, MAX_ATTEMPTS, reaped(later))
    assert [(j.id, j.status, j.error_code, j.finished_at) for j in ended] == [(late.id, FAILED, "DEADLINE_EXCEEDED",
                                                                               later)]
    assert (await store.get(running.id, None)).status == IN_PROGRESS
    assert (await store.get(fresh.id, None)).status == QUEUED
    assert await store.claim("r9", later, LEASE_S, MAX_ATTEMPTS) is not None  # fresh, still claimable
    # Each reaped job's webhook row was written with its end.
    assert await store.delivery_counts() == {"pending": 2, "delivered": 0, "failed": 0}
    assert await store.finish(live, outcome(live.job))  # a live lease past the deadline finishes normally
    # Takes given back (a failure that heals, a clean stop) are no runner dying: they spend no attempt.
    back, = await insert(store, new_job("e"))
    t = later + 1
    for _ in range(MAX_ATTEMPTS + 2):
        lease = await store.claim("r", t, LEASE_S, MAX_ATTEMPTS)
        assert lease is not None and lease.job.id == back.id
        assert await store.release(lease, t)
    assert await store.reap(t, MAX_ATTEMPTS, reaped(t)) == []
    record = await store.get(back.id, None)
    assert (record.status, record.attempts, record.released) == (QUEUED, MAX_ATTEMPTS + 2, MAX_ATTEMPTS + 2)


async def test_cancel_in_each_state(store: JobStore) -> None:
    running, dead, done, queued = await insert(store, new_job("b"), new_job("c"), new_job("d"), new_job("a"))
    run = await store.claim("r1", T0 + 5, 3600, MAX_ATTEMPTS)
    assert run.job.id == running.id
    gone = await store.claim("r2", T0 + 10, LEASE_S, MAX_ATTEMPTS)  # its runner dies: the lease ends at T0 + 40
    assert gone.job.id == dead.id
    fin = await store.claim("r3", T0 + 20, 3600, MAX_ATTEMPTS)
    assert fin.job.id == done.id and await store.finish(fin, outcome(fin.job, now=T0 + 20))
    now = T0 + 100

    assert await store.cancel(queued.id, "other", now, cancelled(now)) is None  # not that tenant's
    got = await store.cancel(queued.id, "a", now, cancelled(now))
    assert (got.status, got.error_code, got.finished_at, got.lease_owner) == (CANCELLED, "CANCELLED", now, None)
    got = await store.cancel(running.id, "b", now, cancelled(now))
    assert (got.status, got.cancel_requested) == (IN_PROGRESS, True)  # its runner ends it
    assert await store.finish(run, outcome(run.job, CANCELLED, now + 1))
    got = await store.cancel(dead.id, "c", now, cancelled(now))  # no live runner: ended now
    assert (got.status, got.lease_owner) == (CANCELLED, None)
    assert not await store.finish(gone, outcome(gone.job))  # its runner, late, records nothing

    def never(job: JobRecord) -> Outcome:
        raise AssertionError("an ended job is not ended again")
    before = await store.get(done.id, "d")
    assert await store.cancel(done.id, "d", now, never) == before
    # Webhooks: a's cancel, b's end, c's cancel, d's end.
    assert await store.delivery_counts() == {"pending": 4, "delivered": 0, "failed": 0}
    assert await store.counts() == {QUEUED: 0, IN_PROGRESS: 0, COMPLETED: 1, FAILED: 0, CANCELLED: 3}


# -- objects, expiry, counts -------------------------------------------------------------------------------------


async def test_stored_bytes_expiry_and_delete(store: JobStore) -> None:
    await store.record_objects([StoredObject("a/s/0.png", "a", 1000, T0 + 10),
                                StoredObject("a/s/1.png", "a", 2000, T0 + 10_000),
                                StoredObject("b/s/0.png", "b", 5, T0 + 10_000)])
    await store.record_objects([StoredObject("a/s/0.png", "a", 1000, T0 + 10)])  # again: no second row
    await store.record_objects([])
    assert await store.stored_bytes("a", T0) == 3000
    assert await store.stored_bytes("a", T0 + 10) == 2000  # expired ones no longer count
    assert await store.stored_bytes("nobody", T0) == 0
    jobs = await insert(store, new_job("a"), new_job("a"), new_job("a"))
    for i in range(3):
        lease = await store.claim("r", T0 + i, LEASE_S, MAX_ATTEMPTS)
        assert await store.finish(lease, outcome(lease.job, now=T0 + i, objects=1))
    # Jobs expire at T0 + i + TTL.
    assert await store.expired(T0 + 5, 10) == ([], [])
    assert await store.expired(T0 + 11, 10) == ([], ["a/s/0.png"])
    ids, keys = await store.expired(T0 + 1.5 + TTL, 10)
    assert sorted(ids) == sorted(j.id for j in jobs[:2]) and len(keys) == 3  # a/s/0 and the two jobs' images
    ids, keys = await store.expired(T0 + 1.5 + TTL, 1)
    assert len(ids) == 1 and len(keys) == 1
    ids, keys = await store.expired(T0 + 1.5 + TTL, 10)
    await store.delete(ids, keys)
    await store.delete([], [])
    assert [await store.get(j.id, None) is None for j in jobs] == [True, True, False]
    assert await store.expired(T0 + 1.5 + TTL, 10) == ([], [])
    assert await store.delivery_counts() == {"pending": 1, "delivered": 0, "failed": 0}  # the deleted jobs' went
    assert await store.stored_bytes("a", T0) == 2000 + 100  # a/s/1 and the third job's image


async def test_counts_oldest_queued_and_leases(store: JobStore) -> None:
    assert await store.counts() == {QUEUED: 0, IN_PROGRESS: 0, COMPLETED: 0, FAILED: 0, CANCELLED: 0}
    assert await store.oldest_queued() is None
    await insert(store, new_job("a", created_at=T0 + 5), new_job("b", created_at=T0 + 1), new_job("c", created_at=T0))
    assert await store.oldest_queued() == T0
    lease = await store.claim("r", T0 + 10, LEASE_S, MAX_ATTEMPTS)  # a: inserted first
    assert lease.job.tenant == "a"
    assert await store.oldest_queued() == T0
    assert await store.counts() == {QUEUED: 2, IN_PROGRESS: 1, COMPLETED: 0, FAILED: 0, CANCELLED: 0}
    assert await store.leases(T0 + 10) == 1
    assert await store.leases(T0 + 11 + LEASE_S) == 0  # lapsed: no live lease, though still in progress


# -- the webhook outbox ------------------------------------------------------------------------------------------


async def test_delivery_claims_retries_reclaims_and_ends(store: JobStore) -> None:
    first, second = await insert(store, new_job("a"), new_job("a"))
    for j in (first, second):
        lease = await store.claim("r", T0, LEASE_S, MAX_ATTEMPTS)
        assert await store.finish(lease, outcome(lease.job, now=T0 + (0 if j is first else 1)))
    now = T0 + 2
    d1 = await store.claim_delivery("w1", now, 10)
    assert d1 is not None and d1.job_id == first.id and d1.attempts == 1 and d1.owner == "w1"
    d2 = await store.claim_delivery("w1", now, 10)
    assert d2 is not None and d2.job_id == second.id
    assert await store.claim_delivery("w2", now, 10) is None  # both leased
    await store.delivery_failed(d2, now, "gave up")
    await store.delivery_retry(d1, now + 5, "HTTP 503")
    assert await store.claim_delivery("w2", now + 4, 10) is None  # not due yet
    d1b = await store.claim_delivery("w2", now + 5, 10)
    assert d1b is not None and (d1b.id, d1b.attempts, d1b.owner, d1b.payload) == (d1.id, 2, "w2", d1.payload)
    # w2 dies holding it: after its lease another sender re-claims the same message (same id: webhook-id).
    d1c = await store.claim_delivery("w3", now + 16, 10)
    assert d1c is not None and (d1c.id, d1c.attempts) == (d1.id, 3)
    await store.delivery_retry(d1b, now + 16, "stale")  # w2, back: fenced out, changes nothing
    await store.delivery_failed(d1b, now + 16, "stale")
    assert await store.delivery_counts() == {"pending": 1, "delivered": 0, "failed": 1}
    assert await store.claim_delivery("w4", now + 17, 10) is None  # still w3's
    await store.delivery_done(d1c, now + 17)
    await store.delivery_done(d1b, now + 17)  # delivered twice (at least once): still one delivered row
    assert await store.claim_delivery("w4", now + 10_000, 10) is None
    assert await store.delivery_counts() == {"pending": 0, "delivered": 1, "failed": 1}


# -- concurrency ---------------------------------------------------------------------------------------------------


async def test_concurrent_connects_and_tasks(db_url: str) -> None:
    stores = [open_store(db_url) for _ in range(4)]
    await asyncio.gather(*(s.connect() for s in stores))  # four starters creating the schema at once
    try:
        jobs = await insert(stores[0], *(new_job(f"t{i % 3}") for i in range(40)))

        async def drain(store: JobStore, owner: str) -> list[str]:
            taken = []
            while (lease := await store.claim(owner, T0 + 1, LEASE_S, 10)) is not None:
                taken.append(lease.job.id)
                assert await store.finish(lease, outcome(lease.job, webhook=False))
            return taken

        # Three tasks on each of the four stores' connections at once.
        taken = await asyncio.gather(*(drain(s, f"r{i}") for i, s in enumerate(stores) for _ in range(3)))
        ids = [j for t in taken for j in t]
        assert sorted(ids) == sorted(j.id for j in jobs)
        assert (await stores[1].counts())[COMPLETED] == 40
    finally:
        await asyncio.gather(*(s.close() for s in stores))


WORKER = """
import asyncio, json, sys
from gateway.jobs.store import open_store

async def main(url, owner, now):
    store = open_store(url)
    await store.connect()
    print("ready", flush=True)
    sys.stdin.readline()
    taken = []
    while (lease := await store.claim(owner, now, 3600, 10)) is not None:
        taken.append(lease.job.id)
    await store.close()
    print(json.dumps(taken), flush=True)

asyncio.run(main(sys.argv[1], sys.argv[2], float(sys.argv[3])))
"""


async def test_processes_racing_for_jobs_take_each_once(db_url: str) -> None:
    """Four processes claim from one database at once: no job is given twice, none is left."""
    store = open_store(db_url)
    await store.connect()
    try:
        jobs = await insert(store, *(new_job(f"t{i % 5}", priority=i % 3) for i in range(160)))
        procs = [await asyncio.create_subprocess_exec(
            sys.executable, "-c", WORKER, db_url, f"w{i}", str(T0 + 1), cwd=REPO,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE) for i in range(4)]
        try:
            for p in procs:  # all connected before any claims
                assert await asyncio.wait_for(p.stdout.readline(), 60) == b"ready\n"
            for p in procs:
                p.stdin.write(b"go\n")
                await p.stdin.drain()
            outs = [json.loads(await asyncio.wait_for(p.stdout.readline(), 60)) for p in procs]
            assert [await p.wait() for p in procs] == [0, 0, 0, 0]
        finally:
            for p in procs:
                if p.returncode is None:
                    p.kill()
                    await p.wait()
        taken = [j for out in outs for j in out]
        assert len(taken) == len(set(taken)) == len(jobs)
        assert set(taken) == {j.id for j in jobs}
        assert sum(1 for out in outs if out) >= 2, "the processes did not overlap at all"
        rows = [await store.get(j.id, None) for j in jobs]
        assert {(r.status, r.attempts) for r in rows} == {(IN_PROGRESS, 1)}
    finally:
        await store.close()


# -- errors, URLs --------------------------------------------------------------------------------------------------


async def test_sqlite_lock_held_past_busy_timeout_is_unavailable_and_a_cancelled_call_leaves_no_lock(
        tmp_path: Path) -> None:
    path = tmp_path / "jobs.sqlite3"
    store = SqliteJobStore(path, busy_timeout_s=0.2)
    patient = SqliteJobStore(path, busy_timeout_s=30)
    await store.connect()
    await patient.connect()
    other = sqlite3.connect(path, isolation_level=None, timeout=5)  # another process's writer, as it were
    try:
        await insert(store, new_job("a"), new_job("a"))
        other.execute("BEGIN IMMEDIATE")
        with pytest.raises(StoreUnavailable, match="locked"):
            await store.claim("r", T0, LEASE_S, MAX_ATTEMPTS)
        assert (await store.counts())[QUEUED] == 2  # readers are not blocked (WAL)
        # A claim cancelled while it waits for the lock must not leave its transaction (and the lock) behind.
        task = asyncio.create_task(patient.claim("r", T0, LEASE_S, MAX_ATTEMPTS))
        while not patient._lock.locked():
            await asyncio.sleep(0)
        for _ in range(5):
            await asyncio.sleep(0)  # let its BEGIN IMMEDIATE reach aiosqlite's thread
        task.cancel()
        other.execute("COMMIT")  # its BEGIN, still in aiosqlite's thread, now gets the lock
        with pytest.raises(asyncio.CancelledError):
            await task
        lease = await patient.claim("r", T0, LEASE_S, MAX_ATTEMPTS)
        assert lease is not None
        other.execute("BEGIN IMMEDIATE")  # the lock is free again
        other.execute("COMMIT")
        assert await store.claim("r2", T0, LEASE_S, MAX_ATTEMPTS) is not None
    finally:
        other.close()
        await patient.close()
        await store.close()


async def test_unreachable_databases_are_unavailable(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(StoreUnavailable):
        await open_store(str(tmp_path / "file" / "jobs.sqlite3")).connect()  # its directory cannot be made
    (tmp_path / "junk.sqlite3").write_bytes(b"not a database" * 100)
    with pytest.raises(StoreUnavailable):
        await open_store(str(tmp_path / "junk.sqlite3")).connect()
    nobody = PostgresJobStore(f"postgresql://u:{PASSWORD}@127.0.0.1:{free_port()}/db", connect_timeout_s=5)
    with pytest.raises(StoreUnavailable) as refused:
        await nobody.connect()
    assert PASSWORD not in str(refused.value)
    with pytest.raises(StoreUnavailable):
        await nobody.counts()  # never connected
    # A server that goes away under a connected store: its calls fail as StoreUnavailable.
    with running_postgres() as doomed:
        store = open_store(doomed.dsn())
        await store.connect()
        try:
            assert (await store.counts())[QUEUED] == 0
            doomed.stop()
            with pytest.raises(StoreUnavailable):
                await store.counts()
            with pytest.raises(StoreUnavailable):
                await store.insert(new_job("a"))
        finally:
            await store.close()


async def test_open_store_urls_and_logged_urls(tmp_path: Path, pg: PostgresServer) -> None:
    s = open_store(f"sqlite://{tmp_path}/a/b.db")
    assert isinstance(s, SqliteJobStore) and s.path == tmp_path / "a" / "b.db"
    assert s.url_for_logs == f"sqlite://{tmp_path}/a/b.db"
    s = open_store(str(tmp_path / "c.db"))
    assert isinstance(s, SqliteJobStore) and s.path == tmp_path / "c.db"
    await s.connect()
    await s.close()
    assert (tmp_path / "c.db").is_file()
    for url in ("postgresql://u:pw@db.example:5433/jobs", "postgres://u:pw@db.example/jobs?sslmode=require"):
        p = open_store(url)
        assert isinstance(p, PostgresJobStore) and "pw" not in p.url_for_logs and "u@db.example" in p.url_for_logs
    p = open_store("postgresql://u@h/db?password=hunter2&sslmode=verify-full")
    assert "hunter2" not in p.url_for_logs and "sslmode=verify-full" in p.url_for_logs
    store = open_store(pg.dsn())
    assert PASSWORD not in store.url_for_logs and str(pg.port) in store.url_for_logs
    for bad in ("mysql://u:secretpw@h/db", "redis://h:6379/0", "sqlite://relative/path", ""):
        with pytest.raises(ValueError) as e:
            open_store(bad)
        assert "secretpw" not in str(e.value)
