"""The scripted gateway of tests/support/fake_gateway.py, billing edits as the real one does (each reference image
adds IMAGE_TOKENS_PER_REFERENCE prompt tokens per output, reported again as the usage's image_tokens) and serving
GetLimits from its ``limits``."""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from concurrent import futures

import grpc

from glmimage.v1 import common_pb2, gateway_service_pb2, gateway_service_pb2_grpc
from services.runtime.limits import Limits
from tests.support.fake_gateway import FakeGateway, FakeServer

IMAGE_TOKENS_PER_REFERENCE = 100


def _add_image_tokens(usage: common_pb2.Usage, tokens: int) -> None:
    usage.prompt_tokens += tokens
    usage.total_tokens += tokens
    usage.image_tokens += tokens


@dataclasses.dataclass
class EditGateway(FakeGateway):
    limits: Limits = Limits()

    def reset(self) -> None:
        super().reset()
        self.limits = Limits()

    def GetLimits(self, request, context):
        return gateway_service_pb2.GetLimitsResponse(limits=self.limits.to_proto())

    def _response(self, r: gateway_service_pb2.GenerateImagesRequest) -> gateway_service_pb2.GenerateImagesResponse:
        resp = super()._response(r)
        per_output = IMAGE_TOKENS_PER_REFERENCE * len(r.reference_images)
        for image in resp.images:
            _add_image_tokens(image.usage, per_output)
        _add_image_tokens(resp.usage, per_output * len(resp.images))
        return resp


@contextlib.contextmanager
def serve_edit_fake() -> Iterator[FakeServer]:
    """EditGateway on an ephemeral loopback port (plaintext); stopped on exit."""
    servicer = EditGateway()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    gateway_service_pb2_grpc.add_GatewayServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield FakeServer(servicer, f"127.0.0.1:{port}", server)
    finally:
        server.stop(None)
