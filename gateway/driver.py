"""The imperative shell around the pure scheduler: feeds it events, performs its actions, keeps the timers
and the tasks, and feeds back how each ended.

Every decision lives in gateway.scheduler; the calls to workers (requests, streaming, reading failures back) in
gateway.downstream; each member and its health in gateway.workers, the pool of them and what it can run in
gateway.members; metric observations in gateway.observe. All scheduler calls happen on the event loop thread, so the
state machine needs no locks.

Streaming is not the scheduler's concern: a streamed request's denoise jobs run as ``DenoiseStream`` and relay
progress and previews to the caller, while the scheduler sees the same DispatchDenoise and DenoiseSucceeded.
"""
from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from gateway.config import GatewayConfig
from gateway.downstream import Downstream, StreamOptions
from gateway.members import Members
from gateway.membership import DnsMembership
from gateway.metrics import GatewayMetrics
from gateway.observe import Observer, Timing
from gateway.scheduler import types as sch
from gateway.scheduler.core import Scheduler
from gateway.traces import RequestTrace, ar_call, traced
from gateway.workers import Worker, WorkerHealth
from glmimage.v1 import ar_service_pb2, denoiser_service_pb2
from runtime.admission import Admitted
from runtime.capability import Capabilities, Needs, fits
from runtime.errors import ErrorKind
from runtime.limits import round_up
from runtime.logs import spawn, without_request_id

log = logging.getLogger(__name__)

@dataclass
class Outcome:
    """A finished request: the denoiser responses and the AR outputs, both in output order."""

    images: Sequence[denoiser_service_pb2.DenoiseResponse]
    priors: Sequence[ar_service_pb2.PriorOutput]


@dataclass
class _Pending:
    admitted: Admitted
    future: asyncio.Future[Outcome | sch.RequestError]
    stream: StreamOptions | None
    timing: Timing
    trace: RequestTrace
    first_dispatch: bool = False  # a denoise job of it was dispatched (the tenant's queue wait is observed then)


