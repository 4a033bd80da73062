"""The scripted GatewayService of the SDK and CLI tests, on a real (threaded) gRPC server.

It records every call with its metadata and can fail the next calls of a method with chosen status codes; some
prompts have special behaviour ("block", "midstream", "invalid"). ListLoras answers with ``loras``, and a request
naming an adapter not among them is refused as the gateway refuses it. Its images are not images: ``fake_image`` names
what they hold, so a test can tell which prompt, index and seed an output came from. An edit (reference images)
counts IMAGE_TOKENS_PER_REFERENCE prompt tokens per reference, reported as image_tokens.
"""
from __future__ import annotations

import contextlib
import threading
from collections import defaultdict
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from glmimage.v1 import common_pb2, gateway_service_pb2, gateway_service_pb2_grpc
from runtime.details import rich_status
from runtime.errors import InvalidArgument

DEFAULT_STEPS = 4
IMAGE_TOKENS_PER_REFERENCE = 64
GATEWAY_SERVICE = gateway_service_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name
EXT = {common_pb2.IMAGE_FORMAT_JPEG: b"JPEG", common_pb2.IMAGE_FORMAT_WEBP: b"WEBP"}


def fake_image(prompt: str, index: int, seed: int, fmt: int = common_pb2.IMAGE_FORMAT_PNG) -> bytes:
    return EXT.get(fmt, b"PNG") + f":{prompt}:{index}:{seed}".encode()


@dataclass
class Call:
    method: str
    request: object
    metadata: dict[str, str]


