"""The scripted gateway of tests/support/fake_gateway.py (calls recorded, failures injected), with LoRA adapters.

It holds a catalogue and two denoisers' loaded adapters, as the contract describes (gateway_service.proto):
ListLoras shows placement to the admin key only, LoadLoras and UnloadLoras refuse other keys, and a generation that
names an unknown adapter is INVALID_ARGUMENT on loras. Its images name the adapters they ran with (``lora_image``),
so a test can tell what the request carried.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc

from glmimage.v1 import common_pb2, gateway_service_pb2
from tests.support.fake_gateway import FakeGateway, FakeServer, serve_fake

__all__ = ["ADMIN_KEY", "BROKEN", "CATALOGUE", "DENOISERS", "FakeLoraGateway", "FakeServer", "lora_image",
           "sent_loras", "serve_fake_loras"]

ADMIN_KEY = "sk-admin"
DENOISERS = ("10.0.0.2:50061", "10.0.0.3:50061")
CATALOGUE = (common_pb2.LoraInfo(name="tiny-style", description="a demo style", default_scale=1.0, size_bytes=12345),
             common_pb2.LoraInfo(name="ink", description="", default_scale=0.75, size_bytes=2048))
# A denoiser that answers LoadLoras with this error, so a placement with an error can be shown.
BROKEN = "10.0.0.9:50061"


def sent_loras(fake: FakeServer) -> list[tuple[str, float | None]]:
    """(name, scale, or None when unset) of each adapter the last call carried."""
    req = fake.servicer.calls[-1].request
    req = getattr(req, "request", req)  # a stream request wraps the GenerateImagesRequest
    return [(ref.name, ref.scale if ref.HasField("scale") else None) for ref in req.loras]


def lora_image(r: gateway_service_pb2.GenerateImagesRequest) -> bytes:
    """What the fake returns: the prompt and each adapter with its scale ("-" when unset, the default)."""
    refs = ",".join(f"{ref.name}={ref.scale if ref.HasField('scale') else '-'}" for ref in r.loras)
    return f"PNG:{r.prompt}:{refs}".encode()


def _initially_loaded() -> dict[str, list[str]]:
    return {DENOISERS[0]: ["tiny-style"], DENOISERS[1]: []}


@dataclass
class FakeLoraGateway(FakeGateway):
    loaded: dict[str, list[str]] = field(default_factory=_initially_loaded)

    def reset(self) -> None:
        super().reset()
        with self.lock:
            self.loaded = _initially_loaded()

    def _enter(self, method: str, request, context: grpc.ServicerContext) -> bool:  # type: ignore[override]
        """FakeGateway's (recorded, maybe failed); True when the call carries the admin key."""
        super()._enter(method, request, context)
        return dict(context.invocation_metadata()).get("authorization") == f"Bearer {ADMIN_KEY}"

    def _check(self, names: list[str], context: grpc.ServicerContext, field_name: str) -> None:
        known = {info.name for info in CATALOGUE}
        for i, name in enumerate(names):
            if name not in known:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"{field_name}[{i}]: unknown LoRA adapter {name!r} (ListLoras names them)")

    def _response(self, r: gateway_service_pb2.GenerateImagesRequest) -> gateway_service_pb2.GenerateImagesResponse:
        image = gateway_service_pb2.GeneratedImage(index=0, image=lora_image(r), seed=r.seed)
        return gateway_service_pb2.GenerateImagesResponse(images=[image], height=r.height or 256,
                                                          width=r.width or 256, request_id="fake-rid",
                                                          output_format=common_pb2.IMAGE_FORMAT_PNG)

    def GenerateImages(self, request, context):
        self._enter("GenerateImages", request, context)
        self._check([ref.name for ref in request.loras], context, "loras")
        return self._response(request)

    def GenerateImagesStream(self, request, context):
        self._enter("GenerateImagesStream", request, context)
        self._check([ref.name for ref in request.request.loras], context, "loras")
        yield gateway_service_pb2.GenerateImagesStreamResponse(
            progress=gateway_service_pb2.ImageProgress(image_index=0, step=1, total_steps=1))
        yield gateway_service_pb2.GenerateImagesStreamResponse(completed=self._response(request.request))

    def GetStatus(self, request, context):
        admin = self._enter("GetStatus", request, context)
        workers = [gateway_service_pb2.WorkerStatus(address="10.0.0.1:50051" if admin else "",
                                                    role=gateway_service_pb2.WORKER_ROLE_AR,
                                                    state=gateway_service_pb2.WORKER_STATE_AVAILABLE)]
        with self.lock:
            workers += [gateway_service_pb2.WorkerStatus(address=address if admin else "",
                                                         role=gateway_service_pb2.WORKER_ROLE_DENOISER,
                                                         state=gateway_service_pb2.WORKER_STATE_AVAILABLE,
                                                         loras_loaded=loaded)
                        for address, loaded in self.loaded.items()]
        return gateway_service_pb2.GetStatusResponse(workers=workers)

    def _placement(self) -> list[gateway_service_pb2.LoraPlacement]:
        with self.lock:
            return [gateway_service_pb2.LoraPlacement(worker=w, loaded=names) for w, names in self.loaded.items()]

    def ListLoras(self, request, context):
        admin = self._enter("ListLoras", request, context)
        return gateway_service_pb2.ListLorasResponse(loras=CATALOGUE, placement=self._placement() if admin else [])

    def _change(self, method: str, request, context, load: bool) -> list[gateway_service_pb2.LoraPlacement]:
        if not self._enter(method, request, context):
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{method} needs the admin role")
        self._check(list(request.names), context, "names")
        placement = []
        with self.lock:
            for worker in request.workers or list(self.loaded):
                if worker == BROKEN:
                    placement.append(gateway_service_pb2.LoraPlacement(
                        worker=worker, error="UNAVAILABLE: the denoiser is not reachable"))
                    continue
                if worker not in self.loaded:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"workers: {worker} is no denoiser of the pool")
                held = [n for n in self.loaded[worker] if n not in request.names]
                self.loaded[worker] = held + list(request.names) if load else held
                placement.append(gateway_service_pb2.LoraPlacement(worker=worker, loaded=self.loaded[worker]))
        return placement

    def LoadLoras(self, request, context):
        return gateway_service_pb2.LoadLorasResponse(placement=self._change("LoadLoras", request, context, True))

    def UnloadLoras(self, request, context):
        return gateway_service_pb2.UnloadLorasResponse(placement=self._change("UnloadLoras", request, context, False))


@contextlib.contextmanager
def serve_fake_loras() -> Iterator[FakeServer]:
    """The scripted gateway on an ephemeral loopback port (plaintext); stopped on exit."""
    with serve_fake(servicer=FakeLoraGateway()) as server:
        yield server
