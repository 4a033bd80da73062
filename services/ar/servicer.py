"""ArService over gRPC: protobuf <-> engine dataclasses at the edge, nothing else."""
from __future__ import annotations

import logging

import grpc

from glmimage.v1 import ar_service_pb2, ar_service_pb2_grpc, common_pb2
from services.ar.engine import ArEngine, ArRequest, ArResult, Sampling
from services.runtime.errors import InvalidArgument
from services.runtime.executor import SerialExecutor

log = logging.getLogger(__name__)


def request_from_proto(msg: ar_service_pb2.GenerateRequest) -> ArRequest:
    s = msg.sampling
    return ArRequest(
        prompt=msg.prompt, n=msg.n, height=msg.height, width=msg.width,
        seed=msg.seed if msg.HasField("seed") else None,
        sampling=Sampling(temperature=s.temperature if s.HasField("temperature") else None,
                          top_p=s.top_p if s.HasField("top_p") else None,
                          top_k=s.top_k if s.HasField("top_k") else None))


def usage_to_proto(u) -> common_pb2.Usage:
    return common_pb2.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                            total_tokens=u.total_tokens, reasoning_tokens=u.reasoning_tokens,
                            cached_tokens=u.cached_tokens)


def result_to_proto(result: ArResult) -> ar_service_pb2.GenerateResponse:
    grid_h, grid_w = result.grid
    return ar_service_pb2.GenerateResponse(
        outputs=[ar_service_pb2.PriorOutput(tokens=common_pb2.TokenRow(token_ids=o.token_ids), seed=o.seed,
                                            usage=usage_to_proto(o.usage)) for o in result.outputs],
        height=result.height, width=result.width, grid_height=grid_h, grid_width=grid_w,
        usage=usage_to_proto(result.usage))


class ArServicer(ar_service_pb2_grpc.ArServiceServicer):
    def __init__(self, engine: ArEngine, executor: SerialExecutor) -> None:
        self.engine = engine
        self.executor = executor

    async def Generate(self, request, context: grpc.aio.ServicerContext):
        req = self.engine.validate(request_from_proto(request))
        (result,) = await self.executor.run(self.engine.generate, [req])
        log.info("generated %d row(s) at %dx%d", req.n, req.height, req.width)
        return result_to_proto(result)

    async def GenerateBatch(self, request, context: grpc.aio.ServicerContext):
        if not request.requests:
            raise InvalidArgument("requests", "must not be empty")
        reqs = []
        for i, r in enumerate(request.requests):
            try:
                reqs.append(self.engine.validate(request_from_proto(r)))
            except InvalidArgument as exc:
                raise InvalidArgument(f"requests[{i}].{exc.field}", exc.message.split(": ", 1)[-1]) from None
        results = await self.executor.run(self.engine.generate, reqs)
        log.info("generated a batch of %d request(s), %d row(s)", len(reqs), sum(r.n for r in reqs))
        return ar_service_pb2.GenerateBatchResponse(responses=[result_to_proto(r) for r in results])
