"""The gateway's calls to its workers: the AR's GenerateBatch and a denoiser's Denoise or DenoiseStream, the
requests they send, and a failed call read back in the scheduler's terms (what the client is told, which field
it refused, whether to retry the job elsewhere and whether to sideline the worker).

Nothing here decides or keeps state: the driver performs these calls for the scheduler and feeds back their ends.
"""
from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc

from gateway.config import GatewayConfig
from gateway.observe import Observer, Timing
from gateway.scheduler import types as sch
from gateway.timeouts import CostModel, DenoiseTimeouts, ar_seconds, ar_work
from gateway.workers import CREDENTIAL_CODES, Worker, WorkerHealth, refusal
from glmimage.v1 import ar_service_pb2, common_pb2, denoiser_service_pb2
from runtime.admission import Admitted
from runtime.details import ERROR_DOMAIN, error_info, field_violation
from runtime.errors import DENOISER_BUSY
from runtime.status import kind_of, row_of
from runtime.tracing import with_trace

log = logging.getLogger("gateway.driver")

# Extra seconds a job naming LoRA adapters may take (at least; as much again as its own time if that is more): the
# cost model learns steps, not loads, and a load of a real adapter file from a network volume can take this long.
LORA_LOAD_ALLOWANCE_S = 60.0

Metadata = tuple[tuple[str, str], ...]

# A denoise failure with these codes says nothing about the request itself: try another worker.
RETRYABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
                             grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED,
                             grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL})

# Call failures that say more about the worker than about the job.
SUSPECT_CODES = frozenset({grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE})

_BATCH_FIELD = re.compile(r"^requests\[\d+\]\.")

# Called with (image index, DenoiseStreamResponse carrying progress or partial_image).
Relay = Callable[[int, denoiser_service_pb2.DenoiseStreamResponse], None]


class Sideline(Protocol):
    """Sidelines ``worker`` with ``health`` after a call failed with ``code``; ``detail``: what the worker said."""

    def __call__(self, worker: Worker, health: WorkerHealth, code: grpc.StatusCode, detail: str = "") -> None: ...


@dataclass(frozen=True)
class StreamOptions:
    partial_images: int  # previews per image, 0-3
    relay: Relay


def client_message(role: str, err: grpc.aio.AioRpcError) -> str:
    """A worker failure in the client's terms. A refusal of the input keeps the worker's text: our own validation
    wrote it and it names the field to fix. Otherwise the worker's details (gRPC's own text names addresses and
    library errors) go to the gateway's log with the request ids, never to the client."""
    row = row_of(err.code())
    if row.refusal:
        return err.details() or "invalid request"
    return f"the {role} {row.worker_text}"


def refused_field(err: grpc.aio.AioRpcError) -> tuple[str | None, str]:
    """(field, message) of a worker's refusal of the client's input, the field read from the status' BadRequest
    details. A batch member's field ("requests[1].prompt") is named as the client sent it ("prompt"), and the
    message leads with that name; without details the worker's text goes as is."""
    violation = field_violation(err)
    if violation is None or not violation[0]:
        return None, err.details() or "invalid request"
    field = _BATCH_FIELD.sub("", violation[0])
    return field, f"{field}: {violation[1]}"


@dataclass(frozen=True)
class Failure:
    """A failed worker call in the scheduler's terms."""

    status_code: grpc.StatusCode  # what the worker answered
    kind: sch.ErrorKind  # what the request fails with, if it does
    message: str  # what the client is told
    field: str | None = None  # the request field the worker refused

    @property
    def retryable(self) -> bool:
        return self.status_code in RETRYABLE_CODES

    @property
    def sideline(self) -> WorkerHealth | None:
        """The health to sideline the worker with (until a health check answers again); None: leave it be."""
        if self.status_code not in SUSPECT_CODES:
            return None
        if self.status_code is grpc.StatusCode.DEADLINE_EXCEEDED:
            return WorkerHealth.TIMED_OUT
        return WorkerHealth.UNREACHABLE


