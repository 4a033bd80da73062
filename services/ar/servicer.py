"""ArService over gRPC: protobuf <-> domain dataclasses at the edge, admission, metrics; nothing else."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

import grpc
from opentelemetry import trace

from glmimage.v1 import ar_service_pb2, ar_service_pb2_grpc, common_pb2
from runtime.deadlines import rpc_deadline
from runtime.errors import InvalidArgument
from runtime.executor import SerialExecutor
from runtime.limits import AR_FIELDS, check_id, valid_id
from runtime.logs import request_id_var
from runtime.server import request_id_from
from runtime.version import build_info
from services.ar import metrics
from services.ar.batcher import AdmissionQueue, CallMerger
from services.ar.domain import (
    ArBackend,
    ArRequest,
    ArResult,
    RequestInvalid,
    RunControl,
    Sampling,
    Usage,
    check_batch,
)

log = logging.getLogger(__name__)

DEFAULT_MERGE_WINDOW = 0.002  # seconds: short next to any model batch, long enough for concurrent gateway calls


def request_from_proto(msg: ar_service_pb2.GenerateRequest) -> ArRequest:
    s = msg.sampling
    return ArRequest(
        prompt=msg.prompt, n=msg.n, height=msg.height, width=msg.width,
        seed=msg.seed if msg.HasField("seed") else None,
        sampling=Sampling(temperature=s.temperature if s.HasField("temperature") else None,
                          top_p=s.top_p if s.HasField("top_p") else None,
                          top_k=s.top_k if s.HasField("top_k") else None),
        reference_images=tuple(image.data for image in msg.reference_images))


def usage_to_proto(u: Usage) -> common_pb2.Usage:
    return common_pb2.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                            total_tokens=u.total_tokens, reasoning_tokens=u.reasoning_tokens,
                            cached_tokens=u.cached_tokens, image_tokens=u.image_tokens)


def result_to_proto(result: ArResult) -> ar_service_pb2.GenerateResponse:
    grid_h, grid_w = result.grid
    return ar_service_pb2.GenerateResponse(
        outputs=[ar_service_pb2.PriorOutput(tokens=common_pb2.TokenRow(token_ids=o.token_ids), seed=o.seed,
                                            usage=usage_to_proto(o.usage)) for o in result.outputs],
        height=result.height, width=result.width, grid_height=grid_h, grid_width=grid_w,
        usage=usage_to_proto(result.usage),
        references=[common_pb2.ReferenceTokens(tokens=common_pb2.TokenRow(token_ids=r.token_ids),
                                               grid_height=r.grid_height, grid_width=r.grid_width)
                    for r in result.references])


def merge_key(reqs: Sequence[ArRequest]) -> tuple[int, int] | None:
    """Calls of one resolution share a model batch; edits never do: a reference that fails to decode on the worker
    thread would fail every call merged with it."""
    if any(r.reference_images for r in reqs):
        return None
    return reqs[0].height, reqs[0].width


def in_batch(exc: InvalidArgument, index: int, single: bool) -> InvalidArgument:
    """A request's refusal, its field named as the caller sent it: "requests[i].field" within a GenerateBatch."""
    return exc if single else InvalidArgument(f"requests[{index}].{exc.field}", exc.description)


