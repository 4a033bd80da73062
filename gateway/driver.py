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
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway import scheduler as sch
from gateway.config import GatewayConfig
from gateway.membership import DnsMembership
from gateway.metrics import GatewayMetrics
from glmimage.v1 import (
    ar_service_pb2,
    ar_service_pb2_grpc,
    denoiser_service_pb2,
    denoiser_service_pb2_grpc,
    gateway_service_pb2,
)
from services.model.checks import round_up
from services.runtime import keepalive
from services.runtime.tls import make_channel

log = logging.getLogger(__name__)

AR_SERVICE = ar_service_pb2.DESCRIPTOR.services_by_name["ArService"].full_name
DENOISER_SERVICE = denoiser_service_pb2.DESCRIPTOR.services_by_name["DenoiserService"].full_name
# A denoise failure with these codes says nothing about the request itself: try another worker.
RETRYABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
                             grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED,
                             grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL})

ERROR_CODE_OF = {grpc.StatusCode.INVALID_ARGUMENT: sch.ErrorKind.INVALID_ARGUMENT,
                 grpc.StatusCode.OUT_OF_RANGE: sch.ErrorKind.INVALID_ARGUMENT,
                 grpc.StatusCode.FAILED_PRECONDITION: sch.ErrorKind.INVALID_ARGUMENT}

_BATCH_FIELD = re.compile(r"^requests\[\d+\]\.")

# Keepalive pings find a worker whose node vanished without closing the connection (the health Watch then breaks and
# the worker is marked unhealthy); the short capped reconnect backoff reaches a restarted worker within about a
# second. Both, and how they agree with what the workers accept, are in services.runtime.keepalive.
CHANNEL_OPTIONS = (
    *keepalive.message_size_options(64 * 1024 * 1024, 64 * 1024 * 1024),
    *keepalive.WORKER_CHANNEL_OPTIONS,
)

# Denoise failures that say more about the worker than about the job.
SUSPECT_CODES = frozenset({grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE})


class _NotServing(Exception):
    """A health probe answered, but not SERVING."""


# Called with (image index, DenoiseStreamResponse carrying progress or partial_image).
Relay = Callable[[int, denoiser_service_pb2.DenoiseStreamResponse], None]


class RequestFailed(Exception):
    def __init__(self, code: sch.ErrorKind, message: str) -> None:
        super().__init__(message)
        self.code = code
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


class _Worker:
    def __init__(self, address: str, role: sch.WorkerRole, config: GatewayConfig) -> None:
        self.address = address
        self.role = role
        self.channel = make_channel(address, config.client_tls, CHANNEL_OPTIONS)
        self.watch_task: asyncio.Task | None = None
        if role is sch.WorkerRole.AR:
            self.stub = ar_service_pb2_grpc.ArServiceStub(self.channel)
            self.service = AR_SERVICE
        else:
            self.stub = denoiser_service_pb2_grpc.DenoiserServiceStub(self.channel)
            self.service = DENOISER_SERVICE


