"""DenoiserService over gRPC: batch 1, refusing rather than queueing, and stopping work nobody waits for.

Denoise and DenoiseStream share one code path (`_execute`): the stream only adds the events the worker
thread hands over to the event loop. LoadLoras and UnloadLoras edit the DiT, so they too run on the worker thread
holding the slot (`_admin`), but they wait for it rather than being refused: an operator's preload is worth a wait,
and a job refused meanwhile goes to another denoiser at once.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc
from opentelemetry import trace

from glmimage.v1 import common_pb2, denoiser_service_pb2, denoiser_service_pb2_grpc
from glmimage.wire import formats
from runtime.deadlines import rpc_deadline
from runtime.errors import DENOISER_BUSY, Cancelled, DeadlineExceeded, InvalidArgument, ResourceExhausted
from runtime.executor import SerialExecutor
from runtime.limits import DENOISER_CAPABILITIES, DENOISER_FIELDS, check_id
from runtime.version import build_info
from services.denoiser import metrics
from services.denoiser.adapters import AdapterInfo, LoraRef
from services.denoiser.encoding import ImageFormat
from services.denoiser.engine import (
    DenoiseEngine,
    DenoiseJob,
    DenoiseResult,
    JobControl,
    JobEvent,
    PartialPreview,
    StepProgress,
)
from services.denoiser.metrics import CancelReason, Outcome, StepKind
from services.denoiser.occupancy import OccupancyBoard
from services.denoiser.step_cache import StepCacheLevel
from services.model.references import ReferenceTokens

log = logging.getLogger(__name__)

# WatchOccupancy's request_id while LoadLoras/UnloadLoras hold the slot (owner empty: no gateway's job).
LOADING_LORAS = "loras:load"
UNLOADING_LORAS = "loras:unload"

# A cancel this close to the call's deadline is the deadline: the caller's own timer fires first and its cancel
# arrives before this server's copy of the deadline (which starts when the call arrives) has passed; on a loaded
# machine that head start reaches tens of milliseconds and more.
DEADLINE_SLACK_S = 0.5

# The one format map (glmimage.wire.formats); IMAGE_FORMAT_UNSPECIFIED means its default, PNG.
FORMAT_FROM_PROTO = {**{f.proto: ImageFormat(f.name) for f in formats.BY_NAME.values()},
                     common_pb2.IMAGE_FORMAT_UNSPECIFIED: ImageFormat(formats.DEFAULT.name)}
# STEP_CACHE_UNSPECIFIED means off, so a caller that says nothing gets the uncached image.
STEP_CACHE_FROM_PROTO = {common_pb2.STEP_CACHE_UNSPECIFIED: StepCacheLevel.OFF,
                         **{common_pb2.StepCache.Value(f"STEP_CACHE_{level.name}"): level for level in StepCacheLevel}}


def job_from_proto(msg: denoiser_service_pb2.DenoiseRequest, partial_images: int = 0) -> DenoiseJob:
    """The job a request describes; InvalidArgument for an output_format value ImageFormat does not declare
    (proto3 enums are open: any int32 arrives as is)."""
    if msg.output_format not in FORMAT_FROM_PROTO:
        raise InvalidArgument("output_format", f"unknown format {msg.output_format}; expected one of "
                                               f"{', '.join(common_pb2.ImageFormat.keys())}")
    if msg.step_cache not in STEP_CACHE_FROM_PROTO:
        raise InvalidArgument("step_cache", f"unknown level {msg.step_cache}; expected one of "
                                            f"{', '.join(common_pb2.StepCache.keys())}")
    return DenoiseJob(
        prompt=msg.prompt, token_ids=list(msg.prior_tokens.token_ids), height=msg.height, width=msg.width,
        steps=msg.num_inference_steps,
        guidance_scale=msg.guidance_scale if msg.HasField("guidance_scale") else None,
        seed=msg.seed if msg.HasField("seed") else None,
        output_format=FORMAT_FROM_PROTO[msg.output_format],
        output_compression=msg.output_compression if msg.HasField("output_compression") else None,
        partial_images=partial_images,
        reference_images=[image.data for image in msg.reference_images],
        references=[ReferenceTokens(token_ids=list(r.tokens.token_ids), grid_height=r.grid_height,
                                    grid_width=r.grid_width) for r in msg.references],
        step_cache=STEP_CACHE_FROM_PROTO[msg.step_cache],
        loras=[LoraRef(r.name, r.scale if r.HasField("scale") else None) for r in msg.loras])


def result_to_proto(r: DenoiseResult) -> denoiser_service_pb2.DenoiseResponse:
    return denoiser_service_pb2.DenoiseResponse(
        image=r.image, output_format=r.output_format.spec.proto, height=r.height, width=r.width,
        steps_completed=r.steps_completed, seed=r.seed, steps_cached=r.steps_cached,
        step_cache_note=r.step_cache_note,
        timings=denoiser_service_pb2.DenoiseTimings(denoise_seconds=r.denoise_seconds,
                                                   decode_seconds=r.decode_seconds,
                                                   encode_seconds=r.encode_seconds,
                                                   prepare_seconds=r.prepare_seconds,
                                                   lora_load_seconds=r.lora_load_seconds))


def lora_info_to_proto(info: AdapterInfo) -> common_pb2.LoraInfo:
    return common_pb2.LoraInfo(name=info.name, description=info.description, default_scale=info.default_scale,
                               size_bytes=info.size_bytes)


def event_to_proto(event: JobEvent) -> denoiser_service_pb2.DenoiseStreamResponse:
    match event:
        case StepProgress(step=step, total_steps=total):
            return denoiser_service_pb2.DenoiseStreamResponse(
                progress=denoiser_service_pb2.DenoiseProgress(step=step, total_steps=total))
        case PartialPreview(index=index, step=step, image=image):
            return denoiser_service_pb2.DenoiseStreamResponse(
                partial_image=denoiser_service_pb2.PartialImage(partial_image_index=index, step=step, image=image))
    raise TypeError(f"unknown job event {event!r}")


@dataclass
class JobRecord:
    """One accepted job, live while it runs (`current_job`), final once its worker thread returned (`last_job`)."""

    steps: int
    partial_images: int
    control: JobControl = field(repr=False)
    outcome: Outcome | None = None  # None while running
    steps_at_cancel: int | None = None  # steps finished when the cancel was handed to the worker
    cancel_reason: CancelReason | None = None
    seconds: float = 0.0

    @property
    def steps_done(self) -> int:
        return self.control.steps_done

    def stopping(self) -> bool:
        """Its caller is gone or its deadline passed: the worker stops it at the next step."""
        c = self.control
        return c.cancel.is_set() or (c.deadline is not None and time.monotonic() >= c.deadline)


class DenoiserServicer(denoiser_service_pb2_grpc.DenoiserServiceServicer):
    def __init__(self, engine: DenoiseEngine, executor: SerialExecutor) -> None:
        self.engine = engine
        self.executor = executor
        # Made before the warm-up (serving.py), so the compilations of warm-up are exported too.
        metrics.COMPILATIONS.inc(engine.compilations.graphs)
        engine.compilations.on_compile = metrics.COMPILATIONS.inc
        # Held from acceptance until the worker thread really stops, not just until the RPC ends,
        # so a cancelled job can never overlap the next one.
        self._busy = False
        self._idle = asyncio.Event()
        self._idle.set()
        self.current_job: JobRecord | None = None
        self.last_job: JobRecord | None = None
        self.occupancy = OccupancyBoard()  # who holds the slot, for every gateway that follows it
        self._holding = self._holding_max = 0

    @property
    def busy(self) -> bool:
        return self._busy

    async def wait_idle(self) -> None:
        """Return once no job holds the slot (its worker thread has returned): for drains and tests."""
        await self._idle.wait()

    async def GetLimits(self, request, context: grpc.aio.ServicerContext):
        return denoiser_service_pb2.DenoiserServiceGetLimitsResponse(
            limits=self.engine.limits.to_proto(DENOISER_FIELDS + DENOISER_CAPABILITIES), build=build_info(),
            device=self.engine.device_name,
            compiled_sizes=[common_pb2.ImageSize(width=w, height=h) for h, w in self.engine.compiled_sizes])

    async def WatchOccupancy(self, request, context: grpc.aio.ServicerContext
                             ) -> AsyncIterator[denoiser_service_pb2.WatchOccupancyResponse]:
        async for message in self.occupancy.messages():
            yield message

    async def ListLoras(self, request, context: grpc.aio.ServicerContext):
        # Off the event loop: a directory on a network file system may be slow to list.
        available = await asyncio.to_thread(self.engine.available_loras)
        return denoiser_service_pb2.DenoiserServiceListLorasResponse(
            available=[lora_info_to_proto(info) for info in available], loaded=self.engine.loras_loaded())

    async def LoadLoras(self, request, context: grpc.aio.ServicerContext):
        names = tuple(request.names)
        self.engine.check_lora_names(names, load=True)
        loaded = await self._admin(LOADING_LORAS, self.engine.load_loras, names) if names else \
            self.engine.loras_loaded()
        return denoiser_service_pb2.DenoiserServiceLoadLorasResponse(loaded=loaded)

    async def UnloadLoras(self, request, context: grpc.aio.ServicerContext):
        names = tuple(request.names)
        self.engine.check_lora_names(names, load=False)
        # Through the slot unless it is free and none is loaded: a job in flight may be loading one of them.
        held = self._busy or not set(names).isdisjoint(self.engine.loras_loaded())
        loaded = await self._admin(UNLOADING_LORAS, self.engine.unload_loras, names) if names and held else \
            self.engine.loras_loaded()
        return denoiser_service_pb2.DenoiserServiceUnloadLorasResponse(loaded=loaded)

    async def _admin(self, marker: str, fn: Callable[[tuple[str, ...]], tuple[str, ...]],
                     names: tuple[str, ...]) -> tuple[str, ...]:
        """Run ``fn(names)`` on the worker thread holding the slot, as a job would (shown busy, owner empty and
        request_id ``marker``), after any job holding it: the call's deadline bounds the wait. A caller that goes
        away once it runs does not stop it: the slot frees when the thread returns."""
        while self._busy:
            await self._idle.wait()
        self._take_slot("", marker)
        work = asyncio.ensure_future(self.executor.run(fn, names))
        work.add_done_callback(self._admin_done)
        return await asyncio.shield(work)

    def _admin_done(self, work: asyncio.Future) -> None:
        # The error is read here: its caller may be gone, and asyncio would only say it was never retrieved.
        error = None if work.cancelled() else work.exception()
        if error is not None and not isinstance(error, InvalidArgument):
            log.warning("adapter call failed on the worker thread: %r", error)
        self._free_slot()

    def _take_slot(self, owner: str, request_id: str) -> None:
        self._busy = True
        self._idle.clear()
        self.occupancy.take(owner, request_id)
        metrics.BUSY.inc()
        self._holding += 1  # its own count of holders of the slot, kept apart from the flag that guards it
        if self._holding > self._holding_max:
            self._holding_max = self._holding
            metrics.BUSY_MAX.set(self._holding)

    def _free_slot(self) -> None:
        self._busy = False
        self._idle.set()
        self.occupancy.release(self.engine.loras_loaded())
        self._holding -= 1
        metrics.BUSY.dec()

    async def Denoise(self, request, context: grpc.aio.ServicerContext):
        result = await self._execute(request, 0, context)
        return result_to_proto(result)

    async def DenoiseStream(self, request, context: grpc.aio.ServicerContext
                            ) -> AsyncIterator[denoiser_service_pb2.DenoiseStreamResponse]:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[JobEvent | None] = asyncio.Queue()

        def emit(event: JobEvent) -> None:  # runs on the worker thread
            loop.call_soon_threadsafe(events.put_nowait, event)

        task = asyncio.ensure_future(self._execute(request.job, request.partial_images, context, emit))
        # The worker's events were queued before its result reached the loop, so None really comes last.
        task.add_done_callback(lambda _: events.put_nowait(None))
        try:
            while (event := await events.get()) is not None:
                yield event_to_proto(event)
            result = task.result()
        finally:
            task.cancel()  # a no-op once done; when the stream is cancelled, stops the job at its next step
        yield denoiser_service_pb2.DenoiseStreamResponse(result=result_to_proto(result))

    async def _slot_after_stopping_job(self) -> bool:
        """Wait for the slot, but only while the job holding it is stopping; True once it is free.

        A gateway dispatches the next job the moment it has cancelled the previous one, while that job's thread
        still finishes its step: refusing "busy" then would fail a healthy request for nothing.
        """
        for _ in range(3):  # a cancel sent on the same connection just before this call is processed first
            await asyncio.sleep(0)
        while self._busy:
            job = self.current_job
            if job is None or not job.stopping():
                return False
            await self._idle.wait()  # the RPC's own deadline bounds this wait
        return True

    async def _execute(self, request: denoiser_service_pb2.DenoiseRequest, partial_images: int,
                       context: grpc.aio.ServicerContext,
                       emit: Callable[[JobEvent], None] | None = None) -> DenoiseResult:
        """Validate, take the slot (or refuse), run on the worker thread, stop it if the caller goes away."""
        try:
            # Bounded before anything keeps them: the owner and the id go out to every gateway that follows this
            # denoiser's occupancy (a 1 MB owner once did).
            check_id(request.owner, "owner")
            check_id(request.request_id, "request_id")
            job = self.engine.validate(job_from_proto(request, partial_images))
        except InvalidArgument:
            metrics.JOBS.labels(Outcome.INVALID).inc()
            raise
        if self._busy and not await self._slot_after_stopping_job():
            metrics.JOBS.labels(Outcome.REJECTED_BUSY).inc()
            held = self.occupancy.state
            # The holder and the sequence let a gateway tell another gateway's job (send this one elsewhere at
            # once, not a failed attempt) and order this refusal against the occupancy stream it follows.
            raise ResourceExhausted("busy: this denoiser runs one job at a time", reason=DENOISER_BUSY,
                                    info={"owner": held.owner, "sequence": str(held.sequence)})
        self._take_slot(request.owner, request.request_id)
        loop, taken = asyncio.get_running_loop(), self.occupancy.state.sequence

        def on_event(event: JobEvent) -> None:  # on the worker thread: every gateway's status shows the step
            if isinstance(event, StepProgress):
                loop.call_soon_threadsafe(self.occupancy.progress, taken, event.step, event.total_steps)
            if emit is not None:
                emit(event)

        control = JobControl(deadline=rpc_deadline(context), on_event=on_event)
        record = JobRecord(steps=job.steps, partial_images=job.partial_images, control=control)
        self.current_job = record
        work = asyncio.ensure_future(self.executor.run(self.engine.run, job, control))
        # Registered before the caller awaits, so the slot is free by the time the caller sees the outcome.
        work.add_done_callback(functools.partial(self._finish, record, time.perf_counter()))
        try:
            result = await asyncio.shield(work)
        except asyncio.CancelledError:
            # Client cancel or deadline: stop at the next step; the slot frees when the thread returns.
            record.steps_at_cancel = control.steps_done
            passed = control.deadline is not None and time.monotonic() >= control.deadline - DEADLINE_SLACK_S
            record.cancel_reason = CancelReason.DEADLINE if passed else CancelReason.CLIENT
            control.cancel.set()
            log.info("stopping the job after %d of %d step(s): %s", control.steps_done, job.steps,
                     "deadline passed" if passed else "client cancelled")
            raise
        # The call's server span (runtime.server; non-recording with traces off): the job's stages.
        trace.get_current_span().set_attributes({
            "glmimage.denoise.prepare_seconds": result.prepare_seconds,
            "glmimage.denoise.lora_load_seconds": result.lora_load_seconds,
            "glmimage.denoise.denoise_seconds": result.denoise_seconds,
            "glmimage.denoise.decode_seconds": result.decode_seconds,
            "glmimage.denoise.encode_seconds": result.encode_seconds,
            "glmimage.denoise.steps": result.steps_completed})
        log.info("denoised %dx%d in %d step(s): denoise %.3fs decode %.3fs encode %.3fs", result.width,
                 result.height, result.steps_completed, result.denoise_seconds, result.decode_seconds,
                 result.encode_seconds)
        return result

    def _finish(self, record: JobRecord, started: float, work: asyncio.Future) -> None:
        """The worker thread has returned: record the outcome, observe metrics, free the slot."""
        error = None if work.cancelled() else work.exception()
        record.seconds = time.perf_counter() - started
        if work.cancelled() or isinstance(error, (Cancelled, DeadlineExceeded)):
            record.outcome = Outcome.CANCELLED
            if record.cancel_reason is None:  # the engine saw the deadline before gRPC cancelled the call
                record.cancel_reason = (CancelReason.DEADLINE if isinstance(error, DeadlineExceeded)
                                        else CancelReason.CLIENT)
            metrics.CANCELLED_JOBS.labels(record.cancel_reason).inc()
            if record.steps_at_cancel is not None:
                metrics.STEPS_AFTER_CANCEL.observe(record.steps_done - record.steps_at_cancel)
            log.info("job stopped after %d of %d step(s)", record.steps_done, record.steps)
        elif isinstance(error, InvalidArgument):
            # A reference whose header passed validation but whose data does not decode: found on the worker,
            # where references are decoded, still the request's fault.
            record.outcome = Outcome.INVALID
        elif error is not None:
            record.outcome = Outcome.FAILED
            if record.cancel_reason is not None:  # nobody is left to report it to
                log.warning("abandoned job failed after %d step(s): %r", record.steps_done, error)
        else:
            record.outcome = Outcome.OK
            result: DenoiseResult = work.result()
            metrics.DENOISE_SECONDS.observe(result.denoise_seconds)
            metrics.DECODE_SECONDS.observe(result.decode_seconds)
            metrics.ENCODE_SECONDS.observe(result.encode_seconds)
        metrics.JOBS.labels(record.outcome).inc()
        for seconds in record.control.step_seconds:
            metrics.STEP_SECONDS.observe(seconds)
        # Every step that ran, whatever the job's outcome: computed in full, or extrapolated by the step cache.
        metrics.STEPS.labels(StepKind.CACHED).inc(record.control.steps_cached)
        metrics.STEPS.labels(StepKind.FULL).inc(record.control.steps_done - record.control.steps_cached)
        self.current_job = None
        self.last_job = record
        self._free_slot()
