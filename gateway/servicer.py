"""GatewayService over gRPC: validate at the edge, hand the request to the driver, shape the reply."""
from __future__ import annotations

import asyncio
import logging

import grpc

from gateway import scheduler as sch
from gateway.config import GatewayConfig
from gateway.driver import Driver, RequestFailed
from glmimage.v1 import common_pb2, gateway_service_pb2, gateway_service_pb2_grpc
from services.runtime.errors import InvalidArgument, error_for
from services.runtime.logs import request_id_var

log = logging.getLogger(__name__)

STATE_TO_PROTO = {
    sch.WorkerState.AVAILABLE: gateway_service_pb2.WORKER_STATE_AVAILABLE,
    sch.WorkerState.BUSY: gateway_service_pb2.WORKER_STATE_BUSY,
    sch.WorkerState.UNHEALTHY: gateway_service_pb2.WORKER_STATE_UNHEALTHY,
    sch.WorkerState.DRAINING: gateway_service_pb2.WORKER_STATE_DRAINING,
}
ROLE_TO_PROTO = {sch.WorkerRole.AR: gateway_service_pb2.WORKER_ROLE_AR,
                 sch.WorkerRole.DENOISER: gateway_service_pb2.WORKER_ROLE_DENOISER}


def sum_usage(usages) -> common_pb2.Usage:
    total = common_pb2.Usage()
    for u in usages:
        total.prompt_tokens += u.prompt_tokens
        total.completion_tokens += u.completion_tokens
        total.total_tokens += u.total_tokens
        total.reasoning_tokens += u.reasoning_tokens
        total.cached_tokens += u.cached_tokens
    return total


class GatewayServicer(gateway_service_pb2_grpc.GatewayServiceServicer):
    def __init__(self, driver: Driver, config: GatewayConfig) -> None:
        self.driver = driver
        self.config = config

    def _validate(self, r: gateway_service_pb2.GenerateImagesRequest) -> tuple[int, int, int]:
        if not r.prompt.strip():
            raise InvalidArgument("prompt", "must not be empty")
        n = r.n or 1
        if not 1 <= n <= self.config.max_n:
            raise InvalidArgument("n", f"must be between 1 and {self.config.max_n}, got {r.n}")
        if r.HasField("output_compression") and r.output_compression > 100:
            raise InvalidArgument("output_compression", f"must be between 0 and 100, got {r.output_compression}")
        if r.output_format not in common_pb2.ImageFormat.values():
            raise InvalidArgument("output_format", f"unknown format {r.output_format}")
        if (r.height == 0) != (r.width == 0):
            raise InvalidArgument("height" if r.height == 0 else "width", "give both height and width, or neither")
        height = r.height or self.config.default_height
        width = r.width or self.config.default_width
        return n, height, width

    async def GenerateImages(self, request, context: grpc.aio.ServicerContext):
        n, height, width = self._validate(request)
        rid = request_id_var.get()
        timeout = self.config.request_timeout
        remaining = context.time_remaining()
        if remaining is not None:
            timeout = min(timeout, remaining)
        try:
            outcome = await self.driver.generate(rid, request, height, width, n, timeout)
        except RequestFailed as exc:
            raise error_for(exc.code, exc.message) from None
        except asyncio.CancelledError:
            log.info("client went away; request cancelled downstream")
            raise
        images = [gateway_service_pb2.GeneratedImage(index=i, image=img.image, seed=prior.seed, usage=prior.usage)
                  for i, (img, prior) in enumerate(zip(outcome.images, outcome.priors, strict=True))]
        log.info("completed %d image(s) at %dx%d", len(images), width, height)
        return gateway_service_pb2.GenerateImagesResponse(
            images=images, usage=sum_usage(p.usage for p in outcome.priors), height=height, width=width,
            output_format=outcome.images[0].output_format, request_id=rid)

    async def GetStatus(self, request, context: grpc.aio.ServicerContext):
        snap = self.driver.snapshot()
        return gateway_service_pb2.GetStatusResponse(
            pending_ar_requests=snap.pending_ar_requests, pending_ar_outputs=snap.pending_ar_outputs,
            pending_denoise_outputs=snap.pending_denoise_outputs, active_requests=snap.active_requests,
            workers=[gateway_service_pb2.WorkerStatus(
                address=w.address, role=ROLE_TO_PROTO[w.role], state=STATE_TO_PROTO[w.state], inflight=w.inflight,
                current_job=(f"{w.current_job.request_id}/{w.current_job.index}#{w.current_job.attempt}"
                             if w.current_job else ""))
                for w in snap.workers])
