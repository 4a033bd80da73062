"""Webhooks end to end below the gateway: the event body and its Standard Webhooks signature (gateway/jobs/webhooks.py)
and the sender (gateway/jobs/deliveries.py) over the real SQLite job store's outbox to a real HTTPS receiver on
127.0.0.1 (tests/support/webhook_receiver.py), verified with the standardwebhooks package's own verifier."""
from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from standardwebhooks import Webhook
from standardwebhooks.webhooks import WebhookVerificationError

from gateway.jobs.deliveries import Deliverer
from gateway.jobs.egress import EgressPolicy
from gateway.jobs.model import COMPLETED, Delivery, NewDelivery, NewJob, Outcome, new_delivery_id, new_job_id
from gateway.jobs.store import JobStore, open_store
from gateway.jobs.webhooks import event_body, sign_headers, validate_webhook_secret, webhook_secret_for
from tests.support.webhook_receiver import WebhookReceiver, webhook_receiver

MASTER = b"m" * 32
SECRETS = {"alpha": webhook_secret_for("alpha", None, MASTER), "beta": webhook_secret_for("beta", None, MASTER)}


# -- the body and its signature ----------------------------------------------------------------------------------

def test_secrets_derive_per_tenant_or_come_from_the_tenants_file() -> None:
    alpha = webhook_secret_for("alpha", None, MASTER)
    assert alpha.startswith("whsec_") and len(base64.b64decode(alpha[6:])) == 32
    assert alpha == webhook_secret_for("alpha", "", MASTER)  # the same on every gateway sharing the master
    assert alpha != webhook_secret_for("beta", None, MASTER)
    assert alpha != webhook_secret_for("alpha", None, b"n" * 32)
    configured = "whsec_" + base64.b64encode(b"k" * 24).decode()
    assert webhook_secret_for("alpha", configured, MASTER) == configured
    for bad in ("k" * 32, "whsec_not base64!", "whsec_" + base64.b64encode(b"short").decode()):
        with pytest.raises(ValueError):
            validate_webhook_secret(bad)
    with pytest.raises(ValueError):
        webhook_secret_for("alpha", None, b"short")


@pytest.mark.parametrize(("status", "event_type"), [
    ("completed", "image.job.completed"), ("failed", "image.job.failed"), ("cancelled", "image.job.cancelled")])
def test_event_body(status: str, event_type: str) -> None:
    job = {"id": "job_1", "object": "image.job", "status": status, "created_at": 1700000000, "prompt": "ü"}
    event = json.loads(event_body("msg_abc", job, 1700000100.7))
    assert event == {"id": "evt_abc", "object": "event", "type": event_type, "created_at": 1700000100, "data": job}


def test_no_event_for_an_unfinished_job() -> None:
    with pytest.raises(ValueError):
        event_body("msg_abc", {"id": "job_1", "status": "in_progress"}, time.time())


def test_signature_verifies_with_the_standardwebhooks_verifier() -> None:
    body = event_body("msg_abc", {"id": "job_1", "status": "completed"}, time.time())
    headers = sign_headers(SECRETS["alpha"], "msg_abc", time.time(), body)
    assert set(headers) == {"webhook-id", "webhook-timestamp", "webhook-signature", "content-type"}
    assert headers["webhook-signature"].startswith("v1,")
    assert Webhook(SECRETS["alpha"]).verify(body, headers)["data"]["id"] == "job_1"
    with pytest.raises(WebhookVerificationError):
        Webhook(SECRETS["beta"]).verify(body, headers)
    with pytest.raises(WebhookVerificationError):
        Webhook(SECRETS["alpha"]).verify(body.replace(b"job_1", b"job_2"), headers)
    with pytest.raises(WebhookVerificationError):  # an old try's headers: receivers refuse replays past 5 minutes
        Webhook(SECRETS["alpha"]).verify(body, sign_headers(SECRETS["alpha"], "msg_abc", time.time() - 600, body))


