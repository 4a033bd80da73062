"""The scripted gateway of tests/support/fake_gateway.py (which bills each reference image as
IMAGE_TOKENS_PER_REFERENCE image tokens per output), serving GetLimits from its ``limits``."""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

from glmimage.v1 import gateway_service_pb2
from runtime.limits import Limits
from tests.support.fake_gateway import IMAGE_TOKENS_PER_REFERENCE, FakeGateway, FakeServer, serve_fake

__all__ = ["IMAGE_TOKENS_PER_REFERENCE", "EditGateway", "serve_edit_fake"]


@dataclasses.dataclass
class EditGateway(FakeGateway):
    limits: Limits = Limits()

    def reset(self) -> None:
        super().reset()
        self.limits = Limits()

    def GetLimits(self, request, context):
        return gateway_service_pb2.GetLimitsResponse(limits=self.limits.to_proto())


@contextlib.contextmanager
def serve_edit_fake() -> Iterator[FakeServer]:
    """EditGateway on an ephemeral loopback port (plaintext); stopped on exit."""
    with serve_fake(servicer=EditGateway()) as server:
        yield server
