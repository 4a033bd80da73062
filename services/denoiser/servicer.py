"""DenoiserService over gRPC: batch 1, refusing rather than queueing, and stopping work nobody waits for."""
from __future__ import annotations

import asyncio
import logging

import grpc

from glmimage.v1 import common_pb2, denoiser_service_pb2, denoiser_service_pb2_grpc
from services.denoiser.encoding import ImageFormat
from services.denoiser.engine import DenoiseEngine, DenoiseJob, DenoiseResult, JobControl
from services.runtime.errors import ResourceExhausted
from services.runtime.executor import SerialExecutor

log = logging.getLogger(__name__)

FORMAT_FROM_PROTO = {
    common_pb2.IMAGE_FORMAT_UNSPECIFIED: ImageFormat.PNG,
    common_pb2.IMAGE_FORMAT_PNG: ImageFormat.PNG,
    common_pb2.IMAGE_FORMAT_JPEG: ImageFormat.JPEG,
    common_pb2.IMAGE_FORMAT_WEBP: ImageFormat.WEBP,
}
FORMAT_TO_PROTO = {
    ImageFormat.PNG: common_pb2.IMAGE_FORMAT_PNG,
    ImageFormat.JPEG: common_pb2.IMAGE_FORMAT_JPEG,
    ImageFormat.WEBP: common_pb2.IMAGE_FORMAT_WEBP,
}


def job_from_proto(msg: denoiser_service_pb2.DenoiseRequest) -> DenoiseJob:
    return DenoiseJob(
        prompt=msg.prompt, token_ids=list(msg.prior_tokens.token_ids), height=msg.height, width=msg.width,
        steps=msg.num_inference_steps,
        guidance_scale=msg.guidance_scale if msg.HasField("guidance_scale") else None,
        seed=msg.seed if msg.HasField("seed") else None,
        output_format=FORMAT_FROM_PROTO.get(msg.output_format, ImageFormat.PNG),
        output_compression=msg.output_compression if msg.HasField("output_compression") else None)


def result_to_proto(r: DenoiseResult) -> denoiser_service_pb2.DenoiseResponse:
    return denoiser_service_pb2.DenoiseResponse(
        image=r.image, output_format=FORMAT_TO_PROTO[r.output_format], height=r.height, width=r.width,
        steps_completed=r.steps_completed, seed=r.seed,
        timings=denoiser_service_pb2.DenoiseTimings(denoise_seconds=r.denoise_seconds,
                                                   decode_seconds=r.decode_seconds,
                                                   encode_seconds=r.encode_seconds))


class DenoiserServicer(denoiser_service_pb2_grpc.DenoiserServiceServicer):
    def __init__(self, engine: DenoiseEngine, executor: SerialExecutor) -> None:
        self.engine = engine
        self.executor = executor
        # Held from acceptance until the worker thread really stops, not just until the RPC ends,
        # so a cancelled job can never overlap the next one.
        self._busy = False

    @property
    def busy(self) -> bool:
        return self._busy

    def _release(self, _: object = None) -> None:
        self._busy = False

    async def Denoise(self, request, context: grpc.aio.ServicerContext):
        job = self.engine.validate(job_from_proto(request))
        if self._busy:
            raise ResourceExhausted("busy: this denoiser runs one job at a time")
        self._busy = True
        control = JobControl()
        work = asyncio.ensure_future(self.executor.run(self.engine.run, job, control))
        work.add_done_callback(self._release)
        try:
            result = await asyncio.shield(work)
        except asyncio.CancelledError:
            # Client cancel or deadline: stop at the next step; the slot frees when the thread returns.
            control.cancel.set()
            work.add_done_callback(lambda f: f.cancelled() or f.exception())  # consume the Cancelled error
            log.info("job cancelled by the caller after %d step(s)", control.steps_done)
            raise
        log.info("denoised %dx%d in %d step(s): denoise %.3fs decode %.3fs encode %.3fs", result.width,
                 result.height, result.steps_completed, result.denoise_seconds, result.decode_seconds,
                 result.encode_seconds)
        return result_to_proto(result)