def test_backoff_doubles_with_jitter_up_to_the_cap() -> None:
    d = Deliverer(None, EgressPolicy.from_patterns([]), SECRETS.__getitem__, backoff=5, max_backoff=300)  # type: ignore[arg-type]
    for attempts, base in ((1, 5), (2, 10), (3, 20), (7, 300), (10_000, 300)):
        waits = [d.delay(attempts) for _ in range(200)]
        assert base / 2 <= min(waits) and max(waits) <= base and max(waits) - min(waits) > base / 10, attempts
    with pytest.raises(ValueError):  # a lease shorter than a try would hand a live sender's row to another
        Deliverer(None, EgressPolicy.from_patterns([]), SECRETS.__getitem__, timeout=10, lease_s=15)  # type: ignore[arg-type]


# -- delivery over the real store ----------------------------------------------------------------------------------

class Outcomes:
    """The metrics hook: every try's outcome, awaitable."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self._changed = asyncio.Event()

    def delivery(self, outcome: str) -> None:
        self.seen.append(outcome)
        self._changed.set()

    async def until(self, done: Callable[[list[str]], bool], timeout: float = 30) -> list[str]:
        async with asyncio.timeout(timeout):
            while not done(self.seen):
                self._changed.clear()
                await self._changed.wait()
        return list(self.seen)


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[JobStore]:
    s = open_store(str(tmp_path / "jobs.sqlite3"))
    await s.connect()
    try:
        yield s
    finally:
        await s.close()


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[WebhookReceiver]:
    with webhook_receiver(tmp_path) as rec:
        yield rec


async def enqueue(store: JobStore, url: str, *, tenant: str = "alpha", now: float | None = None,
                  retry_for: float = 3600) -> NewDelivery:
    """A job ended through the store's real path (insert, claim, finish), its webhook row written with its end."""
    now = time.time() if now is None else now
    job = NewJob(id=new_job_id(), tenant=tenant, request=b"", n=1, priority=1, created_at=now, deadline=now + 3600,
                 webhook_url=url)
    await store.insert(job)
    lease = await store.claim("runner", now, 30, 10)
    assert lease is not None and lease.job.id == job.id
    msg_id = new_delivery_id()
    body = event_body(msg_id, {"id": job.id, "object": "image.job", "status": COMPLETED, "created_at": int(now)}, now)
    d = NewDelivery(id=msg_id, job_id=job.id, tenant=tenant, url=url, payload=body, created_at=now,
                    give_up_at=now + retry_for)
    assert await store.finish(lease, Outcome(status=COMPLETED, finished_at=now, expires_at=now + 86400, webhook=d))
    return d


def deliverer(store: JobStore, patterns: list[str], outcomes: Outcomes, ca: Path | None, **kwargs: object) -> Deliverer:
    kwargs = {"timeout": 5.0, "backoff": 0.02, "max_backoff": 0.1, "poll_s": 0.05} | kwargs
    return Deliverer(store, EgressPolicy.from_patterns(patterns), SECRETS.__getitem__, outcomes, ca_file=ca,
                     **kwargs)  # type: ignore[arg-type]


@asynccontextmanager
async def running(d: Deliverer) -> AsyncIterator[Deliverer]:
    stop = asyncio.Event()
    task = asyncio.create_task(d.run(stop))
    try:
        yield d
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


