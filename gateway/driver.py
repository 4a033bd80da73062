"""The imperative shell around the pure scheduler: performs its actions over gRPC and feeds results back.

Everything that touches the network or the clock lives here; every decision lives in gateway.scheduler.
All scheduler calls happen on the event loop thread, so the state machine needs no locks.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway import scheduler as sch
from gateway.config import GatewayConfig
from glmimage.v1 import (
    ar_service_pb2,
    ar_service_pb2_grpc,
    denoiser_service_pb2,
    denoiser_service_pb2_grpc,
    gateway_service_pb2,
)

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


@dataclass
class _Pending:
    request: gateway_service_pb2.GenerateImagesRequest
    height: int
    width: int
    future: asyncio.Future[Outcome]


class _Worker:
    def __init__(self, address: str, role: sch.WorkerRole) -> None:
        self.address = address
        self.role = role
        self.channel = grpc.aio.insecure_channel(address)
        self.watch_task: asyncio.Task | None = None
        if role is sch.WorkerRole.AR:
            self.stub = ar_service_pb2_grpc.ArServiceStub(self.channel)
            self.service = AR_SERVICE
        else:
            self.stub = denoiser_service_pb2_grpc.DenoiserServiceStub(self.channel)
            self.service = DENOISER_SERVICE


class Driver:
    def __init__(self, config: GatewayConfig, scheduler: sch.Scheduler | None = None) -> None:
        self.config = config
        self.scheduler = scheduler or sch.Scheduler(config.scheduler)
        self._pending: dict[str, _Pending] = {}
        self._workers: dict[str, _Worker] = {}
        self._ar_calls: dict[int, asyncio.Task] = {}
        self._denoise_calls: dict[sch.JobId, asyncio.Task] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._closed = False
        self._duplicates = itertools.count(1)

    # ---- lifecycle -------------------------------------------------------------------------------------------

    async def start(self) -> None:
        for address in self.config.ar_addresses:
            self.add_worker(address, sch.WorkerRole.AR)
        for address in self.config.denoiser_addresses:
            self.add_worker(address, sch.WorkerRole.DENOISER)

    async def close(self) -> None:
        self._closed = True
        if self._timer:
            self._timer.cancel()
        tasks = [*self._ar_calls.values(), *self._denoise_calls.values(),
                 *(w.watch_task for w in self._workers.values() if w.watch_task)]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(w.channel.close() for w in self._workers.values()), return_exceptions=True)

    def add_worker(self, address: str, role: sch.WorkerRole) -> None:
        if address in self._workers:
            return
        worker = _Worker(address, role)
        self._workers[address] = worker
        self._feed(sch.WorkerAdded(now=time.monotonic(), worker=address, role=role))
        worker.watch_task = asyncio.create_task(self._watch_health(worker), name=f"health:{address}")

    def remove_worker(self, address: str) -> None:
        if address in self._workers:
            self._feed(sch.WorkerRemoved(now=time.monotonic(), worker=address))

    # ---- requests --------------------------------------------------------------------------------------------

    async def generate(self, request_id: str, request: gateway_service_pb2.GenerateImagesRequest,
                       height: int, width: int, n: int, timeout: float) -> Outcome:
        """Admit a request and wait for it. Cancelling the awaiting task cancels the request downstream."""
        loop = asyncio.get_running_loop()
        pending = _Pending(request=request, height=height, width=width, future=loop.create_future())
        # The id comes from the client's x-request-id and may repeat; the scheduler needs it unique.
        if request_id in self._pending:
            request_id = f"{request_id}.{next(self._duplicates)}"
        self._pending[request_id] = pending
        now = time.monotonic()
        self._feed(sch.RequestArrived(now=now, request_id=request_id, n=n, height=height, width=width,
                                      deadline=now + timeout))
        try:
            return await asyncio.shield(pending.future)
        except asyncio.CancelledError:
            if not pending.future.done():
                self._feed(sch.RequestCancelled(now=time.monotonic(), request_id=request_id))
            raise
        finally:
            self._pending.pop(request_id, None)

    def snapshot(self) -> sch.Snapshot:
        return self.scheduler.snapshot()

    # ---- the loop: events in, actions out --------------------------------------------------------------------

    def _feed(self, event: object) -> None:
        if self._closed:
            return
        for action in self.scheduler.handle(event):
            self._perform(action)
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

    def _perform(self, action: object) -> None:
        match action:
            case sch.DispatchArBatch():
                self._ar_calls[action.batch_id] = asyncio.create_task(self._run_ar_batch(action))
            case sch.CancelArBatch(batch_id=batch_id):
                task = self._ar_calls.pop(batch_id, None)
                if task:
                    task.cancel()
            case sch.DispatchDenoise():
                self._denoise_calls[action.job] = asyncio.create_task(self._run_denoise(action))
            case sch.CancelDenoise(job=job):
                task = self._denoise_calls.get(job)
                if task:
                    task.cancel()  # cancels the RPC; the denoiser stops at its next step
            case sch.CompleteRequest():
                pending = self._pending.get(action.request_id)
                if pending and not pending.future.done():
                    pending.future.set_result(Outcome(images=action.results, priors=action.ar_outputs))
            case sch.FailRequest():
                pending = self._pending.get(action.request_id)
                if pending and not pending.future.done():
                    pending.future.set_exception(RequestFailed(action.code, action.message))
                log.info("request %s failed: %s: %s", action.request_id, action.code.name, action.message)
            case _:
                raise TypeError(f"unknown scheduler action {action!r}")

    # ---- RPCs -----------------------------------------------------------------------------------------------

    async def _run_ar_batch(self, action: sch.DispatchArBatch) -> None:
        worker = self._workers[action.worker]
        # A request cancelled since dispatch is left out; the scheduler drops it when the batch returns anyway.
        rids = [rid for rid in action.request_ids if rid in self._pending]
        requests = []
        for rid in rids:
            p = self._pending[rid].request
            requests.append(ar_service_pb2.GenerateRequest(
                prompt=p.prompt, n=p.n or 1, height=action.height, width=action.width,
                seed=p.seed if p.HasField("seed") else None, sampling=p.sampling, request_id=rid))
        try:
            response = await worker.stub.GenerateBatch(
                ar_service_pb2.GenerateBatchRequest(requests=requests),
                timeout=self.config.request_timeout, metadata=(("x-request-id", ",".join(rids)),))
        except asyncio.CancelledError:
            return
        except grpc.aio.AioRpcError as err:
            self._ar_calls.pop(action.batch_id, None)
            self._feed(sch.ArBatchFailed(now=time.monotonic(), batch_id=action.batch_id,
                                         message=f"{err.code().name}: {err.details()}"))
            return
        self._ar_calls.pop(action.batch_id, None)
        # A short reply leaves some requests without outputs; the scheduler fails exactly those (INTERNAL).
        outputs = {rid: list(r.outputs) for rid, r in zip(rids, response.responses, strict=False)}
        self._feed(sch.ArBatchSucceeded(now=time.monotonic(), batch_id=action.batch_id, outputs=outputs))

    async def _run_denoise(self, action: sch.DispatchDenoise) -> None:
        job, worker = action.job, self._workers[action.worker]
        pending = self._pending.get(job.request_id)
        prior: ar_service_pb2.PriorOutput = action.ar_output
        if pending is None:  # the request ended between dispatch and now: hand the slot straight back
            self._denoise_calls.pop(job, None)
            self._feed(sch.DenoiseFailed(now=time.monotonic(), job=job, worker=worker.address,
                                         message="request already finished", retryable=False))
            return
        try:
            p = pending.request
            request = denoiser_service_pb2.DenoiseRequest(
                prompt=p.prompt, prior_tokens=prior.tokens, height=pending.height, width=pending.width,
                num_inference_steps=p.num_inference_steps,
                guidance_scale=p.guidance_scale if p.HasField("guidance_scale") else None,
                seed=prior.seed, output_format=p.output_format,
                output_compression=p.output_compression if p.HasField("output_compression") else None,
                request_id=job.request_id)
            response = await worker.stub.Denoise(
                request, timeout=self.config.request_timeout,
                metadata=(("x-request-id", f"{job.request_id}/{job.index}#{job.attempt}"),))
        except asyncio.CancelledError:
            event = sch.DenoiseFailed(now=time.monotonic(), job=job, worker=worker.address,
                                      message="cancelled", retryable=True)
        except grpc.aio.AioRpcError as err:
            code = err.code()
            event = sch.DenoiseFailed(now=time.monotonic(), job=job, worker=worker.address,
                                      message=err.details() or code.name, retryable=code in RETRYABLE_CODES,
                                      code=ERROR_CODE_OF.get(code, sch.ErrorKind.INTERNAL))
        else:
            event = sch.DenoiseSucceeded(now=time.monotonic(), job=job, worker=worker.address, result=response)
        self._denoise_calls.pop(job, None)
        self._feed(event)

    async def _watch_health(self, worker: _Worker) -> None:
        """Follow grpc.health.v1 Watch; any break in the stream counts as unhealthy until it says SERVING again."""
        stub = health_pb2_grpc.HealthStub(worker.channel)
        backoff = self.config.health_retry_min
        healthy = False
        while not self._closed:
            try:
                call = stub.Watch(health_pb2.HealthCheckRequest(service=worker.service))
                async for reply in call:
                    serving = reply.status == health_pb2.HealthCheckResponse.SERVING
                    if serving != healthy:
                        healthy = serving
                        log.info("%s %s is %s", worker.role.name.lower(), worker.address,
                                 "SERVING" if serving else "not serving")
                        self._feed((sch.WorkerHealthy if serving else sch.WorkerUnhealthy)(
                            now=time.monotonic(), worker=worker.address))
                    backoff = self.config.health_retry_min
            except asyncio.CancelledError:
                return
            except grpc.aio.AioRpcError:
                pass
            if healthy:
                healthy = False
                log.warning("%s %s is unreachable", worker.role.name.lower(), worker.address)
                self._feed(sch.WorkerUnhealthy(now=time.monotonic(), worker=worker.address))
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.config.health_retry_max)
