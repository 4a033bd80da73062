"""The imperative shell around the pure scheduler: performs its actions over gRPC and feeds results back.

Everything that touches the network or the clock lives here; every decision lives in gateway.scheduler.
All scheduler calls happen on the event loop thread, so the state machine needs no locks.

Streaming is a driver concern only: for a streamed request the denoise job runs as ``DenoiseStream`` and its
progress and previews are relayed to the caller, while the scheduler sees the same DispatchDenoise and
DenoiseSucceeded as for a unary one.
"""
from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc

from gateway import scheduler as sch
from gateway.config import GatewayConfig
from gateway.membership import DnsMembership
from gateway.metrics import GatewayMetrics
from gateway.timeouts import ArTimeouts, DenoiseTimeouts
from gateway.workers import Worker, WorkerHealth
from glmimage.v1 import (
    ar_service_pb2,
    denoiser_service_pb2,
    gateway_service_pb2,
)
from services.runtime.limits import Limits, limits_in_force, round_up
from services.runtime.server import field_violation

log = logging.getLogger(__name__)

# A denoise failure with these codes says nothing about the request itself: try another worker.
RETRYABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
                             grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED,
                             grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL})

ERROR_CODE_OF = {grpc.StatusCode.INVALID_ARGUMENT: sch.ErrorKind.INVALID_ARGUMENT,
                 grpc.StatusCode.OUT_OF_RANGE: sch.ErrorKind.INVALID_ARGUMENT,
                 grpc.StatusCode.FAILED_PRECONDITION: sch.ErrorKind.INVALID_ARGUMENT}

_BATCH_FIELD = re.compile(r"^requests\[\d+\]\.")

# Call failures that say more about the worker than about the job.
SUSPECT_CODES = frozenset({grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE})

# What a client is told when a worker call fails for a reason of the worker's own. The worker's details (gRPC's
# own text names addresses and library errors) go to the gateway's log with the request ids, never to the client.
_CLIENT_TEXT = {
    grpc.StatusCode.DEADLINE_EXCEEDED: "did not answer in time",
    grpc.StatusCode.UNAVAILABLE: "was unreachable",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "was overloaded",
    grpc.StatusCode.CANCELLED: "cancelled the call",
    # A deployment problem, not the client's: the worker wants the internal token the gateway lacks or got wrong.
    grpc.StatusCode.UNAUTHENTICATED: "refused the gateway's credential (its internal token)",
    grpc.StatusCode.PERMISSION_DENIED: "refused the gateway's credential (its internal token)",
}


def client_message(role: str, err: grpc.aio.AioRpcError) -> str:
    """A worker failure in the client's terms. INVALID_ARGUMENT keeps the worker's text: our own validation
    wrote it and it names the field to fix."""
    if err.code() in ERROR_CODE_OF:
        return err.details() or "invalid request"
    return f"the {role} {_CLIENT_TEXT.get(err.code(), 'failed')}"


def refused_field(err: grpc.aio.AioRpcError) -> tuple[str | None, str]:
    """(field, message) of a worker's refusal of the client's input, the field read from the status' BadRequest
    details. A batch member's field ("requests[1].prompt") is named as the client sent it ("prompt"), and the
    message leads with that name; without details the worker's text goes as is."""
    violation = field_violation(err)
    if violation is None or not violation[0]:
        return None, err.details() or "invalid request"
    field = _BATCH_FIELD.sub("", violation[0])
    return field, f"{field}: {violation[1]}"


# Called with (image index, DenoiseStreamResponse carrying progress or partial_image).
Relay = Callable[[int, denoiser_service_pb2.DenoiseStreamResponse], None]