class Driver:
    def __init__(self, config: GatewayConfig, scheduler: sch.Scheduler | None = None,
                 metrics: GatewayMetrics | None = None) -> None:
        self.config = config
        self.scheduler = scheduler or sch.Scheduler(config.scheduler)
        self.metrics = metrics
        self._pending: dict[str, _Pending] = {}
        self._workers: dict[str, _Worker] = {}
        self._removed: set[str] = set()  # removed from the scheduler, maybe still draining
        self._ar_calls: dict[int, asyncio.Task] = {}
        self._abandoned_batches: set[int] = set()  # cancelled because nobody waits: report their end
        self._denoise_calls: dict[sch.JobId, asyncio.Task] = {}
        self._background: set[asyncio.Task] = set()
        self._timer: asyncio.TimerHandle | None = None
        self._closed = False
        self._duplicates = itertools.count(1)
        self.dns: list[DnsMembership] = []

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
                self._feed(sch.WorkerAdded(now=time.monotonic(), worker=address, role=role))
                return True
            return False
        worker = _Worker(address, role, self.config)
        self._workers[address] = worker
        log.info("%s worker %s added", role.value.lower(), address)
        self._feed(sch.WorkerAdded(now=time.monotonic(), worker=address, role=role))
        worker.watch_task = asyncio.create_task(self._watch_health(worker), name=f"health:{address}")
        return True

    def remove_worker(self, address: str) -> bool:
        """Drain and remove a worker: its current job finishes, no new job is sent. False if unknown."""
        if address not in self._workers:
            return False
        if address not in self._removed:
            self._removed.add(address)
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
            self.metrics.publish(self.scheduler.snapshot(), self.scheduler.counters)
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
                task.add_done_callback(functools.partial(self._ar_task_done, action.batch_id))
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
                    pending.future.set_exception(RequestFailed(action.code, action.message))
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

    async def _run_ar_batch(self, action: sch.DispatchArBatch) -> None:
        worker = self._workers.get(action.worker)
        # A request cancelled since dispatch is left out; the scheduler drops it when the batch returns anyway.
        rids = [rid for rid in action.request_ids if rid in self._pending]
        if worker is None or not rids:
            self._ar_calls.pop(action.batch_id, None)
            if worker is None:
                event: sch.Event = sch.ArBatchFailed(now=time.monotonic(), batch_id=action.batch_id,
                                                     message=f"worker {action.worker} is gone")
            else:  # nobody is waiting for this batch any more: do not make the AR run it
                event = sch.ArBatchSucceeded(now=time.monotonic(), batch_id=action.batch_id, outputs={})
            self._feed(event)
            return
        requests = []
        for rid in rids:
            p = self._pending[rid].request
            requests.append(ar_service_pb2.GenerateRequest(
                prompt=p.prompt, n=p.n or 1, height=action.height, width=action.width,
                seed=p.seed if p.HasField("seed") else None, sampling=p.sampling, request_id=rid))
        started = time.monotonic()
        try:
            response = await worker.stub.GenerateBatch(
                ar_service_pb2.GenerateBatchRequest(requests=requests),
                timeout=self.config.request_timeout, metadata=(("x-request-id", ",".join(rids)),))
        except asyncio.CancelledError:
            return
        except grpc.aio.AioRpcError as err:
            self._ar_calls.pop(action.batch_id, None)
            kind = ERROR_CODE_OF.get(err.code(), sch.ErrorKind.UNAVAILABLE)
            # The AR names the field within its batch ("requests[1].prompt: ..."); the client sent one request.
            message = (_BATCH_FIELD.sub("", err.details() or "") if kind is sch.ErrorKind.INVALID_ARGUMENT
                       else f"{err.code().name}: {err.details()}")
            self._feed(sch.ArBatchFailed(now=time.monotonic(), batch_id=action.batch_id, message=message,
                                         code=kind))
            return
        self._ar_calls.pop(action.batch_id, None)
        now = time.monotonic()
        if self.metrics is not None:
            self.metrics.ar_seconds.observe(now - started)
        for rid in rids:
            if (p := self._pending.get(rid)) is not None:
                p.ar_done = now
        # A short reply leaves some requests without outputs; the scheduler fails exactly those (INTERNAL).
        outputs = {rid: list(r.outputs) for rid, r in zip(rids, response.responses, strict=False)}
        self._feed(sch.ArBatchSucceeded(now=now, batch_id=action.batch_id, outputs=outputs))

    async def _run_denoise(self, action: sch.DispatchDenoise) -> None:
        job = action.job
        worker = self._workers.get(action.worker)
        pending = self._pending.get(job.request_id)
        if pending is None or worker is None:  # ended between dispatch and now: hand the slot straight back
            self._denoise_calls.pop(job, None)
            self._feed(sch.DenoiseFailed(now=time.monotonic(), job=job, worker=action.worker,
                                         message="request already finished", retryable=False))
            return
        prior: ar_service_pb2.PriorOutput = action.ar_output
        p = pending.request
        request = denoiser_service_pb2.DenoiseRequest(
            prompt=p.prompt, prior_tokens=prior.tokens, height=pending.height, width=pending.width,
            num_inference_steps=p.num_inference_steps,
            guidance_scale=p.guidance_scale if p.HasField("guidance_scale") else None,
            seed=prior.seed, output_format=p.output_format,
            output_compression=p.output_compression if p.HasField("output_compression") else None,
            request_id=job.request_id)
        metadata = (("x-request-id", f"{job.request_id}/{job.index}#{job.attempt}"),)
        started = time.monotonic()
        try:
            if pending.stream is None:
                response = await worker.stub.Denoise(request, timeout=self.config.denoise_timeout,
                                                     metadata=metadata)
            else:
                response = await self._denoise_stream(worker, request, metadata, job.index, pending.stream)
        except asyncio.CancelledError:
            event: sch.Event = sch.DenoiseFailed(now=time.monotonic(), job=job, worker=worker.address,
                                                 message="cancelled", retryable=True)
        except grpc.aio.AioRpcError as err:
            code = err.code()
            if code in SUSPECT_CODES:
                # No answer in time, or the connection broke: take the worker out *before* the job is requeued,
                # so the retry goes elsewhere, and let it back only once a health check answers again.
                self._suspect(worker, f"{code.name} on a denoise call")
            event = sch.DenoiseFailed(now=time.monotonic(), job=job, worker=worker.address,
                                      message=err.details() or code.name, retryable=code in RETRYABLE_CODES,
                                      code=ERROR_CODE_OF.get(code, sch.ErrorKind.INTERNAL))
        else:
            if response is None:
                event = sch.DenoiseFailed(now=time.monotonic(), job=job, worker=worker.address,
                                          message="the denoise stream ended without a result", retryable=True)
            else:
                event = sch.DenoiseSucceeded(now=time.monotonic(), job=job, worker=worker.address,
                                             result=response)
                if self.metrics is not None:
                    self.metrics.denoise_seconds.observe(event.now - started)
        self._denoise_calls.pop(job, None)
        self._feed(event)

    def _ar_task_done(self, batch_id: int, task: asyncio.Task) -> None:
        # Cancelled because nobody waits for it, maybe before it ever ran: report its end to free the AR slot.
        if batch_id in self._abandoned_batches:
            self._abandoned_batches.discard(batch_id)
            self._feed(sch.ArBatchFailed(now=time.monotonic(), batch_id=batch_id,
                                         message="cancelled: nobody waits for it", code=sch.ErrorKind.CANCELLED))

    def _denoise_task_done(self, action: sch.DispatchDenoise, task: asyncio.Task) -> None:
        # The coroutine removes itself and reports the outcome; one cancelled before it ever ran did neither, and
        # the worker's slot would stay held forever.
        if self._denoise_calls.get(action.job) is task:
            del self._denoise_calls[action.job]
            self._feed(sch.DenoiseFailed(now=time.monotonic(), job=action.job, worker=action.worker,
                                         message="cancelled before it started", retryable=True))

    async def _denoise_stream(self, worker: _Worker, request: denoiser_service_pb2.DenoiseRequest,
                              metadata: tuple[tuple[str, str], ...], index: int,
                              stream: StreamOptions) -> denoiser_service_pb2.DenoiseResponse | None:
        """Run a streamed job, relaying its events; the final result, or None if the stream ended without it."""
        call = worker.stub.DenoiseStream(
            denoiser_service_pb2.DenoiseStreamRequest(job=request, partial_images=stream.partial_images),
            timeout=self.config.denoise_timeout, metadata=metadata)
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
            return await worker.stub.Denoise(request, timeout=self.config.denoise_timeout, metadata=metadata)
        return None

    def _suspect(self, worker: _Worker, why: str) -> None:
        """Mark a worker unhealthy now and restart its health watch, which must see a fresh answer to clear it."""
        if worker.watch_task is None or self._closed:
            return
        log.warning("%s %s is suspect (%s): unavailable until it answers a health check", worker.role.name.lower(),
                    worker.address, why)
        worker.watch_task.cancel()
        self._feed(sch.WorkerUnhealthy(now=time.monotonic(), worker=worker.address))
        worker.watch_task = asyncio.create_task(self._watch_health(worker), name=f"health:{worker.address}")

    async def _watch_health(self, worker: _Worker) -> None:
        """Follow grpc.health.v1 Watch; any break in the stream counts as unhealthy until it says SERVING again.

        NOT_SERVING from a worker that was serving means it is draining (SIGTERM): it takes no new work, but what
        it holds is left to finish, as its shutdown grace promises. Only if it then goes away is that work lost.
        """
        stub = health_pb2_grpc.HealthStub(worker.channel)
        backoff = self.config.health_retry_min
        healthy = False  # what the scheduler was last told: WorkerHealthy (True) or WorkerUnhealthy (False)
        serving = False
        while not self._closed:
            try:
                # A Check with a deadline first: a hung process keeps its connection open, so only an answer
                # within the probe timeout proves it is alive; the Watch below then follows changes.
                probe = await stub.Check(health_pb2.HealthCheckRequest(service=worker.service),
                                         timeout=self.config.health_probe_timeout)
                if probe.status != health_pb2.HealthCheckResponse.SERVING:
                    raise _NotServing
                call = stub.Watch(health_pb2.HealthCheckRequest(service=worker.service))
                async for reply in call:
                    now_serving = reply.status == health_pb2.HealthCheckResponse.SERVING
                    if now_serving and not (healthy and serving):
                        log.info("%s %s is SERVING", worker.role.name.lower(), worker.address)
                        self._feed(sch.WorkerHealthy(now=time.monotonic(), worker=worker.address))
                        healthy = True
                    elif not now_serving and healthy and serving:
                        log.info("%s %s is not serving (draining): no new work, its current work may finish",
                                 worker.role.name.lower(), worker.address)
                        self._feed(sch.WorkerNotServing(now=time.monotonic(), worker=worker.address))
                    serving = now_serving
                    backoff = self.config.health_retry_min
            except asyncio.CancelledError:
                return
            except (grpc.aio.AioRpcError, _NotServing):
                pass
            serving = False
            if healthy:
                healthy = False
                log.warning("%s %s is unreachable", worker.role.name.lower(), worker.address)
                self._feed(sch.WorkerUnhealthy(now=time.monotonic(), worker=worker.address))
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.config.health_retry_max)
