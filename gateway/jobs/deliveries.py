"""The webhook sender: takes deliveries from the store's outbox under a lease, POSTs each, records how it went.

At least once: the outbox row is written with the job's end, and a row is marked delivered only after a 2xx, so a
sender that dies mid-try leaves the row leased and another (or the restarted one) takes it once the lease runs out.
Receivers deduplicate on ``webhook-id``, which is the same over every try.

Each try re-checks the URL and resolves its host once (gateway/jobs/egress.py), then connects to that checked address
alone: the connector's resolver knows no other answer, while TLS's SNI and certificate check and the Host header
keep the real hostname. Redirects are never followed (a 3xx is a failed try and its Location is never dialled).
"""
from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import random
import socket
import ssl
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import aiohttp
import yarl
from aiohttp.abc import AbstractResolver, ResolveResult

from gateway.jobs.egress import EgressPolicy, EgressRefused, EgressUnresolved, IPAddress
from gateway.jobs.model import Delivery
from gateway.jobs.webhooks import sign_headers

if TYPE_CHECKING:
    from gateway.jobs.store import JobStore

log = logging.getLogger("gateway.webhooks")

USER_AGENT = "glmimage-webhooks/1"
DELIVERED, RETRY, FAILED, REFUSED = "delivered", "retry", "failed", "refused"


class DeliveryMetrics(Protocol):
    def delivery(self, outcome: str) -> None:
        """One try ended: "delivered", "retry" (it is tried again), "failed" (given up) or "refused" (the egress
        policy will not call the URL: failed at once)."""


@dataclass(frozen=True)
class _Tried:
    outcome: str  # DELIVERED, RETRY or REFUSED (RETRY past give_up_at is recorded FAILED)
    detail: str  # for the store's error column and the log: never headers or the secret


class _PinnedResolver(AbstractResolver):
    """The one answer a try may use: the address the egress policy checked for this host."""

    def __init__(self, host: str, addr: IPAddress) -> None:
        self._host = host.rstrip(".")
        self._addr = addr

    async def resolve(self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET,
                      ) -> list[ResolveResult]:
        if host.rstrip(".").lower() != self._host:
            raise OSError(f"{host} is not the host whose address was checked")
        fam = socket.AF_INET if isinstance(self._addr, ipaddress.IPv4Address) else socket.AF_INET6
        return [{"hostname": host, "host": str(self._addr), "port": port, "family": fam, "proto": 0,
                 "flags": socket.AI_NUMERICHOST | socket.AI_NUMERICSERV}]

    async def close(self) -> None:
        pass