class Driver:
    def __init__(self, config: GatewayConfig, scheduler: Scheduler | None = None,
                 metrics: GatewayMetrics | None = None) -> None:
        self.config = config
        # Seeded with the gateway's own id: gateways sharing denoisers each take free ones in an order of their own.
        # ``fits``: each denoise job goes only to a denoiser that can run it (runtime.capability).
        self.scheduler = scheduler or Scheduler(config.scheduler, pick_seed=config.instance_id, fits=fits)
        self.observe = Observer(metrics)
        self._pending: dict[str, _Pending] = {}
        self.members = Members(config.own_limits)
        self._ar_calls: dict[int, asyncio.Task] = {}
        self._ar_on: dict[int, str] = {}  # the worker each AR batch call went to
        self._abandoned_batches: set[int] = set()  # cancelled because nobody waits: report their end
        self._denoise_calls: dict[sch.JobId, asyncio.Task] = {}
        self._denoise_on: dict[sch.JobId, str] = {}  # the worker each denoise call went to
        self._background: set[asyncio.Task] = set()
        self._timer: asyncio.TimerHandle | None = None
        self._publish_due = False  # a publish of the metrics' state is scheduled for the loop's next turn
        self._closed = False
        self._duplicates = itertools.count(1)
        self.dns: list[DnsMembership] = []
        self.downstream = Downstream(config, self.observe, self._sideline)
        self._told_caps: dict[str, Capabilities] = {}  # what the scheduler was last told each worker can run

    # ---- lifecycle -------------------------------------------------------------------------------------------

    async def start(self) -> None:
        for addresses, role in ((self.config.ar_addresses, sch.WorkerRole.AR),
                                (self.config.denoiser_addresses, sch.WorkerRole.DENOISER)):
            for address in addresses:
                self.add_worker(address, role)
        for targets, role in ((self.config.ar_dns, sch.WorkerRole.AR),
                              (self.config.denoiser_dns, sch.WorkerRole.DENOISER)):
            for target in targets:
                dns = DnsMembership.from_target(target, role, self.add_worker, self.remove_worker,
                                                interval=self.config.dns_interval)
                self.dns.append(dns)
                self._spawn(dns.run(), f"dns:{target}")

    async def close(self) -> None:
        self._closed = True
        if self._timer:
            self._timer.cancel()
        tasks = [*self._ar_calls.values(), *self._denoise_calls.values(), *self._background,
                 *(t for w in self.members.all() for t in w.tasks())]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(w.channel.close() for w in self.members.all()), return_exceptions=True)

    def _spawn(self, coro, name: str) -> asyncio.Task:
        task = spawn(coro, name=name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    # ---- membership (what the members are and can run: gateway.members) ----------------------------------------

    def add_worker(self, address: str, role: sch.WorkerRole) -> bool:
        """Add a worker; it gets work once its health watch sees SERVING. False if it already was a member."""
        worker = self.members.get(address)
        if worker is not None:
            if self.members.draining(address) and worker.role is role:
                self.members.undrain(address)  # re-added while draining: the scheduler keeps it
                self._feed(sch.WorkerAdded(now=time.monotonic(), worker=address, role=role))
                return True
            return False
        if len(self.members) >= self.config.max_workers:
            log.warning("%s worker %s not added: the pool already has %d workers (--max-workers)",
                        role.value.lower(), address, len(self.members))
            return False
        worker = Worker(address, role, self.config)
        self.members.add(worker)
        log.info("%s worker %s added", role.value.lower(), address)
        self._feed(sch.WorkerAdded(now=time.monotonic(), worker=address, role=role))
        worker.watch(self._from_watch, lambda: self._closed, functools.partial(self._capabilities_changed, worker))
        return True

    def _capabilities_changed(self, worker: Worker) -> None:
        """Its limits or its adapter directory changed: the union is recomputed, and the scheduler told what it can
        run (before it is first healthy: its limits are read before its health is)."""
        self.members.changed()
        if self.members.get(worker.address) is not worker or worker.limits is None:
            return
        caps = worker.capabilities()
        if self._told_caps.get(worker.address) != caps:
            self._told_caps[worker.address] = caps
            self._feed(sch.WorkerCapabilities(now=time.monotonic(), worker=worker.address, capabilities=caps))

    def remove_worker(self, address: str) -> bool:
        """Drain and remove a worker: its current job finishes, no new job is sent. False if unknown."""
        if self.members.get(address) is None:
            return False
        if not self.members.draining(address):
            self.members.drain(address)
            log.info("worker %s removed; draining", address)
            self._feed(sch.WorkerRemoved(now=time.monotonic(), worker=address))
        return True

    def _reap(self) -> None:
        """Close what the scheduler has let go of (a removed worker that has drained)."""
        for address in [a for a in self.members.drained() if not self.scheduler.has_worker(a)]:
            worker = self.members.pop(address)
            self._told_caps.pop(address, None)
            for task in worker.tasks():
                task.cancel()
            self._spawn(worker.channel.close(), f"close:{address}")
            log.info("worker %s drained and gone", address)

    # ---- requests --------------------------------------------------------------------------------------------

    async def generate(self, request_id: str, admitted: Admitted, timeout: float,
                       stream: StreamOptions | None = None, expired: Callable[[], bool] | None = None,
                       tenant: str = "default", weight: float = 1.0, priority: int = sch.DEFAULT
                       ) -> Outcome | sch.RequestError:
        """Run an admitted request and wait for its outcome, or the scheduler's error as it made it. Cancelling the
        awaiting task cancels the request downstream; when ``expired()`` says the cancel came from the caller's
        deadline, the request ends as a deadline. ``tenant`` (its weight then) and ``priority``: its place in the
        scheduler's fair share (GetStatus shows a caller the requests of its own tenant only)."""
        needs = Needs.of(admitted, stream.partial_images if stream is not None else 0)
        if (why := self.members.capable(needs)) is not None:  # (the pool changed since admission, or a job's request)
            return sch.RequestError(ErrorKind.INVALID_ARGUMENT, why.message, why.field)
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        pending = _Pending(admitted=admitted, future=loop.create_future(), stream=stream, timing=Timing(arrived=now),
                           trace=RequestTrace(request_id))
        # The id comes from the client's x-request-id and may repeat; the scheduler needs it unique.
        original = request_id
        while request_id in self._pending:  # a loop: "abc.1" may itself be a client's id already in flight
            request_id = f"{original}.{next(self._duplicates)}"
        self._pending[request_id] = pending
        # Both stages round sizes up to multiples of 32, so requests that differ below that share AR batches.
        self._feed(sch.RequestArrived(now=now, request_id=request_id, n=admitted.n, height=round_up(admitted.height),
                                      width=round_up(admitted.width), deadline=now + timeout, solo=admitted.edit,
                                      loras=frozenset(ref.name for ref in admitted.request.loras), tenant=tenant,
                                      weight=weight, priority=priority, needs=needs))
        try:
            return await asyncio.shield(pending.future)
        except asyncio.CancelledError:
            if not pending.future.done():
                if expired is not None and expired():
                    cancel = sch.RequestCancelled(now=time.monotonic(), request_id=request_id,
                                                  message="deadline exceeded", kind=sch.ErrorKind.DEADLINE_EXCEEDED)
                else:
                    cancel = sch.RequestCancelled(now=time.monotonic(), request_id=request_id)
                self._feed(cancel)
            raise
        finally:
            self._pending.pop(request_id, None)
            pending.trace.close()

    async def first_checks(self, timeout: float) -> None:
        """Wait (at most ``timeout``) until every member's first health check has an answer: a gateway that says
        SERVING before it knows its workers would fail-fast its first requests with 503."""
        events = [w.checked.wait() for w in self.members.all()]
        if events:
            try:
                await asyncio.wait_for(asyncio.gather(*events), timeout)
            except TimeoutError:
                log.warning("some workers had not answered a first health check after %.1fs", timeout)

    def snapshot(self) -> sch.Snapshot:
        return self.scheduler.snapshot()

    def ready(self) -> bool:
        """Whether each stage has a worker that takes work (available or busy): what a job runner waits for."""
        counts = self.scheduler.gauges().workers
        usable = (sch.WorkerState.AVAILABLE, sch.WorkerState.BUSY)
        return all(any(counts.get((role, state), 0) for state in usable)
                   for role in (sch.WorkerRole.AR, sch.WorkerRole.DENOISER))

    def request_tenant(self, request_id: str) -> str | None:
        """The tenant of the request in flight under ``request_id`` (None: not in flight): the scheduler's own."""
        return self.scheduler.tenant_of(request_id)

    # ---- the loop: events in, actions out --------------------------------------------------------------------

    def _feed(self, event: sch.Event, quiet: bool = False) -> None:
        """One event in, its actions performed, the metrics' state published, the timer re-armed. ``quiet``: an
        event that usually changes nothing (a denoiser's occupancy moving between free and this gateway's own
        job, several per job on every gateway): unless it caused actions, none of the rest is needed."""
        if self._closed:
            return
        actions = self.scheduler.handle(event)
        if quiet and not actions:
            return
        for action in actions:
            self._perform(action)
        if self.members.any_draining():
            self._reap()
        self._publish_soon()
        self._arm_timer()

    def _publish_soon(self) -> None:
        """Publish the metrics' state once per turn of the event loop, however many events that turn handled: the
        scheduler's part is counts it keeps, but the health part looks at every member, and over a large pool shared
        by several gateways most events are other gateways' jobs starting and ending."""
        if self.observe.metrics is None or self._publish_due:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # fed outside a loop (no later turn to wait for): publish now
            self._publish()
            return
        self._publish_due = True
        loop.call_soon(self._publish)

    def _publish(self) -> None:
        self._publish_due = False
        self.observe.publish(self.scheduler, (w.role for w in self.members.all() if w.health.stuck),
                             (w.role for w in self.members.all() if w.health is WorkerHealth.CREDENTIAL_REFUSED),
                             (w.role for w in self.members.all() if w.health is WorkerHealth.INCOMPATIBLE))

    def _from_watch(self, event: sch.Event, quiet: bool = False) -> None:
        """A worker's health change, from its watch. A draining worker (it said NOT_SERVING) that goes away has
        usually just answered its last job, and that answer may still be on its way through the loop: the job's own
        call decides it, so the unhealthy event waits for the call to end (briefly) instead of requeueing a finished
        job to be done twice. The same for an AR's batches: its health stream ends just after its last reply went
        out, and failing the batch then answered 503 for work the AR had finished. A worker that was serving, or
        hangs, is marked unhealthy at once, as before."""
        if isinstance(event, sch.WorkerUnhealthy) and self.scheduler.is_not_serving(event.worker):
            calls = [t for job, t in self._denoise_calls.items() if self._denoise_on.get(job) == event.worker]
            calls += [t for bid, t in self._ar_calls.items() if self._ar_on.get(bid) == event.worker]
            if calls:
                waiting = self._spawn(asyncio.wait(calls, timeout=self.config.health_probe_timeout),
                                      f"drained:{event.worker}")
                waiting.add_done_callback(lambda _t, w=event.worker: self._gone_after_drain(w))
                return
        self._feed(event, quiet)

    def _gone_after_drain(self, address: str) -> None:
        worker = self.members.get(address)
        if worker is not None and worker.health is not WorkerHealth.SERVING:  # not back in the meantime
            self._feed(sch.WorkerUnhealthy(now=time.monotonic(), worker=address, why=worker.health.down))

    def _arm_timer(self) -> None:
        if self._timer:
            self._timer.cancel()
            self._timer = None
        wake = self.scheduler.next_wakeup()
        if wake is not None:
            loop = asyncio.get_running_loop()
            delay = max(0.0, wake - time.monotonic())
            self._timer = loop.call_later(delay, lambda: self._feed(sch.Tick(now=time.monotonic())),
                                          context=without_request_id())

    def _perform(self, action: sch.Action) -> None:
        match action:
            case sch.DispatchArBatch():
                members = [p for rid in action.request_ids if (p := self._pending.get(rid)) is not None]
                self.observe.ar_dispatched((p.timing, p.admitted.n) for p in members)
                for p in members:
                    p.trace.ar_dispatched()
                # For several requests: it logs their ids itself.
                task = spawn(self._run_ar_batch(action), name=f"ar-batch:{action.batch_id}")
                self._ar_calls[action.batch_id] = task
                self._ar_on[action.batch_id] = action.worker
                task.add_done_callback(functools.partial(self._ar_task_done, action))
            case sch.CancelArBatch(batch_id=batch_id, abandoned=abandoned):
                task = self._ar_calls.pop(batch_id, None)
                self._ar_on.pop(batch_id, None)
                if task:
                    if abandoned:  # the scheduler holds the AR slot until it hears the call has ended
                        self._abandoned_batches.add(batch_id)
                    task.cancel()
            case sch.DispatchDenoise():
                pending = self._pending.get(action.job.request_id)
                self.observe.denoise_dispatched(pending and pending.timing, action.job.index)
                if pending is not None:
                    pending.trace.denoise_dispatched(action.job.index, action.job.attempt, pending.timing.ar_done)
                    if not pending.first_dispatch:
                        pending.first_dispatch = True
                        self.observe.tenant_waited(self.scheduler.tenant_of(action.job.request_id) or "default",
                                                   pending.timing)
                task = spawn(self._run_denoise(action), name=f"denoise:{action.job.request_id}/{action.job.index}",
                             request_id=action.job.request_id)
                self._denoise_calls[action.job] = task
                self._denoise_on[action.job] = action.worker
                task.add_done_callback(functools.partial(self._denoise_task_done, action))
            case sch.CancelDenoise(job=job):
                task = self._denoise_calls.get(job)
                if task:
                    task.cancel()  # cancels the RPC; the denoiser stops at its next step
            case sch.CompleteRequest():
                pending = self._pending.get(action.request_id)
                self.observe.completed(action, pending and pending.timing)
                if pending and not pending.future.done():
                    pending.future.set_result(Outcome(images=action.results,
                                                               priors=[o.prior for o in action.ar_outputs]))
            case sch.FailRequest(error=error):
                pending = self._pending.get(action.request_id)
                self.observe.failed(error.kind)
                if pending and not pending.future.done():
                    pending.future.set_result(error)
                note = f" ({error.operator_note})" if error.operator_note else ""
                log.info("request %s failed: %s: %s%s", action.request_id, error.kind.name, error.message, note)
            case _:
                raise TypeError(f"unknown scheduler action {action!r}")

    # ---- RPCs (the calls themselves are gateway.downstream's) -------------------------------------------------
    #
    # Each call runs as a task that *returns* the event reporting its end; the task's done callback feeds it. So
    # every exit of a call that holds a slot (a result, a gRPC error, a cancel, an exception nobody expected)
    # reaches the scheduler, and the slot is freed: a call that died silently once wedged the AR for good.

    async def _run_ar_batch(self, action: sch.DispatchArBatch) -> sch.Event:
        # A request cancelled since dispatch is left out; the scheduler drops it when the batch returns anyway.
        waiting = [(rid, p) for rid in action.request_ids if (p := self._pending.get(rid))]
        members = [(rid, p.admitted, p.timing) for rid, p in waiting]
        span = ar_call([p.trace for _, p in waiting], action.batch_id, action.worker)
        return await traced(span, self.downstream.ar_batch(self.members.get(action.worker), action, members))

    def _ar_task_done(self, action: sch.DispatchArBatch, task: asyncio.Task) -> None:
        if self._ar_calls.get(action.batch_id) is task:
            del self._ar_calls[action.batch_id]
            self._ar_on.pop(action.batch_id, None)
        abandoned = action.batch_id in self._abandoned_batches
        self._abandoned_batches.discard(action.batch_id)
        # Abandoned (nobody waits for it), maybe before it ever ran: report its end to free the AR slot. A batch
        # cancelled because its worker went unhealthy was already released and fenced by the scheduler.
        now = time.monotonic()
        cancelled = sch.ArBatchFailed(now=now, batch_id=action.batch_id, message="cancelled: nobody waits for it",
                                      kind=sch.ErrorKind.CANCELLED)
        self._call_ended(task, f"AR batch {action.batch_id} ({','.join(action.request_ids)})",
                         cancelled if abandoned else None,
                         sch.ArBatchFailed(now=now, batch_id=action.batch_id, kind=sch.ErrorKind.INTERNAL,
                                           message="internal error in the gateway"))

    async def _run_denoise(self, action: sch.DispatchDenoise) -> sch.Event:
        worker = self.members.get(action.worker)
        pending = self._pending.get(action.job.request_id)
        if pending is None or worker is None:  # ended between dispatch and now: hand the slot straight back
            return sch.DenoiseFailed(now=time.monotonic(), job=action.job, worker=action.worker,
                                     message="request already finished", retryable=False)
        job = action.job
        return await traced(pending.trace.denoise_call(job.index, job.attempt, action.worker),
                            self.downstream.denoise(worker, action, pending.admitted, pending.stream))

    def _denoise_task_done(self, action: sch.DispatchDenoise, task: asyncio.Task) -> None:
        # The scheduler keeps the worker's slot until it hears how the call ended, so every end reports.
        if self._denoise_calls.get(action.job) is task:
            del self._denoise_calls[action.job]
            self._denoise_on.pop(action.job, None)
        job, now = action.job, time.monotonic()
        self._call_ended(task, f"denoise {job.request_id}/{job.index}#{job.attempt}",
                         # CancelDenoise, or cancelled before it ever ran
                         sch.DenoiseFailed(now=now, job=job, worker=action.worker, message="cancelled",
                                           retryable=True),
                         sch.DenoiseFailed(now=now, job=job, worker=action.worker, retryable=False,
                                           message="internal error in the gateway", kind=sch.ErrorKind.INTERNAL))

    def _call_ended(self, task: asyncio.Task, what: str, cancelled: sch.Event | None, crashed: sch.Event) -> None:
        """Feed the event ending a call's task: its result, ``cancelled`` (None: none) or ``crashed`` (it raised)."""
        if task.cancelled():
            event = cancelled
        elif (exc := task.exception()) is not None:
            log.error("%s failed in the gateway", what, exc_info=exc)
            event = crashed
        else:
            event = task.result()
        if event is not None:
            self._feed(event)

    # ---- health (the watches themselves are gateway.workers') -------------------------------------------------

    def _sideline(self, worker: Worker, health: WorkerHealth, code: grpc.StatusCode, detail: str = "") -> None:
        """A call to it timed out or broke (or it refused the credential: ``detail``, what it said): unavailable
        until it answers a health check again (for a refusal, a check with the credential)."""
        if self._closed or self.members.get(worker.address) is not worker:
            return
        if health is not WorkerHealth.CREDENTIAL_REFUSED:  # (a refusal is logged by the worker, with its words)
            log.warning("%s %s is suspect (%s on a call): unavailable until it answers a health check",
                        worker.role.name.lower(), worker.address, code.name)
        worker.sideline(health, detail)