def held_elsewhere(err: grpc.aio.AioRpcError, instance_id: str) -> tuple[bool, int | None]:
    """Whether a denoiser refused the call because another gateway's job holds it, and the occupancy sequence it
    said that at (None: it said none)."""
    if err.code() is not grpc.StatusCode.RESOURCE_EXHAUSTED:
        return False, None
    info = error_info(err)
    if info is None or info[0] != DENOISER_BUSY or info[1] != ERROR_DOMAIN:
        return False, None
    meta = info[2]
    if meta.get("owner") == instance_id:
        return False, None  # its own job: nothing of this gateway should still hold it; an ordinary failure
    try:
        sequence = int(meta["sequence"])
    except (KeyError, ValueError):
        sequence = None
    return True, sequence


def failure(err: grpc.aio.AioRpcError, role: str, default: sch.ErrorKind) -> Failure:
    """``err`` read back: a refusal of the input is the client's error and names its field; anything else is the
    worker's, told as ``default``."""
    kind = kind_of(err.code(), default)
    if kind is sch.ErrorKind.INVALID_ARGUMENT:
        field, message = refused_field(err)
        return Failure(err.code(), kind, message, field)
    return Failure(err.code(), kind, client_message(role, err))


@dataclass(frozen=True)
class ArOutput:
    """One output of an AR batch, as the scheduler carries it (opaquely) to the output's denoise jobs: its prior
    tokens and, for an edit, the tokens of the request's reference images, which the denoiser needs with them."""

    prior: ar_service_pb2.PriorOutput
    references: Sequence[common_pb2.ReferenceTokens] = ()


def ar_batch(action: sch.DispatchArBatch, rids: Sequence[str], admitted: Sequence[Admitted]
             ) -> ar_service_pb2.GenerateBatchRequest:
    """The AR batch for the requests ``rids`` (in that order), at the batch's rounded-up size."""
    return ar_service_pb2.GenerateBatchRequest(requests=[ar_service_pb2.GenerateRequest(
        prompt=a.request.prompt, n=a.n, height=action.height, width=action.width,
        seed=a.request.seed if a.request.HasField("seed") else None, sampling=a.request.sampling, request_id=rid,
        reference_images=a.request.reference_images)
        for rid, a in zip(rids, admitted, strict=True)])


def denoise_request(action: sch.DispatchDenoise, admitted: Admitted, owner: str = ""
                    ) -> denoiser_service_pb2.DenoiseRequest:
    """One output's job, at the size the client asked for."""
    out: ArOutput = action.ar_output  # type: ignore[assignment]
    prior, p = out.prior, admitted.request
    return denoiser_service_pb2.DenoiseRequest(
        prompt=p.prompt, prior_tokens=prior.tokens, height=admitted.height, width=admitted.width,
        num_inference_steps=p.num_inference_steps,
        guidance_scale=p.guidance_scale if p.HasField("guidance_scale") else None,
        seed=prior.seed, output_format=p.output_format,
        output_compression=p.output_compression if p.HasField("output_compression") else None,
        request_id=action.job.request_id, reference_images=p.reference_images, references=out.references,
        owner=owner, step_cache=p.step_cache, loras=p.loras)