def _default_owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class Deliverer:
    """Sends the outbox. ``secrets(tenant)`` gives the tenant's ``whsec_`` secret; ``ca_file`` adds a CA bundle to
    the system's for receivers (``--webhook-ca``); ``clock`` gives the store's times (unix seconds)."""

    def __init__(self, store: JobStore, policy: EgressPolicy, secrets: Callable[[str], str],
                 metrics: DeliveryMetrics | None = None, *, timeout: float = 10.0, backoff: float = 5.0,
                 max_backoff: float = 300.0, lease_s: float | None = None,
                 ca_file: str | os.PathLike[str] | None = None, concurrency: int = 4, poll_s: float = 0.5,
                 owner: str | None = None, clock: Callable[[], float] = time.time,
                 rng: random.Random | None = None) -> None:
        # A try is one resolution and one request, each bounded by timeout: the lease outlasts both with room, so
        # a live sender never sees its row taken over.
        lease_s = 2 * timeout + 10 if lease_s is None else lease_s
        if lease_s <= 2 * timeout:
            raise ValueError(f"a delivery's lease ({lease_s:g}s) must outlast a try (2 x timeout = {2 * timeout:g}s)")
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self.store = store
        self.policy = policy
        self.secrets = secrets
        self.metrics = metrics
        self.timeout = timeout
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.lease_s = lease_s
        self.concurrency = concurrency
        self.poll_s = poll_s
        self.owner = owner or _default_owner()
        self.clock = clock
        self._rng = rng or random.Random()
        self._ssl = ssl.create_default_context()
        if ca_file is not None:
            self._ssl.load_verify_locations(cafile=os.fspath(ca_file))
        self._wake = asyncio.Event()

    def wake(self) -> None:
        """Look for deliveries now (a job just ended) rather than at the next poll."""
        self._wake.set()

    def delay(self, attempts: int) -> float:
        """The wait after the ``attempts``-th failed try: doubling from ``backoff`` up to ``max_backoff``, with equal
        jitter (half fixed, half random) so the retries of many deliveries to one receiver spread out."""
        base = min(self.backoff * 2.0 ** min(max(attempts - 1, 0), 62), self.max_backoff)
        return base * (0.5 + 0.5 * self._rng.random())

    async def run(self, stop: asyncio.Event) -> None:
        """Deliver until ``stop`` is set; then let the tries in flight end (each is bounded by the timeouts)."""
        tasks: set[asyncio.Task[None]] = set()
        stopping = asyncio.create_task(stop.wait())
        store_down = False
        try:
            while not stop.is_set():
                self._wake.clear()  # before claiming: a wake() during the claims is kept for the next round
                while len(tasks) < self.concurrency and not stop.is_set():
                    try:
                        d = await self.store.claim_delivery(self.owner, self.clock(), self.lease_s)
                    except Exception as e:  # the store is down or busy: the rows wait there, try again later
                        if not store_down:
                            log.warning("webhooks: could not take deliveries from the job store: %s", e)
                        store_down = True
                        break
                    if store_down:
                        log.info("webhooks: the job store answers again")
                        store_down = False
                    if d is None:
                        break
                    task = asyncio.create_task(self._deliver(d), name=f"webhook {d.id}")
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                waking = asyncio.create_task(self._wake.wait())
                await asyncio.wait({stopping, waking, *tasks}, timeout=self.poll_s,
                                   return_when=asyncio.FIRST_COMPLETED)
                waking.cancel()
        finally:
            stopping.cancel()
            if tasks:
                _, late = await asyncio.wait(set(tasks), timeout=2 * self.timeout + 5)
                for task in late:  # a store write that hangs: the row's lease runs out and it is tried again
                    task.cancel()

    async def _deliver(self, d: Delivery) -> None:
        try:
            tried = await self._try(d)
        except Exception as e:  # a secret that cannot be had, or a bug: tried again later, never lost
            log.exception("webhook %s of job %s: the try broke", d.id, d.job_id)
            tried = _Tried(RETRY, f"{type(e).__name__}: {e}")
        now = self.clock()
        outcome = tried.outcome
        try:
            if outcome == DELIVERED:
                await self.store.delivery_done(d, now)
            elif outcome == REFUSED:
                await self.store.delivery_failed(d, now, tried.detail)
            elif now >= d.give_up_at:
                outcome = FAILED
                await self.store.delivery_failed(d, now, tried.detail)
            else:
                # The last try is at give_up_at itself rather than a backoff step short of it.
                next_at = min(now + self.delay(d.attempts), d.give_up_at)
                await self.store.delivery_retry(d, next_at, tried.detail)
        except Exception:
            log.exception("webhook %s of job %s: could not record its try (%s); it is tried again after its lease",
                          d.id, d.job_id, outcome)
            return
        if self.metrics is not None:
            self.metrics.delivery(outcome)
        level = logging.INFO if outcome == DELIVERED else logging.WARNING
        log.log(level, "webhook %s of job %s (tenant %s), try %d: %s%s", d.id, d.job_id, d.tenant, d.attempts,
                outcome, "" if outcome == DELIVERED else f" ({tried.detail})")

    async def _try(self, d: Delivery) -> _Tried:
        try:
            target = self.policy.check_url(d.url)
            addr = await self.policy.resolve(target, timeout=self.timeout)
        except EgressRefused as e:
            return _Tried(REFUSED, e.message)
        except EgressUnresolved as e:
            return _Tried(RETRY, str(e))
        # The signature's timestamp is the wall clock's: receivers check it against theirs.
        headers = sign_headers(self.secrets(d.tenant), d.id, time.time(), d.payload)
        headers["user-agent"] = USER_AGENT
        # The URL rebuilt from the checked parts: aiohttp dials exactly the host the policy saw.
        url = yarl.URL.build(scheme=target.scheme, host=target.netloc_host, port=target.port, path=target.path,
                             query_string=target.query, encoded=True)
        connector = aiohttp.TCPConnector(resolver=_PinnedResolver(target.host, addr), use_dns_cache=False,
                                         force_close=True, ssl=self._ssl)
        async with aiohttp.ClientSession(connector=connector, cookie_jar=aiohttp.DummyCookieJar(), trust_env=False,
                                         timeout=aiohttp.ClientTimeout(total=self.timeout)) as session:
            try:
                async with session.post(url, data=d.payload, headers=headers, allow_redirects=False) as resp:
                    status = resp.status
            except TimeoutError:
                return _Tried(RETRY, f"{target.host} ({addr}) did not answer within {self.timeout:g}s")
            except aiohttp.ClientError as e:
                return _Tried(RETRY, f"{target.host} ({addr}): {type(e).__name__}: {e}")
        if 200 <= status < 300:
            return _Tried(DELIVERED, f"{status}")
        if 300 <= status < 400:
            return _Tried(RETRY, f"{target.host} ({addr}) answered {status}: redirects are not followed")
        return _Tried(RETRY, f"{target.host} ({addr}) answered {status}")