@dataclass
class FakeGateway(gateway_service_pb2_grpc.GatewayServiceServicer):
    """Scripted GatewayService. ``fail[method]`` holds status codes for the next calls of that method."""

    calls: list[Call] = field(default_factory=list)
    fail: dict[str, list[grpc.StatusCode]] = field(default_factory=lambda: defaultdict(list))
    # Prompts with special behaviour: "block" waits until the client goes away; "midstream" fails after one event
    # (UNAVAILABLE, as a gateway going away) while ``midstream_fails``, else streams to its end.
    midstream_fails: bool = True
    cancelled: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    # The LoRA adapters ListLoras answers with; a request naming another is refused as the gateway's admission
    # refuses it (INVALID_ARGUMENT, field "loras").
    loras: list[common_pb2.LoraInfo] = field(default_factory=list)

    def reset(self) -> None:
        with self.lock:
            self.calls.clear()
            self.fail.clear()
            self.loras = []
        self.cancelled.clear()

    def methods(self) -> list[str]:
        return [c.method for c in self.calls]

    def _enter(self, method: str, request, context: grpc.ServicerContext) -> None:
        with self.lock:
            self.calls.append(Call(method, request, dict(context.invocation_metadata())))
            code = self.fail[method].pop(0) if self.fail[method] else None
        if code is not None:
            context.abort(code, f"injected {code.name}")

    def _check_loras(self, request: gateway_service_pb2.GenerateImagesRequest, context: grpc.ServicerContext) -> None:
        known = {info.name for info in self.loras}
        for ref in request.loras:
            if ref.name not in known:
                context.abort_with_status(rich_status(InvalidArgument("loras", f"unknown adapter {ref.name!r}")))

    def _block_until_cancelled(self, context: grpc.ServicerContext) -> None:
        gone = threading.Event()
        # add_callback refuses (False) once the RPC has ended: a client that left before we got here is gone already.
        if not context.add_callback(gone.set):
            gone.set()
        gone.wait(30)
        self.cancelled.set()

    def _response(self, r: gateway_service_pb2.GenerateImagesRequest) -> gateway_service_pb2.GenerateImagesResponse:
        n = r.n or 1
        height, width = r.height or 256, r.width or 256
        seed = r.seed if r.HasField("seed") else 1000
        image_tokens = IMAGE_TOKENS_PER_REFERENCE * len(r.reference_images)
        prompt_tokens = len(r.prompt.split()) + image_tokens
        images = []
        for i in range(n):
            completion = (height // 16) * (width // 16) + 1
            usage = common_pb2.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion,
                                     total_tokens=prompt_tokens + completion, image_tokens=image_tokens)
            images.append(gateway_service_pb2.GeneratedImage(
                index=i, image=fake_image(r.prompt, i, seed + i, r.output_format), seed=seed + i, usage=usage))
        total = common_pb2.Usage(prompt_tokens=sum(im.usage.prompt_tokens for im in images),
                                 completion_tokens=sum(im.usage.completion_tokens for im in images),
                                 total_tokens=sum(im.usage.total_tokens for im in images),
                                 image_tokens=sum(im.usage.image_tokens for im in images))
        # Deliberately out of order: clients must sort by index.
        return gateway_service_pb2.GenerateImagesResponse(
            images=list(reversed(images)), usage=total, height=height, width=width,
            output_format=r.output_format or common_pb2.IMAGE_FORMAT_PNG, request_id=r.request_id or "fake-rid")

    def GenerateImages(self, request, context):
        self._enter("GenerateImages", request, context)
        self._check_loras(request, context)
        if request.prompt == "block":
            self._block_until_cancelled(context)
            context.abort(grpc.StatusCode.CANCELLED, "client went away")
        if request.prompt == "invalid":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt: not allowed")
        return self._response(request)

    def GenerateImagesStream(self, request, context):
        self._enter("GenerateImagesStream", request, context)
        r = request.request
        self._check_loras(r, context)
        if r.prompt == "block":
            # Registered before the first message: a client that leaves right after it may be gone before grpc asks
            # this generator for the next one (then it never resumes), and the cancel must still be seen.
            context.add_callback(self.cancelled.set)
        steps = r.num_inference_steps or DEFAULT_STEPS
        for i in range(r.n or 1):
            for step in range(1, steps + 1):
                yield gateway_service_pb2.GenerateImagesStreamResponse(
                    progress=gateway_service_pb2.ImageProgress(image_index=i, step=step, total_steps=steps))
                if r.prompt == "midstream" and self.midstream_fails:
                    context.abort(grpc.StatusCode.UNAVAILABLE, "worker lost")
                if r.prompt == "block":
                    self._block_until_cancelled(context)
                    return
            for k in range(request.partial_images):
                yield gateway_service_pb2.GenerateImagesStreamResponse(
                    partial_image=gateway_service_pb2.ImagePartial(image_index=i, partial_image_index=k,
                                                                   image=b"partial:%d:%d" % (i, k)))
        yield gateway_service_pb2.GenerateImagesStreamResponse(completed=self._response(r))

    def GetStatus(self, request, context):
        self._enter("GetStatus", request, context)
        return gateway_service_pb2.GetStatusResponse(
            pending_ar_requests=1, pending_ar_outputs=2, pending_denoise_outputs=3, active_requests=4,
            workers=[gateway_service_pb2.WorkerStatus(address="10.0.0.1:50051", role=gateway_service_pb2.WORKER_ROLE_AR,
                                                      state=gateway_service_pb2.WORKER_STATE_AVAILABLE),
                     gateway_service_pb2.WorkerStatus(address="10.0.0.2:50061",
                                                      role=gateway_service_pb2.WORKER_ROLE_DENOISER,
                                                      state=gateway_service_pb2.WORKER_STATE_BUSY, inflight=1,
                                                      current_job="req-1/0#1")])

    def ListLoras(self, request, context):
        self._enter("ListLoras", request, context)
        return gateway_service_pb2.ListLorasResponse(loras=self.loras)

    def AddWorker(self, request, context):
        self._enter("AddWorker", request, context)
        return gateway_service_pb2.AddWorkerResponse()

    def RemoveWorker(self, request, context):
        self._enter("RemoveWorker", request, context)
        return gateway_service_pb2.RemoveWorkerResponse()


@dataclass
class FakeServer:
    servicer: FakeGateway
    address: str
    server: grpc.Server
    # grpc.health.v1, when served (``with_health``): the test sets each service's status.
    health: health.HealthServicer | None = None


@contextlib.contextmanager
def serve_fake(credentials: grpc.ServerCredentials | None = None, *, with_reflection: bool = False,
               with_health: bool = False, servicer: FakeGateway | None = None) -> Iterator[FakeServer]:
    """The scripted gateway on an ephemeral loopback port, plaintext or with `credentials`; stopped on exit.
    ``with_reflection`` serves grpc reflection too, as the real servers do, so grpcurl can call it.
    ``with_health`` serves grpc.health.v1 (every service SERVING until the test says otherwise). ``servicer``: a
    FakeGateway of a test's own (a subclass scripting more), instead of a plain one."""
    servicer = FakeGateway() if servicer is None else servicer
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    gateway_service_pb2_grpc.add_GatewayServiceServicer_to_server(servicer, server)
    health_servicer = None
    if with_health:
        health_servicer = health.HealthServicer()
        for name in ("", GATEWAY_SERVICE):
            health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if with_reflection:
        service = gateway_service_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name
        reflection.enable_server_reflection((service, reflection.SERVICE_NAME), server)
    if credentials is None:
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    try:
        yield FakeServer(servicer, f"127.0.0.1:{port}", server, health_servicer)
    finally:
        server.stop(None)
