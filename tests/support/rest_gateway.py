"""A scripted GatewayService for the REST front's tests (tests/rest/): real grpc.aio, answering with tiny PNGs,
progress and partials, and able to abort, block until cancelled or require an API key, sending a tenant's rate-limit
figures as the gateway does (initial metadata when admitted; a quota refusal's trailing metadata and RetryInfo); and
the front's client helpers.
"""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import grpc
import httpx
from fastapi import FastAPI
from google.protobuf import duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status
from PIL import Image

from glmimage.v1 import common_pb2
from glmimage.v1 import gateway_service_pb2 as gw
from glmimage.v1 import gateway_service_pb2_grpc as gw_grpc
from rest.app import RestSettings, create_app
from runtime.details import OWN_ERROR_KEY, rich_status
from runtime.errors import ServiceError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PROMPT_TOKENS = 11
COMPLETION_TOKENS_PER_IMAGE = 257


def png(index: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (index * 20 % 256, 0, 0)).save(buf, format="PNG")
    return buf.getvalue()


def image_usage(n_images: int = 1, cached: int | None = None) -> dict[str, Any]:
    """The usage object the front reports for `n_images` images of the scripted gateway's answer."""
    usage: dict[str, Any] = {
        "input_tokens": PROMPT_TOKENS * n_images,
        "output_tokens": COMPLETION_TOKENS_PER_IMAGE * n_images,
        "total_tokens": (PROMPT_TOKENS + COMPLETION_TOKENS_PER_IMAGE) * n_images,
        "input_tokens_details": {"text_tokens": PROMPT_TOKENS * n_images, "image_tokens": 0},
        "prompt_tokens": PROMPT_TOKENS * n_images,
        "completion_tokens": COMPLETION_TOKENS_PER_IMAGE * n_images,
        "reasoning_tokens": 0,
        "image_count": n_images,
    }
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return usage


STREAM_STEPS = 4  # denoising steps the fake reports per image when the request leaves it to the server

# A tenant's figures as the gateway sends them (gateway/quotas: OpenAI's names and duration forms).
RATE_LIMITS = (("x-ratelimit-limit-requests", "30"), ("x-ratelimit-remaining-requests", "29"),
               ("x-ratelimit-reset-requests", "2s"), ("x-ratelimit-limit-images", "60"),
               ("x-ratelimit-remaining-images", "57"), ("x-ratelimit-reset-images", "250ms"))
SPENT = (("x-ratelimit-limit-requests", "30"), ("x-ratelimit-remaining-requests", "0"),
         ("x-ratelimit-reset-requests", "12s"), ("x-ratelimit-limit-images", "60"),
         ("x-ratelimit-remaining-images", "31"), ("x-ratelimit-reset-images", "12s"))


def quota_refusal(quota: str = "requests_per_minute", delay: float = 11.2, retry_after: str | None = "12",
                  figures: tuple[tuple[str, str], ...] = SPENT) -> grpc.Status:
    """RESOURCE_EXHAUSTED as the gateway refuses a call past a tenant's quota: a google.rpc.RetryInfo of ``delay``
    seconds, and trailing `retry-after` (None: left out), `x-glmimage-quota` and the spent figures."""
    status = status_pb2.Status(code=code_pb2.RESOURCE_EXHAUSTED,
                               message=f"tenant 'beta' is over its {quota} quota (30 a minute); retry in 12s")
    seconds = int(delay)
    status.details.add().Pack(error_details_pb2.RetryInfo(
        retry_delay=duration_pb2.Duration(seconds=seconds, nanos=int((delay - seconds) * 1e9))))
    composed = rpc_status.to_status(status)
    extra = (*(() if retry_after is None else (("retry-after", retry_after),)), ("x-glmimage-quota", quota))
    return composed._replace(trailing_metadata=(*composed.trailing_metadata, (OWN_ERROR_KEY, "1"), *extra, *figures))


