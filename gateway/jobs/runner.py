"""The job runner: takes jobs from the store under a lease, runs each on this gateway's scheduler, records its end.

A lease is renewed every third of its length while the job runs, with the job's progress; a runner that dies
(SIGKILL, a lost node) stops renewing, and once the lease runs out another runner (or this one restarted) takes the
job again. Every write names the lease (owner and attempt), so a runner that stalled past its lease and wakes up
records nothing: a job's end is recorded once. A runner that stops cleanly gives its jobs back at once.

Failures that heal (no ready worker, a full queue, the tenant's in-flight bound) give the job back to be tried
again after a backoff, up to its deadline; any other is the job's end, as the synchronous call would have answered.
"""
from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from gateway.jobs.execute import Failure, JobExecutor
from gateway.jobs.images import ImageStoreUnavailable
from gateway.jobs.keeper import ImageKeeper
from gateway.jobs.metrics import JobMetrics
from gateway.jobs.model import COMPLETED, Lease, Outcome
from gateway.jobs.outcomes import Finisher
from gateway.jobs.store import JobStore, StoreUnavailable
from glmimage.v1 import gateway_service_pb2
from runtime.errors import ErrorKind
from runtime.logs import request_id_var

log = logging.getLogger(__name__)


def runner_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True)
class RunnerConfig:
    concurrency: int = 16  # jobs this runner holds at once (its scheduler shares the pool among them)
    lease_s: float = 30.0
    max_attempts: int = 10  # takes of one job (runners died under it) before it fails ABORTED
    poll_s: float = 0.5  # how often an idle runner looks for jobs another gateway accepted
    backoff_s: float = 1.0  # first wait after a failure that heals; doubled each time, at most max_backoff_s
    max_backoff_s: float = 30.0
    progress_every_s: float = 1.0  # at most one progress write per job this often
    renew_every_s: float = 2.0  # and at least one renewal this often (it reads back a cancel asked for elsewhere)

    def __post_init__(self) -> None:
        if self.concurrency < 0 or self.max_attempts < 1 or not self.lease_s > 0 or not self.poll_s > 0:
            raise ValueError("job runner: concurrency >= 0, max attempts >= 1, lease and poll > 0")


class _Lost(Exception):
    """The lease is no longer this runner's (another took the job over, or it ended)."""


class _Cancel(Exception):
    """The job's owner asked for it to be cancelled."""