class Downstream:
    """Performs the workers' calls for the driver. Each returns the scheduler event that reports its end; a call
    that broke, or timed out on a worker that then fails a health probe too, first sidelines its worker (through
    ``sideline``), *before* its job is requeued, so the retry goes elsewhere. A call that timed out on a worker that
    answers its probe was a slow job, not a sick worker: the worker keeps serving, and the cost model allows such
    work more time from then on."""

    def __init__(self, config: GatewayConfig, observe: Observer, sideline: Sideline) -> None:
        self.metadata: Metadata = config.worker_metadata
        self.instance_id = config.instance_id
        self.observe = observe
        self.sideline = sideline
        self.ar_costs = CostModel(config.ar_timeout)
        self.denoise_timeouts = DenoiseTimeouts(config.denoise_timeout)

    async def _failure(self, worker: Worker, err: grpc.aio.AioRpcError, role: str, default: sch.ErrorKind,
                       overran: Callable[[], None]) -> Failure:
        """``err`` read back; the worker sidelined if it is at fault. ``overran`` records a slow job."""
        failed = failure(err, role, default)
        if err.code() in CREDENTIAL_CODES:
            # It refused the gateway's credential, before running anything: marked so (it gets no work until a
            # check with the credential passes), and the scheduler, told before this call's end (which it then
            # fences), sends what it held elsewhere without using an attempt.
            self.sideline(worker, WorkerHealth.CREDENTIAL_REFUSED, err.code(), refusal(err))
        if failed.sideline is WorkerHealth.TIMED_OUT and await worker.answers_probe():
            log.warning("%s %s still answers its health checks: a slow job, not a sick worker; it keeps serving, "
                        "and such jobs get more time", role, worker.address)
            overran()
        elif failed.sideline is not None:
            self.sideline(worker, failed.sideline, err.code())
        return failed

    async def ar_batch(self, worker: Worker | None, action: sch.DispatchArBatch,
                       members: Sequence[tuple[str, Admitted, Timing]]) -> sch.Event:
        """Run the batch for ``members`` (request id, request, its timing), the requests still waiting for it."""
        if worker is None:
            return sch.ArBatchFailed(now=time.monotonic(), batch_id=action.batch_id,
                                     message="the AR server went away")
        if not members:  # nobody is waiting for this batch any more: do not make the AR run it
            return sch.ArBatchSucceeded(now=time.monotonic(), batch_id=action.batch_id, outputs={})
        rids = [rid for rid, _, _ in members]
        batch = ar_batch(action, rids, [admitted for _, admitted, _ in members])
        work = ar_work(action.height, action.width, sum(a.reference_pixels for _, a, _ in members))
        timeout = self.ar_costs.timeout(work)
        started = time.monotonic()
        try:
            response = await worker.stub.GenerateBatch(
                batch, timeout=timeout, metadata=with_trace((("x-request-id", ",".join(rids)), *self.metadata)))
        except grpc.aio.AioRpcError as err:
            log.warning("AR batch %d (%s) on %s failed after %.1fs: %s: %s", action.batch_id, ",".join(rids),
                        worker.address, time.monotonic() - started, err.code().name, err.details())
            # The AR names the field within its batch ("requests[1].prompt"); the client sent one request.
            failed = await self._failure(
                worker, err, "AR server", sch.ErrorKind.UNAVAILABLE,
                lambda: self.ar_costs.observe_overrun(work, time.monotonic() - started))
            return sch.ArBatchFailed(now=time.monotonic(), batch_id=action.batch_id, message=failed.message,
                                     kind=failed.kind, field=failed.field)
        now = time.monotonic()
        self.ar_costs.observe(work, ar_seconds(work, now - started, response.queue_seconds))
        self.observe.ar_done((timing for _, _, timing in members), started, now)
        # A short reply leaves some requests without outputs; the scheduler fails exactly those (INTERNAL).
        outputs = {rid: [ArOutput(o, tuple(r.references)) for o in r.outputs]
                   for rid, r in zip(rids, response.responses, strict=False)}
        return sch.ArBatchSucceeded(now=now, batch_id=action.batch_id, outputs=outputs)

    async def denoise(self, worker: Worker, action: sch.DispatchDenoise, admitted: Admitted,
                      stream: StreamOptions | None) -> sch.Event:
        """Run one output's job, unary or (``stream`` given) streamed with its events relayed."""
        job = action.job
        height, width, reference_pixels = admitted.height, admitted.width, admitted.reference_pixels
        job_request = denoise_request(action, admitted, self.instance_id)
        # The traceparent is the current span's: the driver's denoise call span (gateway.traces).
        metadata = with_trace((("x-request-id", f"{job.request_id}/{job.index}#{job.attempt}"), *self.metadata))
        timeouts = self.denoise_timeouts
        work = timeouts.work(job_request.num_inference_steps, height, width, reference_pixels, job_request.step_cache)
        timeout = timeouts.timeout(work)
        if job_request.loras:  # it may load adapter files first: allowed as much again as the job, and a floor
            timeout += max(timeout, LORA_LOAD_ALLOWANCE_S)
        started = time.monotonic()
        try:
            response = await _denoise(worker, job_request, metadata, timeout, stream, job.index)
        except grpc.aio.AioRpcError as err:
            elsewhere, sequence = held_elsewhere(err, self.instance_id)
            if elsewhere:  # another gateway's job took it first: not a failure of this job, nor of the worker
                log.debug("denoise %s: %s is busy with another gateway's job", metadata[0][1], worker.address)
                return sch.DenoiseRefusedBusy(now=time.monotonic(), job=job, worker=worker.address,
                                              sequence=sequence)
            log.warning("denoise %s on %s failed after %.1fs (timeout %.1fs): %s: %s", metadata[0][1],
                        worker.address, time.monotonic() - started, timeout, err.code().name, err.details())
            def overran() -> None:
                if work is not None:
                    timeouts.model.observe_overrun(work, time.monotonic() - started)

            failed = await self._failure(worker, err, "denoiser", sch.ErrorKind.INTERNAL, overran)
            return sch.DenoiseFailed(now=time.monotonic(), job=job, worker=worker.address, message=failed.message,
                                     retryable=failed.retryable, kind=failed.kind, field=failed.field)
        if response is None:
            return sch.DenoiseFailed(now=time.monotonic(), job=job, worker=worker.address,
                                     message="the denoise stream ended without a result", retryable=True)
        now = time.monotonic()
        timings = response.timings
        timeouts.observe(job_request.num_inference_steps, response.steps_completed, height, width, reference_pixels,
                         step_cache=job_request.step_cache,
                         denoise_seconds=timings.denoise_seconds - timings.lora_load_seconds,
                         prepare_seconds=timings.prepare_seconds - timings.lora_load_seconds,
                         post_seconds=timings.decode_seconds + timings.encode_seconds)
        self.observe.denoise_done(now - started)
        return sch.DenoiseSucceeded(now=now, job=job, worker=worker.address, result=response,
                                    lora_load_s=timings.lora_load_seconds)


async def _denoise(worker: Worker, request: denoiser_service_pb2.DenoiseRequest, metadata: Metadata,
                   timeout: float, stream: StreamOptions | None, index: int
                   ) -> denoiser_service_pb2.DenoiseResponse | None:
    """The job's result, or None if a stream ended without it."""
    if stream is None:
        return await worker.stub.Denoise(request, timeout=timeout, metadata=metadata)
    call = worker.stub.DenoiseStream(
        denoiser_service_pb2.DenoiseStreamRequest(job=request, partial_images=stream.partial_images),
        timeout=timeout, metadata=metadata)
    try:
        async for message in call:
            if message.WhichOneof("event") == "result":
                return message.result
            # Relayed synchronously: once CancelDenoise has cancelled the task, nothing stale gets through.
            stream.relay(index, message)
    except grpc.aio.AioRpcError as err:
        if err.code() != grpc.StatusCode.UNIMPLEMENTED:
            raise
        # A denoiser without the streaming RPC (an older build, mid rolling upgrade): the caller still gets
        # the image, only without progress and previews for it.
        log.warning("denoiser %s has no DenoiseStream; running the job unary", worker.address)
        return await worker.stub.Denoise(request, timeout=timeout, metadata=metadata)
    return None