class RequestFailed(Exception):
    def __init__(self, code: sch.ErrorKind, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.field = field
        self.message = message


@dataclass
class Outcome:
    """A finished request: the denoiser responses and the AR outputs, both in output order."""

    images: Sequence[denoiser_service_pb2.DenoiseResponse]
    priors: Sequence[ar_service_pb2.PriorOutput]


@dataclass(frozen=True)
class StreamOptions:
    partial_images: int  # previews per image, 0-3
    relay: Relay


@dataclass
class _Pending:
    request: gateway_service_pb2.GenerateImagesRequest
    height: int
    width: int
    n: int
    future: asyncio.Future[Outcome]
    stream: StreamOptions | None
    arrived: float
    ar_dispatched: bool = False
    ar_done: float | None = None
    denoise_dispatched: set[int] = field(default_factory=set)  # output indices dispatched at least once


class Driver:
    def __init__(self, config: GatewayConfig, scheduler: sch.Scheduler | None = None,
                 metrics: GatewayMetrics | None = None) -> None:
        self.config = config
        self.scheduler = scheduler or sch.Scheduler(config.scheduler)
        self.metrics = metrics
        self._pending: dict[str, _Pending] = {}
        self._workers: dict[str, Worker] = {}
        self._removed: set[str] = set()  # removed from the scheduler, maybe still draining
        self._ar_calls: dict[int, asyncio.Task] = {}
        self._abandoned_batches: set[int] = set()  # cancelled because nobody waits: report their end
        self._denoise_calls: dict[sch.JobId, asyncio.Task] = {}
        self._background: set[asyncio.Task] = set()
        self._timer: asyncio.TimerHandle | None = None
        self._closed = False
        self._duplicates = itertools.count(1)
        self.dns: list[DnsMembership] = []
        self.ar_timeouts = ArTimeouts(config.ar_timeout)
        self.denoise_timeouts = DenoiseTimeouts(config.denoise_timeout)
        self._limits: Limits | None = None  # in force; recomputed after any change of members or their limits

    # ---- lifecycle -------------------------------------------------------------------------------------------

    async def start(self) -> None:
        for address in self.config.ar_addresses:
            self.add_worker(address, sch.WorkerRole.AR)
        for address in self.config.denoiser_addresses:
            self.add_worker(address, sch.WorkerRole.DENOISER)
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
                 *(w.watch_task for w in self._workers.values() if w.watch_task)]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(w.channel.close() for w in self._workers.values()), return_exceptions=True)

    def _spawn(self, coro, name: str) -> asyncio.Task:
        task = asyncio.create_task(coro, name=name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    # ---- membership ------------------------------------------------------------------------------------------

    def worker_role(self, address: str) -> sch.WorkerRole | None:
        worker = self._workers.get(address)
        return None if worker is None else worker.role

    def add_worker(self, address: str, role: sch.WorkerRole) -> bool:
        """Add a worker; it gets work once its health watch sees SERVING. False if it already was a member."""
        worker = self._workers.get(address)
        if worker is not None:
            if address in self._removed and worker.role is role:
                self._removed.discard(address)  # re-added while draining: the scheduler keeps it
                self._limits_changed()
                self._feed(sch.WorkerAdded(now=time.monotonic(), worker=address, role=role))
                return True
            return False
        if len(self._workers) >= self.config.max_workers:
            log.warning("%s worker %s not added: the pool already has %d workers (--max-workers)",
                        role.value.lower(), address, len(self._workers))
            return False
        worker = Worker(address, role, self.config)
        self._workers[address] = worker
        log.info("%s worker %s added", role.value.lower(), address)
        self._feed(sch.WorkerAdded(now=time.monotonic(), worker=address, role=role))
        worker.watch(self._feed, lambda: self._closed, self._limits_changed)
        return True

    def limits(self) -> Limits:
        """What admission refuses past: the tightest of the gateway's flags and of its members' own limits."""
        if self._limits is None:
            members = [w for a, w in self._workers.items() if a not in self._removed and w.limits is not None]
            self._limits = limits_in_force(dict(self.config.own_limits),
                                           [w.limits for w in members if w.role is sch.WorkerRole.AR],
                                           [w.limits for w in members if w.role is sch.WorkerRole.DENOISER])
        return self._limits

    def _limits_changed(self) -> None:
        self._limits = None

    def pool_size(self) -> int:
        """Workers held, both roles, draining ones included (what --max-workers bounds)."""
        return len(self._workers)

    def remove_worker(self, address: str) -> bool:
        """Drain and remove a worker: its current job finishes, no new job is sent. False if unknown."""
        if address not in self._workers:
            return False
        if address not in self._removed:
            self._removed.add(address)
            self._limits_changed()
            log.info("worker %s removed; draining", address)
            self._feed(sch.WorkerRemoved(now=time.monotonic(), worker=address))
        return True

    def _reap(self) -> None:
        """Close what the scheduler has let go of (a removed worker that has drained)."""
        for address in [a for a in self._removed if not self.scheduler.has_worker(a)]:
            self._removed.discard(address)
            worker = self._workers.pop(address)
            if worker.watch_task:
                worker.watch_task.cancel()
            self._spawn(worker.channel.close(), f"close:{address}")
            log.info("worker %s drained and gone", address)

    # ---- requests --------------------------------------------------------------------------------------------

    async def generate(self, request_id: str, request: gateway_service_pb2.GenerateImagesRequest,
                       height: int, width: int, n: int, timeout: float,
                       stream: StreamOptions | None = None) -> Outcome:
        """Admit a request and wait for it. Cancelling the awaiting task cancels the request downstream."""
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        pending = _Pending(request=request, height=height, width=width, n=n, future=loop.create_future(),
                           stream=stream, arrived=now)
        # The id comes from the client's x-request-id and may repeat; the scheduler needs it unique.
        original = request_id
        while request_id in self._pending:  # a loop: "abc.1" may itself be a client's id already in flight
            request_id = f"{original}.{next(self._duplicates)}"
        self._pending[request_id] = pending
        # Both stages round sizes up to multiples of 32, so requests that differ below that share AR batches.
        self._feed(sch.RequestArrived(now=now, request_id=request_id, n=n, height=round_up(height),
                                      width=round_up(width), deadline=now + timeout))
        try:
            return await asyncio.shield(pending.future)
        except asyncio.CancelledError:
            if not pending.future.done():
                self._feed(sch.RequestCancelled(now=time.monotonic(), request_id=request_id))
            if pending.future.done() and not pending.future.cancelled():
                pending.future.exception()  # the caller is gone: mark the "cancelled" failure as seen
            raise
        finally:
            self._pending.pop(request_id, None)

    async def first_checks(self, timeout: float) -> None:
        """Wait (at most ``timeout``) until every member's first health check has an answer: a gateway that says
        SERVING before it knows its workers would fail-fast its first requests with 503."""
        events = [w.checked.wait() for w in self._workers.values()]
        if events:
            try:
                await asyncio.wait_for(asyncio.gather(*events), timeout)
            except TimeoutError:
                log.warning("some workers had not answered a first health check after %.1fs", timeout)

    def snapshot(self) -> sch.Snapshot:
        return self.scheduler.snapshot()

    # ---- the loop: events in, actions out --------------------------------------------------------------------

    def _feed(self, event: sch.Event) -> None:
        if self._closed:
            return
        for action in self.scheduler.handle(event):
            self._perform(action)
        if self._removed:
            self._reap()
        if self.metrics is not None:
            stuck = frozenset(a for a, w in self._workers.items() if w.health.stuck)
            self.metrics.publish(self.scheduler.snapshot(), self.scheduler.counters, stuck)
        self._arm_timer()

    def _arm_timer(self) -> None:
        if self._timer:
            self._timer.cancel()
            self._timer = None
        wake = self.scheduler.next_wakeup()
        if wake is not None:
            loop = asyncio.get_running_loop()
            delay = max(0.0, wake - time.monotonic())
            self._timer = loop.call_later(delay, lambda: self._feed(sch.Tick(now=time.monotonic())))

    def _perform(self, action: sch.Action) -> None:
        match action:
            case sch.DispatchArBatch():
                self._observe_ar_dispatch(action)
                task = asyncio.create_task(self._run_ar_batch(action))
                self._ar_calls[action.batch_id] = task
                task.add_done_callback(functools.partial(self._ar_task_done, action))
            case sch.CancelArBatch(batch_id=batch_id, abandoned=abandoned):
                task = self._ar_calls.pop(batch_id, None)
                if task:
                    if abandoned:  # the scheduler holds the AR slot until it hears the call has ended
                        self._abandoned_batches.add(batch_id)
                    task.cancel()
            case sch.DispatchDenoise():
                self._observe_denoise_dispatch(action.job)
                task = asyncio.create_task(self._run_denoise(action))
                self._denoise_calls[action.job] = task
                task.add_done_callback(functools.partial(self._denoise_task_done, action))
            case sch.CancelDenoise(job=job):
                task = self._denoise_calls.get(job)
                if task:
                    task.cancel()  # cancels the RPC; the denoiser stops at its next step
            case sch.CompleteRequest():
                pending = self._pending.get(action.request_id)
                self._observe_completed(action, pending)
                if pending and not pending.future.done():
                    pending.future.set_result(Outcome(images=action.results, priors=action.ar_outputs))
            case sch.FailRequest():
                if self.metrics is not None:
                    self.metrics.requests.labels(action.code.value).inc()
                pending = self._pending.get(action.request_id)
                if pending and not pending.future.done():
                    pending.future.set_exception(RequestFailed(action.code, action.message, action.field))
                log.info("request %s failed: %s: %s", action.request_id, action.code.name, action.message)
            case _:
                raise TypeError(f"unknown scheduler action {action!r}")

    # ---- metrics (no-ops without a GatewayMetrics) -----------------------------------------------------------

    def _observe_ar_dispatch(self, action: sch.DispatchArBatch) -> None:
        if self.metrics is None:
            return
        now, slots = time.monotonic(), 0
        for rid in action.request_ids:
            p = self._pending.get(rid)
            if p is None:
                continue
            slots += p.n
            if not p.ar_dispatched:  # queue time until the first dispatch; a retry is not a new wait
                p.ar_dispatched = True
                self.metrics.queue_seconds.labels("ar").observe(now - p.arrived)
        self.metrics.ar_batch_size.observe(slots)

    def _observe_denoise_dispatch(self, job: sch.JobId) -> None:
        p = self._pending.get(job.request_id)
        if self.metrics is None or p is None or p.ar_done is None or job.index in p.denoise_dispatched:
            return
        p.denoise_dispatched.add(job.index)
        self.metrics.queue_seconds.labels("denoise").observe(time.monotonic() - p.ar_done)

    def _observe_completed(self, action: sch.CompleteRequest, pending: _Pending | None) -> None:
        m = self.metrics
        if m is None:
            return
        m.requests.labels("ok").inc()
        m.images.inc(len(action.results))
        priors: Sequence[ar_service_pb2.PriorOutput] = action.ar_outputs
        m.tokens.labels("prompt").inc(sum(p.usage.prompt_tokens for p in priors))
        m.tokens.labels("completion").inc(sum(p.usage.completion_tokens for p in priors))
        if pending is not None:
            m.request_seconds.observe(time.monotonic() - pending.arrived)

    # ---- RPCs -----------------------------------------------------------------------------------------------
    #
    # Each call runs as a task that *returns* the event reporting its end; the task's done callback feeds it. So
    # every exit of a call that holds a slot (a result, a gRPC error, a cancel, an exception nobody expected)
    # reaches the scheduler, and the slot is freed: a call that died silently once wedged the AR for good.

    async def _run_ar_batch(self, action: sch.DispatchArBatch) -> sch.Event:
        worker = self._workers.get(action.worker)
        # A request cancelled since dispatch is left out; the scheduler drops it when the batch returns anyway.
        rids = [rid for rid in action.request_ids if rid in self._pending]
        if worker is None:
            return sch.ArBatchFailed(now=time.monotonic(), batch_id=action.batch_id,
                                     message="the AR server went away")
        if not rids:  # nobody is waiting for this batch any more: do not make the AR run it
            return sch.ArBatchSucceeded(now=time.monotonic(), batch_id=action.batch_id, outputs={})
        requests = []
        for rid in rids:
            p = self._pending[rid].request
            requests.append(ar_service_pb2.GenerateRequest(
                prompt=p.prompt, n=p.n or 1, height=action.height, width=action.width,
                seed=p.seed if p.HasField("seed") else None, sampling=p.sampling, request_id=rid))
        timeout = self.ar_timeouts.timeout(action.height, action.width)
        started = time.monotonic()
        try:
            response = await worker.stub.GenerateBatch(
                ar_service_pb2.GenerateBatchRequest(requests=requests),
                timeout=timeout, metadata=(("x-request-id", ",".join(rids)), *self.config.worker_metadata))
        except grpc.aio.AioRpcError as err:
            log.warning("AR batch %d (%s) on %s failed after %.1fs: %s: %s", action.batch_id, ",".join(rids),
                        worker.address, time.monotonic() - started, err.code().name, err.details())
            if err.code() in SUSPECT_CODES:
                self._sideline(worker, err.code())
            kind = ERROR_CODE_OF.get(err.code(), sch.ErrorKind.UNAVAILABLE)
            # The AR names the field within its batch ("requests[1].prompt"); the client sent one request.
            field, message = None, client_message("AR server", err)
            if kind is sch.ErrorKind.INVALID_ARGUMENT:
                field, message = refused_field(err)
            return sch.ArBatchFailed(now=time.monotonic(), batch_id=action.batch_id, message=message, code=kind,
                                     field=field)
        now = time.monotonic()
        self.ar_timeouts.observe(action.height, action.width, now - started)
        if self.metrics is not None:
            self.metrics.ar_seconds.observe(now - started)
        for rid in rids:
            if (p := self._pending.get(rid)) is not None:
                p.ar_done = now
        # A short reply leaves some requests without outputs; the scheduler fails exactly those (INTERNAL).
        outputs = {rid: list(r.outputs) for rid, r in zip(rids, response.responses, strict=False)}
        return sch.ArBatchSucceeded(now=now, batch_id=action.batch_id, outputs=outputs)

    def _ar_task_done(self, action: sch.DispatchArBatch, task: asyncio.Task) -> None:
        if self._ar_calls.get(action.batch_id) is task:
            del self._ar_calls[action.batch_id]
        abandoned = action.batch_id in self._abandoned_batches
        self._abandoned_batches.discard(action.batch_id)
        if task.cancelled():
            # Abandoned (nobody waits for it), maybe before it ever ran: report its end to free the AR slot. A batch
            # cancelled because its worker went unhealthy was already released and fenced by the scheduler.
            if abandoned:
                self._feed(sch.ArBatchFailed(now=time.monotonic(), batch_id=action.batch_id,
                                             message="cancelled: nobody waits for it", code=sch.ErrorKind.CANCELLED))
            return
        if (exc := task.exception()) is not None:
            log.error("AR batch %d (%s) failed in the gateway", action.batch_id, ",".join(action.request_ids),
                      exc_info=exc)
            self._feed(sch.ArBatchFailed(now=time.monotonic(), batch_id=action.batch_id,
                                         message="internal error in the gateway", code=sch.ErrorKind.INTERNAL))
            return
        self._feed(task.result())

    def _denoise_request(self, action: sch.DispatchDenoise, pending: _Pending) -> denoiser_service_pb2.DenoiseRequest:
        prior: ar_service_pb2.PriorOutput = action.ar_output
        p = pending.request
        return denoiser_service_pb2.DenoiseRequest(
            prompt=p.prompt, prior_tokens=prior.tokens, height=pending.height, width=pending.width,
            num_inference_steps=p.num_inference_steps,
            guidance_scale=p.guidance_scale if p.HasField("guidance_scale") else None,
            seed=prior.seed, output_format=p.output_format,
            output_compression=p.output_compression if p.HasField("output_compression") else None,
            request_id=action.job.request_id)

    async def _run_denoise(self, action: sch.DispatchDenoise) -> sch.Event:
        job = action.job
        worker = self._workers.get(action.worker)
        pending = self._pending.get(job.request_id)
        if pending is None or worker is None:  # ended between dispatch and now: hand the slot straight back
            return sch.DenoiseFailed(now=time.monotonic(), job=job, worker=action.worker,
                                     message="request already finished", retryable=False)
        request = self._denoise_request(action, pending)
        metadata = (("x-request-id", f"{job.request_id}/{job.index}#{job.attempt}"), *self.config.worker_metadata)
        timeout = self.denoise_timeouts.timeout(request.num_inference_steps, request.height, request.width)
        started = time.monotonic()
        try:
            if pending.stream is None:
                response = await worker.stub.Denoise(request, timeout=timeout, metadata=metadata)
            else:
                response = await self._denoise_stream(worker, request, metadata, job.index, pending.stream, timeout)
        except grpc.aio.AioRpcError as err:
            code = err.code()
            log.warning("denoise %s on %s failed after %.1fs (timeout %.1fs): %s: %s", metadata[0][1],
                        worker.address, time.monotonic() - started, timeout, code.name, err.details())
            if code in SUSPECT_CODES:
                # No answer in time, or the connection broke: take the worker out *before* the job is requeued,
                # so the retry goes elsewhere, and let it back only once a health check answers again.
                self._sideline(worker, code)
            kind = ERROR_CODE_OF.get(code, sch.ErrorKind.INTERNAL)
            field, message = None, client_message("denoiser", err)
            if kind is sch.ErrorKind.INVALID_ARGUMENT:
                field, message = refused_field(err)
            return sch.DenoiseFailed(now=time.monotonic(), job=job, worker=worker.address, message=message,
                                     retryable=code in RETRYABLE_CODES, code=kind, field=field)
        if response is None:
            return sch.DenoiseFailed(now=time.monotonic(), job=job, worker=worker.address,
                                     message="the denoise stream ended without a result", retryable=True)
        now = time.monotonic()
        timings = response.timings
        self.denoise_timeouts.observe(request.num_inference_steps, response.steps_completed, request.height,
                                      request.width, timings.denoise_seconds,
                                      timings.decode_seconds + timings.encode_seconds)
        if self.metrics is not None:
            self.metrics.denoise_seconds.observe(now - started)
        return sch.DenoiseSucceeded(now=now, job=job, worker=worker.address, result=response)

    def _denoise_task_done(self, action: sch.DispatchDenoise, task: asyncio.Task) -> None:
        # The scheduler keeps the worker's slot until it hears how the call ended, so every end reports.
        if self._denoise_calls.get(action.job) is task:
            del self._denoise_calls[action.job]
        if task.cancelled():  # CancelDenoise, or cancelled before it ever ran
            event: sch.Event = sch.DenoiseFailed(now=time.monotonic(), job=action.job, worker=action.worker,
                                                 message="cancelled", retryable=True)
        elif (exc := task.exception()) is not None:
            log.error("denoise %s/%d#%d failed in the gateway", action.job.request_id, action.job.index,
                      action.job.attempt, exc_info=exc)
            event = sch.DenoiseFailed(now=time.monotonic(), job=action.job, worker=action.worker,
                                      message="internal error in the gateway", retryable=False,
                                      code=sch.ErrorKind.INTERNAL)
        else:
            event = task.result()
        self._feed(event)

    async def _denoise_stream(self, worker: Worker, request: denoiser_service_pb2.DenoiseRequest,
                              metadata: tuple[tuple[str, str], ...], index: int,
                              stream: StreamOptions, timeout: float) -> denoiser_service_pb2.DenoiseResponse | None:
        """Run a streamed job, relaying its events; the final result, or None if the stream ended without it."""
        call = worker.stub.DenoiseStream(
            denoiser_service_pb2.DenoiseStreamRequest(job=request, partial_images=stream.partial_images),
            timeout=timeout, metadata=metadata)
        try:
            async for message in call:
                if message.WhichOneof("event") == "result":
                    return message.result
                # Relayed synchronously: once CancelDenoise has cancelled this task, nothing stale gets through.
                stream.relay(index, message)
        except grpc.aio.AioRpcError as err:
            if err.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise
            # A denoiser without the streaming RPC (an older build, mid rolling upgrade): the caller still gets
            # the image, only without progress and previews for it.
            log.warning("denoiser %s has no DenoiseStream; running the job unary", worker.address)
            return await worker.stub.Denoise(request, timeout=timeout, metadata=metadata)
        return None

    # ---- health (the watches themselves are gateway.workers') -------------------------------------------------

    def worker_health(self, address: str) -> WorkerHealth:
        worker = self._workers.get(address)
        return WorkerHealth.UNKNOWN if worker is None else worker.health

    def _sideline(self, worker: Worker, code: grpc.StatusCode) -> None:
        """A call to it timed out or broke: unavailable until it answers a health check again."""
        if self._closed or self._workers.get(worker.address) is not worker:
            return
        log.warning("%s %s is suspect (%s on a call): unavailable until it answers a health check",
                    worker.role.name.lower(), worker.address, code.name)
        worker.sideline(WorkerHealth.TIMED_OUT if code is grpc.StatusCode.DEADLINE_EXCEEDED
                        else WorkerHealth.UNREACHABLE)