class ArServicer(ar_service_pb2_grpc.ArServiceServicer):
    def __init__(self, engine: ArBackend, executor: SerialExecutor, *, max_queue: int = 0,
                 merge_window: float = DEFAULT_MERGE_WINDOW) -> None:
        """merge_window: seconds a batch gathers concurrent calls of its resolution before it runs (0: only those
        already waiting)."""
        self.engine = engine
        self.admission = AdmissionQueue(executor, max_waiting=max_queue, on_depth=metrics.QUEUE_DEPTH.set)
        self.merger: CallMerger[ArRequest, ArResult] = CallMerger(
            self.admission, self._generate, cap=engine.limits.max_batch_outputs, window=merge_window,
            on_wait=metrics.QUEUE_SECONDS.observe, on_merged=metrics.MERGED_CALLS.inc)

    @property
    def current(self) -> RunControl | None:
        """The model batch holding the model, for drains and tests."""
        return self.merger.current

    async def Generate(self, request, context: grpc.aio.ServicerContext):
        self._adopt_request_id(context, [request])
        (result,) = await self._execute([request], context, RunControl(deadline=rpc_deadline(context)), single=True)
        log.debug("generated %d row(s) at %dx%d", len(result.outputs), result.height, result.width)
        return result_to_proto(result)

    async def GetLimits(self, request, context: grpc.aio.ServicerContext):
        return ar_service_pb2.ArServiceGetLimitsResponse(limits=self.engine.limits.to_proto(AR_FIELDS),
                                                          build=build_info(), device=self.engine.device_name)

    async def GenerateBatch(self, request, context: grpc.aio.ServicerContext):
        self._adopt_request_id(context, request.requests)
        control = RunControl(deadline=rpc_deadline(context))
        results = await self._execute(request.requests, context, control, single=False)
        log.debug("generated a batch of %d request(s), %d row(s)", len(results),
                 sum(len(r.outputs) for r in results))
        return ar_service_pb2.GenerateBatchResponse(responses=[result_to_proto(r) for r in results],
                                                    queue_seconds=control.queue_seconds)

    @staticmethod
    def _adopt_request_id(context: grpc.aio.ServicerContext, msgs: Sequence[ar_service_pb2.GenerateRequest]) -> None:
        """The proto's request_id names the call in logs when no x-request-id metadata came with it."""
        ids = [m.request_id for m in msgs if m.request_id and valid_id(m.request_id)]  # (_validate refuses others)
        if ids and request_id_from(context.invocation_metadata()) is None:
            request_id_var.set(",".join(ids))

    def _validate(self, msgs: Sequence[ar_service_pb2.GenerateRequest], single: bool) -> list[ArRequest]:
        if not msgs:
            raise InvalidArgument("requests", "must not be empty")
        reqs = []
        for i, msg in enumerate(msgs):
            try:
                check_id(msg.request_id, "request_id")
                reqs.append(self.engine.validate(request_from_proto(msg)))
            except InvalidArgument as exc:
                raise in_batch(exc, i, single) from None
        check_batch(reqs, self.engine.limits, single=single)
        return reqs

    async def _execute(self, msgs: Sequence[ar_service_pb2.GenerateRequest], context: grpc.aio.ServicerContext,
                       control: RunControl, *, single: bool) -> list[ArResult]:
        """Validate, wait for the model (or leave the queue), run, and count the outcome of every request."""
        count = max(len(msgs), 1)
        started = time.monotonic()
        try:
            reqs = self._validate(msgs, single)
            try:
                results = await self.merger.submit(reqs, key=merge_key(reqs), rows=sum(r.n for r in reqs),
                                                   control=control)
            except RequestInvalid as exc:  # a reference that would not decode, found on the worker thread
                raise in_batch(exc, exc.index, single) from None
        except asyncio.CancelledError:
            # Client cancel or deadline: a queued call never starts; a running batch stops at its next step.
            control.cancel.set()
            passed = control.deadline is not None and time.monotonic() >= control.deadline - 0.01
            metrics.record(metrics.Outcome.DEADLINE_EXCEEDED if passed else metrics.Outcome.CANCELLED, count)
            log.info("caller gone (%s) after %d step(s)", "deadline" if passed else "cancelled", control.steps_done)
            raise
        except Exception as exc:
            metrics.record(metrics.outcome_of(exc), count)
            raise
        metrics.record(metrics.Outcome.OK, count)
        # The call's server span (runtime.server; non-recording with traces off): its two stages.
        # Compute is the rest of the call after its wait for the model (merge window and decoding included).
        trace.get_current_span().set_attributes({
            "glmimage.ar.queue_seconds": control.queue_seconds,
            "glmimage.ar.compute_seconds": max(0.0, time.monotonic() - started - control.queue_seconds),
            "glmimage.ar.requests": len(msgs), "glmimage.ar.outputs": sum(r.n for r in reqs)})
        return results

    def _generate(self, reqs: list[ArRequest], control: RunControl) -> list[ArResult]:
        """On the worker thread: one model batch (maybe several calls merged), with its metrics (also counted when
        its callers left)."""
        control.check()  # every caller left between admission and the thread picking it up
        metrics.BUSY.set(1)
        metrics.BATCH_SIZE.observe(sum(r.n for r in reqs))
        t0 = time.perf_counter()
        try:
            results = self.engine.generate(reqs, control)
        finally:
            metrics.COMPUTE_SECONDS.observe(time.perf_counter() - t0)
            metrics.BUSY.set(0)
        usage = sum((r.usage for r in results), Usage())
        metrics.GENERATED_TOKENS.inc(usage.completion_tokens)
        metrics.PROMPT_TOKENS.inc(usage.prompt_tokens)
        metrics.CACHED_TOKENS.inc(usage.cached_tokens)
        return results