async def test_delivered_signed_and_verified(store: JobStore, receiver: WebhookReceiver,
                                             caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    sent = await enqueue(store, receiver.url("/hooks/glm?src=test"))
    outcomes = Outcomes()
    async with running(deliverer(store, ["127.0.0.1"], outcomes, receiver.ca_file)):
        assert await outcomes.until(lambda seen: len(seen) >= 1) == ["delivered"]
    (req,) = receiver.requests
    assert (req.method, req.path, req.body) == ("POST", "/hooks/glm?src=test", sent.payload)
    assert req.headers["webhook-id"] == sent.id and req.headers["content-type"] == "application/json"
    event = Webhook(SECRETS["alpha"]).verify(req.body, req.headers)
    assert event["type"] == "image.job.completed" and event["data"]["id"] == sent.job_id
    with pytest.raises(WebhookVerificationError):  # signed with the tenant's secret, no other
        Webhook(SECRETS["beta"]).verify(req.body, req.headers)
    assert (await store.delivery_counts())["delivered"] == 1
    assert sent.job_id in caplog.text and SECRETS["alpha"] not in caplog.text
    assert SECRETS["alpha"].removeprefix("whsec_") not in caplog.text


async def test_a_receiver_failing_twice_gets_the_third_try(store: JobStore, tmp_path: Path) -> None:
    with webhook_receiver(tmp_path, fail_first=2) as rec:
        sent = await enqueue(store, rec.url())
        outcomes = Outcomes()
        async with running(deliverer(store, ["127.0.0.1"], outcomes, rec.ca_file)):
            assert await outcomes.until(lambda seen: "delivered" in seen) == ["retry", "retry", "delivered"]
        assert len(rec.requests) == 3
        # One event: the same id on every try, each signed afresh and each verifying.
        assert {r.headers["webhook-id"] for r in rec.requests} == {sent.id}
        for r in rec.requests:
            Webhook(SECRETS["alpha"]).verify(r.body, r.headers)
    assert await store.delivery_counts() == {"pending": 0, "delivered": 1, "failed": 0}


async def test_a_redirect_is_a_failed_try_and_never_followed(store: JobStore, tmp_path: Path) -> None:
    with webhook_receiver(tmp_path, tls=False) as private, \
            webhook_receiver(tmp_path, redirect_to=private.url("/admin")) as rec:
        await enqueue(store, rec.url())
        outcomes = Outcomes()
        # The policy would even allow the redirect's target: what stops it is that redirects are not followed.
        patterns = ["127.0.0.1", f"http://127.0.0.1:{private.port}"]
        async with running(deliverer(store, patterns, outcomes, rec.ca_file, backoff=30)):
            assert await outcomes.until(lambda seen: len(seen) >= 1) == ["retry"]
        assert len(rec.requests) == 1
        assert private.connections == 0 and private.requests == []
    assert (await store.delivery_counts())["pending"] == 1  # tried again later, to the URL the job named


async def test_refused_urls_are_failed_at_once_and_never_dialled(store: JobStore, receiver: WebhookReceiver) -> None:
    # Written to the outbox under a policy that allowed them (or none at all, as here): each try checks again.
    for url in (receiver.url(host="localhost"),  # localhost resolves to loopback: a hostname pattern admits public
                receiver.url(),  # a literal 127.0.0.1 no address pattern names
                "https://169.254.169.254/latest/meta-data/", "file:///etc/passwd",
                "https://localhost@127.0.0.1:1/"):
        await enqueue(store, url)
    outcomes = Outcomes()
    async with running(deliverer(store, ["localhost", "*.example.com"], outcomes, receiver.ca_file)):
        assert await outcomes.until(lambda seen: len(seen) >= 5) == ["refused"] * 5
    assert receiver.connections == 0
    assert await store.delivery_counts() == {"pending": 0, "delivered": 0, "failed": 5}


async def test_given_up_after_give_up_at(store: JobStore, tmp_path: Path) -> None:
    with webhook_receiver(tmp_path, fail_first=1_000) as rec:
        await enqueue(store, rec.url(), retry_for=0.5)
        outcomes = Outcomes()
        async with running(deliverer(store, ["127.0.0.1"], outcomes, rec.ca_file)):
            seen = await outcomes.until(lambda seen: "failed" in seen)
    assert seen[-1] == "failed" and set(seen[:-1]) <= {"retry"} and len(seen) >= 2
    assert len(rec.requests) == len(seen)  # the last try, at give_up_at, was made before giving up
    assert await store.delivery_counts() == {"pending": 0, "delivered": 0, "failed": 1}


async def test_a_dead_senders_delivery_is_taken_over(store: JobStore, receiver: WebhookReceiver) -> None:
    then = time.time() - 200  # the job ended 200 s ago
    sent = await enqueue(store, receiver.url(), now=then)
    # A sender took it 100 s ago under a 30 s lease and died mid-try: nothing released the row.
    dead = await store.claim_delivery("dead-sender", then + 100, 30)
    assert dead is not None and dead.id == sent.id
    assert await store.claim_delivery("too-early", then + 110, 30) is None  # the lease holds while it lasts
    outcomes = Outcomes()
    async with running(deliverer(store, ["127.0.0.1"], outcomes, receiver.ca_file)):
        assert await outcomes.until(lambda seen: len(seen) >= 1) == ["delivered"]
    (req,) = receiver.requests
    assert req.headers["webhook-id"] == sent.id
    Webhook(SECRETS["alpha"]).verify(req.body, req.headers)


async def test_the_connection_goes_to_the_checked_address(store: JobStore, receiver: WebhookReceiver) -> None:
    # localhost is allowed by name, and its loopback address by an address pattern: the sender resolves it once,
    # checks the answer, and dials that address, while TLS and Host keep the name.
    sent = await enqueue(store, receiver.url(host="localhost"))
    outcomes = Outcomes()
    async with running(deliverer(store, [f"https://localhost:{receiver.port}", "127.0.0.1"], outcomes,
                                 receiver.ca_file)):
        assert await outcomes.until(lambda seen: len(seen) >= 1) == ["delivered"]
    (req,) = receiver.requests
    assert req.local_address == "127.0.0.1"
    assert req.server_name == "localhost" and req.headers["host"] == f"localhost:{receiver.port}"
    assert req.headers["webhook-id"] == sent.id


async def test_an_unverified_certificate_gets_no_body(store: JobStore, receiver: WebhookReceiver) -> None:
    await enqueue(store, receiver.url())
    outcomes = Outcomes()
    async with running(deliverer(store, ["127.0.0.1"], outcomes, None, backoff=30)):  # the system CAs only
        assert await outcomes.until(lambda seen: len(seen) >= 1) == ["retry"]
    assert receiver.connections == 1 and receiver.requests == []


class ClaimsSeen:
    """The store, telling when a sender found the outbox empty."""

    def __init__(self, store: JobStore) -> None:
        self._store = store
        self.empty = asyncio.Event()

    def __getattr__(self, name: str) -> object:
        return getattr(self._store, name)

    async def claim_delivery(self, owner: str, now: float, lease_s: float) -> Delivery | None:
        d = await self._store.claim_delivery(owner, now, lease_s)
        if d is None:
            self.empty.set()
        return d


async def test_wake_sends_without_waiting_for_the_poll(store: JobStore, receiver: WebhookReceiver) -> None:
    outcomes = Outcomes()
    seen = ClaimsSeen(store)
    async with running(deliverer(seen, ["127.0.0.1"], outcomes, receiver.ca_file, poll_s=600)) as d:  # type: ignore[arg-type]
        await seen.empty.wait()  # it looked, found nothing, and waits for its next poll 10 minutes away
        await enqueue(store, receiver.url())
        d.wake()
        assert await outcomes.until(lambda seen: len(seen) >= 1, timeout=20) == ["delivered"]


async def test_many_deliveries_to_several_receivers(store: JobStore, tmp_path: Path) -> None:
    with webhook_receiver(tmp_path) as a, webhook_receiver(tmp_path, fail_first=3) as b:
        sent = [await enqueue(store, rec.url(f"/{i}"), tenant=("alpha", "beta")[i % 2])
                for i, rec in enumerate([a, b] * 6)]
        bundle = tmp_path / "both-cas.pem"  # --webhook-ca is a bundle: both receivers' CAs
        bundle.write_bytes(a.ca_file.read_bytes() + b.ca_file.read_bytes())
        outcomes = Outcomes()
        async with running(deliverer(store, ["127.0.0.1"], outcomes, bundle, concurrency=3)):
            await outcomes.until(lambda seen: seen.count("delivered") == 12)
        got = {r.headers["webhook-id"]: r for r in a.requests + b.requests}
        assert set(got) == {s.id for s in sent}
        for s in sent:
            Webhook(SECRETS[s.tenant]).verify(got[s.id].body, got[s.id].headers)
    assert await store.delivery_counts() == {"pending": 0, "delivered": 12, "failed": 0}
