"""The store's upkeep, run by every gateway (each step is idempotent, so several gateways on one store may run it
at once): jobs no runner can finish are ended (past their deadline, or whose runners died too often), expired jobs
and images are deleted, orphaned images (a run whose result was never recorded) are swept, and the store-wide
figures are published as metrics."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from gateway.jobs.images import ImageStore, ImageStoreUnavailable
from gateway.jobs.metrics import JobMetrics
from gateway.jobs.model import JobRecord
from gateway.jobs.outcomes import Finisher
from gateway.jobs.store import JobStore, StoreUnavailable
from runtime.errors import ErrorKind

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HousekeepingConfig:
    every_s: float = 5.0
    expire_every_s: float = 60.0
    sweep_every_s: float = 600.0
    max_attempts: int = 10
    job_ttl: float = 86400.0
    batch: int = 500


class Housekeeping:
    def __init__(self, store: JobStore, images: ImageStore, finisher: Finisher, config: HousekeepingConfig,
                 metrics: JobMetrics | None = None, on_ended: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.images = images
        self.finisher = finisher
        self.config = config
        self.metrics = metrics
        self.on_ended = on_ended
        self.clock = clock
        self._last_expire = 0.0
        self._last_sweep = 0.0

    def _outcome(self, job: JobRecord, code: str, message: str):
        return self.finisher.failed(job, code, message, self.clock())

    async def once(self) -> None:
        cfg = self.config
        now = self.clock()
        ended = await self.store.reap(now, cfg.max_attempts, self._outcome)
        for job in ended:
            log.warning("job %s ended without a runner: %s: %s", job.id, job.error_code or ErrorKind.INTERNAL.name,
                        job.error_message)
            if self.metrics is not None:
                self.metrics.finished.labels(job.status).inc()
        if ended and self.on_ended is not None:
            self.on_ended()
        if now - self._last_expire >= cfg.expire_every_s:
            self._last_expire = now
            await self.expire(now)
        if now - self._last_sweep >= cfg.sweep_every_s:
            self._last_sweep = now
            # Orphans are images no job recorded; any recorded one is younger than the TTL or already deleted.
            await self.images.sweep(now - cfg.job_ttl)
        if self.metrics is not None:
            oldest = await self.store.oldest_queued()
            deliveries = await self.store.delivery_counts()
            self.metrics.publish(await self.store.counts(), 0.0 if oldest is None else now - oldest,
                                 await self.store.leases(now), deliveries.get("pending", 0))

    async def expire(self, now: float) -> int:
        """Delete what has expired, images first: a job row outliving its images would hand out dead links."""
        deleted = 0
        while True:
            job_ids, keys = await self.store.expired(now, self.config.batch)
            if not job_ids and not keys:
                return deleted
            await self.images.delete(keys)
            await self.store.delete(job_ids, keys)
            deleted += len(job_ids)
            if len(job_ids) < self.config.batch and len(keys) < self.config.batch:
                if deleted:
                    log.info("expired %d job(s) and their images", deleted)
                return deleted

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.once()
            except (StoreUnavailable, ImageStoreUnavailable) as exc:
                log.warning("job housekeeping skipped: %s", exc)
            except Exception:
                log.exception("job housekeeping failed")
            try:  # (asyncio.timeout: wait_for may swallow a cancel that comes as stop is set)
                async with asyncio.timeout(self.config.every_s):
                    await stop.wait()
            except TimeoutError:
                pass