class Runner:
    def __init__(self, store: JobStore, executor: JobExecutor, keeper: ImageKeeper, finisher: Finisher,
                 config: RunnerConfig, metrics: JobMetrics | None = None, owner: str | None = None,
                 on_finished: Callable[[], None] | None = None, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.executor = executor
        self.keeper = keeper
        self.finisher = finisher
        self.config = config
        self.metrics = metrics
        self.owner = owner or runner_id()
        self.on_finished = on_finished  # e.g. wake the webhook deliverer
        self.clock = clock
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._cancel_now: set[str] = set()
        self._wake = asyncio.Event()
        self._draining = False

    # ---- what the service tells it -----------------------------------------------------------------------------

    def wake(self) -> None:
        """A job was just accepted here: look now rather than at the next poll."""
        self._wake.set()

    def cancel(self, job_id: str) -> None:
        """The job was asked to stop (the store says so too, for whichever runner holds it): if it runs here, stop
        it now rather than at its next renewal."""
        task = self._tasks.get(job_id)
        if task is not None:
            self._cancel_now.add(job_id)
            task.cancel()

    @property
    def held(self) -> int:
        return len(self._tasks)

    def drain(self) -> None:
        """The gateway is stopping: take no more jobs; those held run on (``finish_within``)."""
        self._draining = True
        self._wake.set()

    async def finish_within(self, seconds: float) -> bool:
        """Wait (at most ``seconds``) for the jobs held to end; True if they all did. What is left is given back
        when the loop stops."""
        tasks = list(self._tasks.values())
        if not tasks or seconds <= 0:
            return not tasks
        _, pending = await asyncio.wait(tasks, timeout=seconds)
        return not pending

    # ---- the loop ----------------------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        cfg = self.config
        failures = 0
        try:
            while not stop.is_set():
                lease = None
                if (cfg.concurrency and not self._draining and len(self._tasks) < cfg.concurrency
                        and self.executor.ready()):
                    try:
                        lease = await self.store.claim(self.owner, self.clock(), cfg.lease_s, cfg.max_attempts)
                        failures = 0
                    except StoreUnavailable as exc:
                        failures += 1
                        log.warning("job store unavailable, no job taken: %s", exc)
                        await self._idle(stop, min(cfg.max_backoff_s, cfg.poll_s * 2 ** min(failures, 6)))
                        continue
                if lease is None:
                    await self._idle(stop, cfg.poll_s)
                    continue
                if lease.attempt - 1 > lease.job.released and self.metrics is not None:
                    self.metrics.takeovers.inc()  # an earlier take ended with its runner's death
                self._start(lease)
        finally:
            await self._give_back_all()

    async def _idle(self, stop: asyncio.Event, seconds: float) -> None:
        self._wake.clear()
        waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self._wake.wait())]
        try:
            await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    def _start(self, lease: Lease) -> None:
        job = lease.job
        task = asyncio.create_task(self._work(lease), name=f"job:{job.id}")
        self._tasks[job.id] = task
        self._publish()

        def done(t: asyncio.Task[None]) -> None:
            self._tasks.pop(job.id, None)
            self._cancel_now.discard(job.id)
            self._publish()
            self._wake.set()  # a slot is free
            if not t.cancelled() and t.exception() is not None:
                log.error("job %s: runner task failed", job.id, exc_info=t.exception())

        task.add_done_callback(done)

    def _publish(self) -> None:
        if self.metrics is not None:
            self.metrics.leases.labels("runner").set(len(self._tasks))

    async def _give_back_all(self) -> None:
        """Stopping: every job held goes back to the queue now (each task releases its own lease as it ends)."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    # ---- one job -----------------------------------------------------------------------------------------------

    async def _work(self, lease: Lease) -> None:
        job = lease.job
        request_id_var.set(job.request_id or job.id)
        log.info("job %s: taken (attempt %d, tenant %s)", job.id, lease.attempt, job.tenant)
        now = self.clock()
        if job.cancel_requested:
            await self._end(lease, self.finisher.cancelled(job, now))
            return
        if job.deadline <= now:
            await self._end(lease, self.finisher.failed(job, ErrorKind.DEADLINE_EXCEEDED.name,
                                                        "the job was not done by its deadline", now))
            return
        request = gateway_service_pb2.GenerateImagesRequest.FromString(job.request)
        progress = [0, 0]
        changed = asyncio.Event()

        def on_progress(step: int, total: int) -> None:
            progress[:] = [step, total]
            changed.set()

        run = asyncio.create_task(self.executor.run(request, job.tenant, job.deadline - now, on_progress))
        keep = asyncio.create_task(self._keep_lease(lease, progress, changed))
        try:
            done, _ = await asyncio.wait({run, keep}, return_when=asyncio.FIRST_COMPLETED)
            if keep in done:  # the lease was lost, or a cancel was asked for: the run stops as a disconnect does
                run.cancel()
                await asyncio.gather(run, return_exceptions=True)
                if isinstance(keep.exception(), _Cancel):
                    await self._end(lease, self.finisher.cancelled(job, self.clock(), (progress[0], progress[1])))
                return
            keep.cancel()
            await asyncio.gather(keep, return_exceptions=True)
            await self._settle(lease, run.result(), progress)
        except asyncio.CancelledError:
            run.cancel()
            keep.cancel()
            await asyncio.gather(run, keep, return_exceptions=True)
            if job.id in self._cancel_now:  # CancelJob on this gateway
                await asyncio.shield(self._end(lease, self.finisher.cancelled(job, self.clock(),
                                                                              (progress[0], progress[1]))))
                return
            # Shutting down: the job goes back to the queue for the next runner, now.
            await asyncio.shield(self._release(lease, self.clock()))
            raise

    async def _keep_lease(self, lease: Lease, progress: list[int], changed: asyncio.Event) -> None:
        """Renew the lease while the job runs, with its progress (at most one write per progress_every_s), and at
        least every renew_every_s so that a cancel asked for on another gateway is seen soon; raise _Lost or
        _Cancel to stop the job."""
        cfg = self.config
        every = min(cfg.lease_s / 3, cfg.renew_every_s)
        last = last_ok = self.clock()
        written = (0, 0)
        while True:
            now = self.clock()
            pending = (progress[0], progress[1]) != written
            due = last + (min(every, cfg.progress_every_s) if pending else every)
            if now < due:
                if pending:
                    await asyncio.sleep(due - now)
                else:
                    changed.clear()
                    # asyncio.timeout, not wait_for: on 3.11 wait_for swallows a cancel that comes as the event is
                    # set (the run's last progress, then its end, in one turn of the loop), and this loop would
                    # never stop.
                    try:
                        async with asyncio.timeout(due - now):
                            await changed.wait()
                    except TimeoutError:
                        pass
                continue
            step, total = progress
            last = now
            try:
                ours, cancel = await self.store.renew(lease, now, cfg.lease_s, step, total)
            except StoreUnavailable as exc:
                # The lease may still be ours: keep going until it would have run out, then stop (another
                # runner may have taken the job by then).
                if now - last_ok > cfg.lease_s:
                    log.warning("job %s: job store unavailable past the lease; stopping: %s", lease.job.id, exc)
                    raise _Lost() from None
                continue
            last_ok = now
            written = (step, total)
            if not ours:
                log.warning("job %s: lease lost (another runner took the job over); stopping it here", lease.job.id)
                if self.metrics is not None:
                    self.metrics.lease_lost.inc()
                raise _Lost()
            if cancel:
                log.info("job %s: cancel asked for; stopping it", lease.job.id)
                raise _Cancel()

    async def _settle(self, lease: Lease, result: gateway_service_pb2.GenerateImagesResponse | Failure,
                      progress: list[int]) -> None:
        job = lease.job
        now = self.clock()
        if isinstance(result, Failure):
            if result.transient and now < job.deadline:
                backoff = self._backoff(lease, result)
                log.info("job %s: %s (%s); given back, tried again in %.1fs", job.id, result.code, result.message,
                         backoff)
                await self._release(lease, now + backoff)
                return
            log.info("job %s: failed: %s: %s", job.id, result.code, result.message)
            await self._end(lease, self.finisher.failed(job, result.code, result.message, now, result.field))
            return
        try:
            stored, objects = await self.keeper.keep(job.tenant, result, now, job.id)
        except ImageStoreUnavailable as exc:
            log.warning("job %s: image store unavailable; given back: %s", job.id, exc)
            await self._release(lease, now + self._backoff(lease, None))
            return
        outcome = self.finisher.outcome(job, COMPLETED, self.clock(), result=stored.SerializeToString(),
                                        objects=objects, progress=(progress[1], progress[1]))
        await self._end(lease, outcome)

    def _backoff(self, lease: Lease, failure: Failure | None) -> float:
        cfg = self.config
        base = min(cfg.max_backoff_s, cfg.backoff_s * 2 ** max(0, lease.attempt - 1))
        hint = failure.retry_after if failure is not None and failure.retry_after else 0.0
        return max(hint, base * random.uniform(0.5, 1.0))

    async def _end(self, lease: Lease, outcome: Outcome) -> None:
        """Record the job's end, under its lease; a store that does not answer is tried again while the lease may
        still be ours."""
        give_up = self.clock() + self.config.lease_s
        delay = 0.2
        while True:
            try:
                recorded = await self.store.finish(lease, outcome)
                break
            except StoreUnavailable as exc:
                if self.clock() > give_up:
                    log.error("job %s: its end could not be recorded (job store unavailable): %s; another runner "
                              "will run it again", lease.job.id, exc)
                    return
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
        if not recorded:
            log.warning("job %s: not recorded: the lease was lost meanwhile", lease.job.id)
            return
        log.info("job %s: %s", lease.job.id, outcome.status)
        if self.metrics is not None:
            self.metrics.finished.labels(outcome.status).inc()
        if outcome.webhook is not None and self.on_finished is not None:
            self.on_finished()

    async def _release(self, lease: Lease, available_at: float) -> None:
        try:
            await self.store.release(lease, available_at)
        except StoreUnavailable as exc:  # its lease runs out instead
            log.warning("job %s: could not be given back (job store unavailable): %s", lease.job.id, exc)