class FakeGateway(gw_grpc.GatewayServiceServicer):
    """Answers GenerateImages with n tiny PNGs, and GenerateImagesStream with progress, partials and the result.

    It can abort (before or mid-stream), block until cancelled, end a stream without a result, require an
    API key like the real gateway, and report cached tokens.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.calls: list[tuple[gw.GenerateImagesRequest, dict[str, str]]] = []
        self.stream_calls: list[tuple[gw.GenerateImagesStreamRequest, dict[str, str]]] = []
        self.abort: tuple[grpc.StatusCode, str] | grpc.Status | None = None
        # Sent as initial metadata on every call it admits (a tenant's rate-limit figures: RATE_LIMITS).
        self.admitted_metadata: tuple[tuple[str, str], ...] = ()
        # GenerateImages fails with this after admitting the call (its initial metadata sent).
        self.fail_after_admit: tuple[grpc.StatusCode, str] | None = None
        self.abort_mid_stream: tuple[grpc.StatusCode, str] | None = None
        self.stream_without_result = False
        self.required_authorization: str | None = None
        self.cached_tokens = 0
        self.block = False
        self.block_after_first = False
        self.started = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.workers = [
            gw.WorkerStatus(address="ar:1", role=gw.WORKER_ROLE_AR, state=gw.WORKER_STATE_AVAILABLE),
            gw.WorkerStatus(address="dn:1", role=gw.WORKER_ROLE_DENOISER, state=gw.WORKER_STATE_BUSY),
        ]
        # ListLoras: the adapters it answers with (none), or this abort; its calls' metadata.
        self.loras: list[common_pb2.LoraInfo] = []
        self.abort_list_loras: tuple | None = None
        self.list_loras_calls: list[dict[str, str]] = []

    async def _admit(self, context: grpc.aio.ServicerContext) -> dict[str, str]:
        metadata = {k: v for k, v in context.invocation_metadata() if isinstance(v, str)}
        if self.required_authorization is not None and metadata.get("authorization") != self.required_authorization:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid API key")
        if self.abort is not None:
            await _abort(context, self.abort)
        if self.admitted_metadata:
            await context.send_initial_metadata(self.admitted_metadata)
        return metadata

    async def _block(self) -> None:
        self.started.set()
        try:
            await asyncio.Event().wait()  # until the client cancels
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    async def GenerateImages(
        self, request: gw.GenerateImagesRequest, context: grpc.aio.ServicerContext
    ) -> gw.GenerateImagesResponse:
        self.calls.append((request, {k: v for k, v in context.invocation_metadata() if isinstance(v, str)}))
        metadata = await self._admit(context)
        if self.block:
            await self._block()
        if self.fail_after_admit is not None:
            await _abort(context, self.fail_after_admit)
        return self._response(request, metadata)

    async def GenerateImagesStream(
        self, request: gw.GenerateImagesStreamRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gw.GenerateImagesStreamResponse]:
        self.stream_calls.append((request, {k: v for k, v in context.invocation_metadata() if isinstance(v, str)}))
        metadata = await self._admit(context)
        if self.block:
            await self._block()
        inner = request.request
        steps = inner.num_inference_steps or STREAM_STEPS
        for index in range(inner.n or 1):
            for step in range(1, steps + 1):
                yield gw.GenerateImagesStreamResponse(
                    progress=gw.ImageProgress(image_index=index, step=step, total_steps=steps))
                if self.block_after_first:
                    await self._block()
                if step <= request.partial_images:
                    yield gw.GenerateImagesStreamResponse(partial_image=gw.ImagePartial(
                        image_index=index, partial_image_index=step - 1, image=png(100 + step)))
        if self.abort_mid_stream is not None:
            await _abort(context, self.abort_mid_stream)
        if not self.stream_without_result:
            yield gw.GenerateImagesStreamResponse(completed=self._response(inner, metadata))

    def _response(self, request: gw.GenerateImagesRequest, metadata: dict[str, str]) -> gw.GenerateImagesResponse:
        n = request.n or 1
        per_image = common_pb2.Usage(
            prompt_tokens=PROMPT_TOKENS,
            completion_tokens=COMPLETION_TOKENS_PER_IMAGE,
            total_tokens=PROMPT_TOKENS + COMPLETION_TOKENS_PER_IMAGE,
            cached_tokens=self.cached_tokens,
        )
        return gw.GenerateImagesResponse(
            images=[gw.GeneratedImage(index=i, image=png(i), seed=i, usage=per_image) for i in range(n)],
            usage=common_pb2.Usage(
                prompt_tokens=PROMPT_TOKENS * n,
                completion_tokens=COMPLETION_TOKENS_PER_IMAGE * n,
                total_tokens=(PROMPT_TOKENS + COMPLETION_TOKENS_PER_IMAGE) * n,
                cached_tokens=self.cached_tokens * n,
            ),
            width=request.width,
            height=request.height,
            output_format=request.output_format or common_pb2.IMAGE_FORMAT_PNG,
            request_id=metadata.get("x-request-id", ""),
        )

    async def GetStatus(
        self, request: gw.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> gw.GetStatusResponse:
        metadata = dict(context.invocation_metadata())
        if self.required_authorization is not None and metadata.get("authorization") != self.required_authorization:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid API key")
        return gw.GetStatusResponse(workers=self.workers, active_requests=0)


    async def ListLoras(self, request: gw.ListLorasRequest, context: grpc.aio.ServicerContext) -> gw.ListLorasResponse:
        metadata = {k: v for k, v in context.invocation_metadata() if isinstance(v, str)}
        self.list_loras_calls.append(metadata)
        if self.required_authorization is not None and metadata.get("authorization") != self.required_authorization:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid API key")
        if self.abort_list_loras is not None:
            await _abort(context, self.abort_list_loras)
        return gw.ListLorasResponse(loras=self.loras)


async def _abort(context: grpc.aio.ServicerContext, abort: tuple | grpc.Status) -> None:
    """Abort as the real gateway does: it marks the statuses it composed. ``(code, text, False)`` leaves the mark
    off, as on a status gRPC made up itself (connection refused...); a grpc.Status (quota_refusal) goes as it is."""
    if isinstance(abort, grpc.Status):
        await context.abort_with_status(abort)
    code, text, *own = abort
    if isinstance(code, ServiceError):  # a domain error: the real gateway's rich status (details and mark)
        await context.abort_with_status(rich_status(code))
    await context.abort(code, text, trailing_metadata=((OWN_ERROR_KEY, "1"),) if not own or own[0] else ())


class Backend:
    def __init__(self, address: str, servicer: FakeGateway, health_servicer: Any) -> None:
        self.address = address
        self.servicer = servicer
        self.health = health_servicer


def asgi_client(app: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


@asynccontextmanager
async def rest_client(settings: RestSettings) -> AsyncIterator[httpx.AsyncClient]:
    """A client for a fresh app (own settings, own metrics registry), lifespan included."""
    app = create_app(settings)
    async with app.router.lifespan_context(app), asgi_client(app) as client:
        yield client



async def generate(client: httpx.AsyncClient, body: Any, **kwargs: Any) -> httpx.Response:
    return await client.post("/v1/images/generations", json=body, **kwargs)


def assert_error(resp: httpx.Response, status: int, param: str | None, code: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    assert err["message"]
    if code is not None:
        assert err["code"] == code, err
    return err


PARTIAL = "image_generation.partial_image"
COMPLETED = "image_generation.completed"
PARTIAL_KEYS = {"type", "b64_json", "created_at", "size", "quality", "background", "output_format",
                "partial_image_index", "image_index"}
COMPLETED_KEYS = {"type", "b64_json", "created_at", "size", "quality", "background", "output_format", "usage",
                  "image_index"}


def parse_sse(text: str) -> tuple[list[tuple[str, dict[str, Any]]], list[str]]:
    """(event name, data) pairs and comment lines; checks each event's data names its own type."""
    events: list[tuple[str, dict[str, Any]]] = []
    comments: list[str] = []
    for block in text.split("\n\n"):
        name, data = None, None
        for line in block.splitlines():
            if line.startswith(":"):
                comments.append(line[1:].strip())
            elif line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                data = json.loads(line.removeprefix("data: "))
        if name is not None:
            assert data is not None and data["type"] == name, block
            events.append((name, data))
    return events, comments
