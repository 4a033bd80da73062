"""OpenAI-compatible REST front (gateway/rest) against a real grpc.aio GatewayService fake."""

from __future__ import annotations

import ast
import asyncio
import base64
import io
import json
import re
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
import pytest_asyncio
from fastapi import FastAPI
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given
from hypothesis import settings as hyp_settings
from hypothesis import strategies as st
from PIL import Image

from gateway.rest import __main__ as rest_main
from gateway.rest.app import RestSettings, create_app
from gateway.rest.schemas import (
    ImageGenCompletedEvent,
    ImageGenerationRequest,
    ImageGenPartialImageEvent,
    ImagesResponse,
)
from glmimage.v1 import common_pb2
from glmimage.v1 import gateway_service_pb2 as gw
from glmimage.v1 import gateway_service_pb2_grpc as gw_grpc
from services.runtime.details import OWN_ERROR_KEY, rich_status
from services.runtime.errors import InvalidArgument, ServiceError
from services.runtime.limits import from_proto
from tests.support.asgi import RawClient
from tests.support.certs import Pki

try:
    import schemathesis
    from schemathesis import GenerationMode
except ImportError:  # without it the hypothesis fuzz below still runs
    schemathesis = None

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PROMPT_TOKENS = 11
COMPLETION_TOKENS_PER_IMAGE = 257


def _png(index: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (index * 20 % 256, 0, 0)).save(buf, format="PNG")
    return buf.getvalue()


STREAM_STEPS = 4  # denoising steps the fake reports per image when the request leaves it to the server


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
        self.abort: tuple[grpc.StatusCode, str] | None = None
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

    async def _admit(self, context: grpc.aio.ServicerContext) -> dict[str, str]:
        metadata = {k: v for k, v in context.invocation_metadata() if isinstance(v, str)}
        if self.required_authorization is not None and metadata.get("authorization") != self.required_authorization:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid API key")
        if self.abort is not None:
            await _abort(context, self.abort)
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
                        image_index=index, partial_image_index=step - 1, image=_png(100 + step)))
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
            images=[gw.GeneratedImage(index=i, image=_png(i), seed=i, usage=per_image) for i in range(n)],
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


async def _abort(context: grpc.aio.ServicerContext, abort: tuple) -> None:
    """Abort as the real gateway does: it marks the statuses it composed. ``(code, text, False)`` leaves the mark
    off, as on a status gRPC made up itself (connection refused...)."""
    code, text, *own = abort
    if isinstance(code, ServiceError):  # a domain error: the real gateway's rich status (details and mark)
        await context.abort_with_status(rich_status(code))
    await context.abort(code, text, trailing_metadata=((OWN_ERROR_KEY, "1"),) if not own or own[0] else ())


class Backend:
    def __init__(self, address: str, servicer: FakeGateway, health_servicer: Any) -> None:
        self.address = address
        self.servicer = servicer
        self.health = health_servicer


@pytest_asyncio.fixture(scope="session")
async def backend() -> AsyncIterator[Backend]:
    server = grpc.aio.server()
    servicer = FakeGateway()
    health_servicer = health.aio.HealthServicer()
    gw_grpc.add_GatewayServiceServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield Backend(f"127.0.0.1:{port}", servicer, health_servicer)
    finally:
        await server.stop(grace=None)


@pytest_asyncio.fixture(autouse=True)
async def _reset(backend: Backend) -> None:
    backend.servicer.reset()
    await backend.health.set("", health_pb2.HealthCheckResponse.SERVING)


def _http(app: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


@asynccontextmanager
async def rest_client(settings: RestSettings) -> AsyncIterator[httpx.AsyncClient]:
    """A client for a fresh app (own settings, own metrics registry), lifespan included."""
    app = create_app(settings)
    async with app.router.lifespan_context(app), _http(app) as client:
        yield client


@pytest_asyncio.fixture(scope="session")
async def app(backend: Backend) -> AsyncIterator[FastAPI]:
    app = create_app(RestSettings(gateway_address=backend.address))
    async with app.router.lifespan_context(app):
        yield app


@pytest_asyncio.fixture(scope="session")
async def client(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    async with _http(app) as c:
        yield c


async def _generate(client: httpx.AsyncClient, body: Any, **kwargs: Any) -> httpx.Response:
    return await client.post("/v1/images/generations", json=body, **kwargs)


def _assert_error(resp: httpx.Response, status: int, param: str | None, code: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    assert err["message"]
    if code is not None:
        assert err["code"] == code, err
    return err


# --- happy path -------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 3])
async def test_generate_shape_and_usage(client: httpx.AsyncClient, backend: Backend, n: int) -> None:
    resp = await _generate(client, {"prompt": "a red fox", "n": n, "size": "512x256", "quality": "low"},
                           headers={"X-Request-Id": "my-req-42"})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert isinstance(body["created"], int)
    assert len(body["data"]) == n
    for item in body["data"]:
        assert base64.b64decode(item["b64_json"]).startswith(PNG_MAGIC)
    assert body["size"] == "512x256"
    assert body["output_format"] == "png"
    assert body["quality"] == "low"
    assert body["background"] == "opaque"
    assert body["usage"] == {
        "input_tokens": PROMPT_TOKENS * n,
        "output_tokens": COMPLETION_TOKENS_PER_IMAGE * n,
        "total_tokens": (PROMPT_TOKENS + COMPLETION_TOKENS_PER_IMAGE) * n,
        "input_tokens_details": {"text_tokens": PROMPT_TOKENS * n, "image_tokens": 0},
        "prompt_tokens": PROMPT_TOKENS * n,
        "completion_tokens": COMPLETION_TOKENS_PER_IMAGE * n,
        "reasoning_tokens": 0,
        "image_count": n,
    }
    assert resp.headers["x-request-id"] == "my-req-42"
    [(req, metadata)] = backend.servicer.calls
    assert metadata["x-request-id"] == "my-req-42"
    assert (req.prompt, req.n, req.width, req.height) == ("a red fox", n, 512, 256)
    assert req.num_inference_steps == 10  # quality=low
    assert not req.HasField("seed") and not req.HasField("guidance_scale")


async def test_defaults_request_id_and_extensions(client: httpx.AsyncClient, backend: Backend) -> None:
    resp = await _generate(client, {
        "prompt": "a cat", "size": "auto", "output_format": "webp", "output_compression": 80, "seed": 7,
        "guidance_scale": 2.5, "num_inference_steps": 12, "quality": "high", "partial_images": 2,
        "user": "u1",
        # OpenAI fields taken and ignored on purpose
        "style": "vivid", "moderation": "low", "safety_identifier": "s1",
    })
    assert resp.status_code == 200, resp.text
    assert resp.json()["size"] == "256x256"
    assert resp.json()["output_format"] == "webp"
    rid = resp.headers["x-request-id"]
    assert re.fullmatch(r"req-[0-9a-f]{32}", rid)
    [(req, metadata)] = backend.servicer.calls
    assert metadata["x-request-id"] == rid
    assert req.request_id == rid
    assert req.output_format == common_pb2.IMAGE_FORMAT_WEBP
    assert req.output_compression == 80 and req.seed == 7 and req.guidance_scale == 2.5
    assert req.num_inference_steps == 12  # overrides quality
    assert "authorization" not in metadata


async def test_zero_steps_means_the_denoiser_default(client: httpx.AsyncClient, backend: Backend) -> None:
    # 0 is the denoiser's default all along the stack (gateway and denoiser read it so), whatever quality says;
    # the schema documents it, and 1001 is refused naming the field.
    resp = await _generate(client, {"prompt": "x", "quality": "high", "num_inference_steps": 0})
    assert resp.status_code == 200, resp.text
    [(req, _)] = backend.servicer.calls
    assert req.num_inference_steps == 0
    _assert_error(await _generate(client, {"prompt": "x", "num_inference_steps": 1001}), 400,
                  "num_inference_steps")
    doc = (await client.get("/openapi.json")).json()
    field = doc["components"]["schemas"]["ImageGenerationRequest"]["properties"]["num_inference_steps"]
    assert "0 means the denoiser's default" in field["description"]
    assert any(branch.get("minimum") == 0 for branch in field.get("anyOf", [field]))


@pytest.mark.parametrize("model", ["glm-image", "gpt-image-1", "dall-e-3", None])
async def test_model_names_accepted(client: httpx.AsyncClient, model: str | None) -> None:
    resp = await _generate(client, {"prompt": "x", "model": model})
    assert resp.status_code == 200, resp.text


async def test_unknown_model_404(client: httpx.AsyncClient, backend: Backend) -> None:
    _assert_error(await _generate(client, {"prompt": "x", "model": "sdxl"}), 404, "model", "model_not_found")
    assert backend.servicer.calls == []


async def test_openai_sdk(app: FastAPI, backend: Backend) -> None:
    async with _http(app) as http:
        sdk = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", max_retries=0, http_client=http)
        res = await sdk.images.generate(model="gpt-image-1", prompt="a lighthouse", n=2, size="256x256")
        assert len(res.data) == 2
        assert base64.b64decode(res.data[0].b64_json).startswith(PNG_MAGIC)
        assert res.usage is not None
        assert res.usage.input_tokens == PROMPT_TOKENS * 2
        assert res.usage.output_tokens == COMPLETION_TOKENS_PER_IMAGE * 2
        assert res.usage.input_tokens_details.text_tokens == PROMPT_TOKENS * 2
        assert res.usage.model_dump()["image_count"] == 2  # the SDK keeps extra fields
        with pytest.raises(openai.NotFoundError):
            await sdk.images.generate(model="nope", prompt="x")
        backend.servicer.abort = (grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")
        with pytest.raises(openai.RateLimitError):
            await sdk.images.generate(prompt="x")


# --- validation ---------------------------------------------------------------------------------


async def test_unknown_fields_are_refused_by_name(client: httpx.AsyncClient, backend: Backend) -> None:
    # A typo must not give an image nobody asked for (the default steps, a random seed): OpenAI refuses it too.
    err = _assert_error(await _generate(client, {"prompt": "x", "num_inference_step": 3, "sead": 1}), 400,
                        "num_inference_step", "unknown_parameter")
    assert "'num_inference_step' (did you mean 'num_inference_steps'?)" in err["message"]
    assert "'sead' (did you mean 'seed'?)" in err["message"]
    # Named before any other fault of the body, which the typo likely explains.
    err = _assert_error(await _generate(client, {"prompt": "x", "n": "two", "x" * 1000: 1}), 400,
                        "x" * 64, "unknown_parameter")
    assert backend.servicer.calls == []


async def test_the_sdk_sends_what_is_accepted_and_nothing_unknown(app: FastAPI, backend: Backend) -> None:
    async with _http(app) as http:
        sdk = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", max_retries=0, http_client=http)
        await sdk.images.generate(prompt="x", size="64x64", style="natural", moderation="auto", user="u",
                                  safety_identifier="s", background="auto")
        with pytest.raises(openai.BadRequestError) as exc:
            await sdk.images.generate(prompt="x", extra_body={"sead": 1})
    assert exc.value.code == "unknown_parameter" and exc.value.param == "sead"
    assert len(backend.servicer.calls) == 1


async def test_openapi_says_which_fields_are_ignored(client: httpx.AsyncClient) -> None:
    schemas = (await client.get("/openapi.json")).json()["components"]["schemas"]
    for model, ignored in (("ImageGenerationRequest", {"style", "moderation", "safety_identifier"}),
                           ("ImageEditRequest", {"input_fidelity", "safety_identifier"})):
        assert schemas[model]["additionalProperties"] is False
        props = schemas[model]["properties"]
        assert {name for name, p in props.items() if p.get("x-ignored")} == ignored
        assert all(props[name]["description"].startswith("Accepted for OpenAI compatibility and ignored")
                   for name in ignored)

BAD_BODIES: list[tuple[str, Any, str | None]] = [
    ("missing prompt", {"n": 1}, "prompt"),
    ("empty prompt", {"prompt": ""}, "prompt"),
    ("blank prompt", {"prompt": "   "}, "prompt"),
    ("prompt not a string", {"prompt": 5}, "prompt"),
    ("n=0", {"prompt": "x", "n": 0}, "n"),
    ("n=11", {"prompt": "x", "n": 11}, "n"),
    ("n as string", {"prompt": "x", "n": "two"}, "n"),
    ("n as float", {"prompt": "x", "n": 1.5}, "n"),
    ("n as bool", {"prompt": "x", "n": True}, "n"),
    ("size garbage", {"prompt": "x", "size": "abc"}, "size"),
    ("size zero", {"prompt": "x", "size": "0x256"}, "size"),
    ("size too large", {"prompt": "x", "size": "4096x4096"}, "size"),
    ("size too elongated", {"prompt": "x", "size": "1x8000"}, "size"),
    ("size too wide", {"prompt": "x", "size": "9000x10"}, "size"),
    ("size not string", {"prompt": "x", "size": 256}, "size"),
    ("response_format url", {"prompt": "x", "response_format": "url"}, "response_format"),
    ("output_format gif", {"prompt": "x", "output_format": "gif"}, "output_format"),
    ("output_compression 101", {"prompt": "x", "output_compression": 101}, "output_compression"),
    ("background transparent", {"prompt": "x", "background": "transparent"}, "background"),
    ("quality ultra", {"prompt": "x", "quality": "ultra"}, "quality"),
    ("stream as string", {"prompt": "x", "stream": "yes"}, "stream"),
    ("partial_images -1", {"prompt": "x", "stream": True, "partial_images": -1}, "partial_images"),
    ("stream with url", {"prompt": "x", "stream": True, "response_format": "url"}, "response_format"),
    ("partial_images 4", {"prompt": "x", "partial_images": 4}, "partial_images"),
    ("seed -1", {"prompt": "x", "seed": -1}, "seed"),
    ("seed 2**32", {"prompt": "x", "seed": 2**32}, "seed"),
    ("guidance_scale -1", {"prompt": "x", "guidance_scale": -1}, "guidance_scale"),
    ("guidance_scale 31", {"prompt": "x", "guidance_scale": 31}, "guidance_scale"),
    ("num_inference_steps -1", {"prompt": "x", "num_inference_steps": -1}, "num_inference_steps"),
    ("body is a list", ["prompt"], None),
    ("body is null", None, None),
]


@pytest.mark.parametrize(
    ("body", "param"), [(b, p) for _, b, p in BAD_BODIES], ids=[i for i, _, _ in BAD_BODIES]
)
async def test_bad_inputs_400(
    client: httpx.AsyncClient, backend: Backend, body: Any, param: str | None
) -> None:
    err = _assert_error(await _generate(client, body), 400, param)
    assert err["type"] == "invalid_request_error"
    assert backend.servicer.calls == [] and backend.servicer.stream_calls == []


async def test_a_float32_limit_and_value_are_shown_as_the_client_wrote_them(backend: Backend) -> None:
    # GetLimits carries max_guidance as a float32: --max-guidance 30.01 arrives as 30.010000228881836.
    app = create_app(RestSettings(gateway_address=backend.address))
    async with app.router.lifespan_context(app), _http(app) as client:
        app.state.limits.current = from_proto(common_pb2.Limits(max_guidance=30.01))
        assert app.state.limits.current.max_guidance != 30.01
        err = _assert_error(await _generate(client, {"prompt": "x", "guidance_scale": 30.02}), 400,
                            "guidance_scale", "invalid_value")
        assert err["message"] == "guidance_scale: must be between 0 and 30.01, got 30.02"
        doc = (await client.get("/openapi.json")).json()
    prop = doc["components"]["schemas"]["ImageGenerationRequest"]["properties"]["guidance_scale"]
    assert prop["anyOf"][0]["maximum"] == 30.01


def test_client_texts_name_no_server_flag() -> None:
    # What a REST client reads is in its terms: an operator's flag (--max-queued-outputs...) is not its to change,
    # and goes to the log. Every text the REST front or the shared checks compose, read from their source.
    # (/health's reasons are the operator's, and may name one.)
    calls = {"APIError", "error_response", "InvalidArgument", "ResourceExhausted", "Unavailable", "_answer"}
    root = Path(__file__).resolve().parent.parent
    sources = [*sorted((root / "gateway/rest").glob("*.py")), root / "services/runtime/admission.py",
               root / "services/runtime/limits.py"]
    texts = []
    for source in sources:
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) in calls:
                texts += [(source.name, n.value) for arg in node.args for n in ast.walk(arg)
                          if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    assert len(texts) > 50
    assert [t for t in texts if re.search(r"--[a-z]", t[1])] == []


@pytest.mark.parametrize(("size", "why"), [
    ("2048x2080", "size: 2048x2080 (width x height) exceeds the limit of 4194304 pixels"),
    ("9000x10", "size: 9000x10 (width x height) is more elongated than 4:1"),
])
async def test_a_size_refusal_names_size_in_the_users_order(client: httpx.AsyncClient, size: str, why: str) -> None:
    err = _assert_error(await _generate(client, {"prompt": "x", "size": size}), 400, "size", "invalid_value")
    assert err["message"] == why


@pytest.mark.parametrize(
    ("content", "param", "code"),
    [
        (b'{"prompt": "x",', None, "invalid_json"),
        (b"not json", None, "invalid_json"),
        (b'{"prompt": "\\ud800"}', "prompt", "invalid_value"),  # lone surrogate
        (b'{"prompt": "x", "guidance_scale": NaN}', "guidance_scale", None),
        (b'{"prompt": "x", "guidance_scale": 1e999}', "guidance_scale", None),
        (b"\xff\xfe\x00", None, "invalid_json"),  # not UTF-8 at all
        (b'{"prompt": "caf\xe9"}', None, "invalid_json"),  # Latin-1
    ],
)
async def test_raw_bodies_400(
    client: httpx.AsyncClient, content: bytes, param: str | None, code: str | None
) -> None:
    headers = {"content-type": "application/json"}
    resp = await client.post("/v1/images/generations", content=content, headers=headers)
    _assert_error(resp, 400, param, code)


@pytest.mark.parametrize(
    ("headers", "content"),
    [
        ({"content-type": "text/plain"}, b'{"prompt": "x"}'),
        ({"content-type": "application/x-www-form-urlencoded"}, b"prompt=x"),
        ({"content-type": "multipart/form-data; boundary=b"}, b"--b\r\n\r\nx\r\n--b--\r\n"),
        ({}, b"prompt=x"),  # no content type at all
    ],
    ids=["text-plain", "form", "multipart", "no-content-type"],
)
async def test_body_that_is_not_json_is_415(
    client: httpx.AsyncClient, backend: Backend, headers: dict[str, str], content: bytes
) -> None:
    err = _assert_error(await client.post("/v1/images/generations", content=content, headers=headers), 415, None,
                        "unsupported_media_type")
    assert "must be application/json" in err["message"] and err["type"] == "invalid_request_error"
    assert backend.servicer.calls == []


@pytest.mark.parametrize("content_type", ["application/json; charset=utf-8", "Application/JSON"])
async def test_json_with_parameters_is_accepted(client: httpx.AsyncClient, content_type: str) -> None:
    resp = await client.post("/v1/images/generations", content=b'{"prompt": "x"}',
                             headers={"content-type": content_type})
    assert resp.status_code == 200, resp.text


class ChunkedBody:
    """An ASGI `receive` that streams `total` bytes of a JSON-looking body in `chunk`-sized pieces, counting what
    the app took; after the body (or once the app stopped reading) it waits, then reports a disconnect."""

    def __init__(self, total: int, chunk: int = 64 * 1024) -> None:
        self.total = total
        self.chunk = chunk
        self.taken = 0
        self.sent: list[dict[str, Any]] = []

    async def receive(self) -> dict[str, Any]:
        if self.taken >= self.total:
            await asyncio.sleep(3600)
        size = min(self.chunk, self.total - self.taken)
        self.taken += size
        return {"type": "http.request", "body": b" " * size, "more_body": self.taken < self.total}

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)

    async def run(self, app: FastAPI, headers: list[tuple[bytes, bytes]]) -> int:
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
            "scheme": "http", "path": "/v1/images/generations", "raw_path": b"/v1/images/generations",
            "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1234), "server": ("test", 80),
            "headers": [(b"host", b"test"), (b"content-type", b"application/json"), *headers],
        }
        await asyncio.wait_for(app(scope, self.receive, self.send), 10)
        start = self.sent[0]
        assert start["type"] == "http.response.start"
        body = json.loads(b"".join(m.get("body", b"") for m in self.sent[1:]))
        assert body["error"]["code"] == "request_too_large" and set(body["error"]) == {
            "message", "type", "param", "code"}
        return int(start["status"])


async def test_body_over_the_limit_is_413(backend: Backend) -> None:
    limit = 4096
    big = {"prompt": "x" * 5000}
    async with rest_client(RestSettings(gateway_address=backend.address, max_body_bytes=limit)) as c:
        # Content-Length over the limit: refused up front.
        err = _assert_error(await _generate(c, big), 413, None, "request_too_large")
        assert str(limit) in err["message"]

        async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: httpx sends it chunked
            data = json.dumps(big).encode()
            for i in range(0, len(data), 1000):
                yield data[i:i + 1000]

        resp = await c.post("/v1/images/generations", content=chunks(), headers={"content-type": "application/json"})
        assert "content-length" not in resp.request.headers
        _assert_error(resp, 413, None, "request_too_large")
        # Just under the limit still works, both ways.
        small = {"prompt": "x" * 4000}
        assert (await _generate(c, small)).status_code == 200

        async def small_chunks() -> AsyncIterator[bytes]:
            yield json.dumps(small).encode()

        resp = await c.post("/v1/images/generations", content=small_chunks(),
                            headers={"content-type": "application/json"})
        assert resp.status_code == 200, resp.text
    assert backend.servicer.calls and all(len(r.prompt) == 4000 for r, _ in backend.servicer.calls)


async def test_huge_chunked_body_is_refused_without_being_read(app: FastAPI, backend: Backend) -> None:
    limit = RestSettings().max_body_bytes  # the default, 1 MiB
    assert limit == 1024 * 1024
    body = ChunkedBody(20 * 1024 * 1024)
    assert await body.run(app, [(b"transfer-encoding", b"chunked")]) == 413
    assert body.taken <= limit + body.chunk  # the app stopped reading at the limit, not at 20 MB
    # With a Content-Length over the limit, not one byte is read.
    declared = ChunkedBody(20 * 1024 * 1024)
    assert await declared.run(app, [(b"content-length", str(declared.total).encode())]) == 413
    assert declared.taken == 0
    assert backend.servicer.calls == []


def test_max_body_bytes_flag() -> None:
    assert rest_main.settings_from_args(rest_main.parse_args([])).max_body_bytes == 1024 * 1024
    assert rest_main.settings_from_args(rest_main.parse_args(["--max-body-bytes", "2048"])).max_body_bytes == 2048
    with pytest.raises(SystemExit):
        rest_main.parse_args(["--max-body-bytes", "0"])


async def test_url_message(client: httpx.AsyncClient) -> None:
    resp = await _generate(client, {"prompt": "x", "response_format": "url"})
    err = _assert_error(resp, 400, "response_format")
    assert "no image store" in err["message"]


async def test_unknown_route_and_method_are_openai_shaped(client: httpx.AsyncClient) -> None:
    _assert_error(await client.get("/v1/nope"), 404, None, "not_found")
    _assert_error(await client.get("/v1/images/generations"), 405, None, "method_not_allowed")


# --- gRPC status mapping ------------------------------------------------------------------------

STATUS_TABLE = [
    (grpc.StatusCode.INVALID_ARGUMENT, 400),
    (grpc.StatusCode.FAILED_PRECONDITION, 400),
    (grpc.StatusCode.OUT_OF_RANGE, 400),
    (grpc.StatusCode.UNAUTHENTICATED, 401),
    (grpc.StatusCode.PERMISSION_DENIED, 403),
    (grpc.StatusCode.NOT_FOUND, 404),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
    (grpc.StatusCode.CANCELLED, 499),
    (grpc.StatusCode.INTERNAL, 500),
    (grpc.StatusCode.UNKNOWN, 500),
    (grpc.StatusCode.UNIMPLEMENTED, 501),
    (grpc.StatusCode.UNAVAILABLE, 503),
    (grpc.StatusCode.DEADLINE_EXCEEDED, 504),
]


@pytest.mark.parametrize("own", [True, False], ids=["marked", "unmarked"])
@pytest.mark.parametrize(("code", "http_status"), STATUS_TABLE, ids=[c.name for c, _ in STATUS_TABLE])
async def test_grpc_status_mapping(
    client: httpx.AsyncClient, backend: Backend, code: grpc.StatusCode, http_status: int, own: bool
) -> None:
    backend.servicer.abort = (code, f"upstream says {code.name}", own)
    resp = await _generate(client, {"prompt": "x"})
    err = _assert_error(resp, http_status, None, code.name.lower())
    # A status our servers composed keeps its text; one gRPC may have made up itself (its text can name
    # addresses and library errors) is told in the REST front's own words, unless its code is one gRPC never uses.
    always_ours = http_status in (400, 401, 403, 404, 409) and code is not grpc.StatusCode.ABORTED
    if own or always_ours:
        assert err["message"] == f"upstream says {code.name}"
    else:
        assert "upstream says" not in err["message"] and err["message"]
    assert ("retry-after" in resp.headers) == (http_status == 429)
    if http_status == 429:
        assert err["type"] == "rate_limit_error"
        assert int(resp.headers["retry-after"]) >= 1


@pytest.mark.parametrize(("field", "param"), [
    ("height", "size"), ("width", "size"), ("prompt", "prompt"), ("guidance_scale", "guidance_scale"),
    ("sampling.top_p", "sampling.top_p"), ("address", None),  # a field no REST parameter stands for
])
async def test_a_refused_field_is_named_as_param(
    client: httpx.AsyncClient, backend: Backend, field: str, param: str | None
) -> None:
    # The gateway's INVALID_ARGUMENT carries the field as a google.rpc.BadRequest violation; REST names its own.
    error = InvalidArgument(field, "must be a multiple of 32")
    backend.servicer.abort = (error, "")
    err = _assert_error(await _generate(client, {"prompt": "x"}), 400, param, "invalid_argument")
    assert err["message"] == f"{field}: must be a multiple of 32"


async def test_a_refusal_without_details_has_no_param(client: httpx.AsyncClient, backend: Backend) -> None:
    # An older gateway sends the field only in its text: REST does not guess it back out of the message.
    backend.servicer.abort = (grpc.StatusCode.INVALID_ARGUMENT, "height: must be a multiple of 32")
    _assert_error(await _generate(client, {"prompt": "x"}), 400, None, "invalid_argument")


async def test_gateway_down_is_503(backend: Backend) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    async with rest_client(RestSettings(gateway_address=dead, request_timeout=5, health_timeout=5)) as c:
        err = _assert_error(await _generate(c, {"prompt": "x"}), 503, None, "unavailable")
        resp = await c.get("/health")
        assert resp.status_code == 503
        assert "unreachable" in resp.json()["reason"]
        # gRPC's own text ("ipv4:127.0.0.1:PORT: Failed to connect to remote host") stays in the log.
        for text in (err["message"], resp.text):
            assert dead not in text and "ipv4" not in text and "127.0.0.1" not in text, text


# --- usage: cached tokens ------------------------------------------------------------------------


async def test_cache_report_hidden_by_default(client: httpx.AsyncClient, backend: Backend) -> None:
    backend.servicer.cached_tokens = 5
    usage = (await _generate(client, {"prompt": "x"})).json()["usage"]
    assert "prompt_tokens_details" not in usage
    assert "cached" not in json.dumps(usage)


async def test_cache_report_when_enabled(backend: Backend) -> None:
    settings = RestSettings(gateway_address=backend.address, enable_cache_report=True)
    async with rest_client(settings) as c:
        usage = (await _generate(c, {"prompt": "x"})).json()["usage"]
        assert "prompt_tokens_details" not in usage  # enabled, but nothing cached
        backend.servicer.cached_tokens = 5
        usage = (await _generate(c, {"prompt": "x", "n": 2})).json()["usage"]
        assert usage["prompt_tokens_details"] == {"cached_tokens": 10}


# --- auth, models, health, metrics ------------------------------------------------------------------


async def test_auth(backend: Backend) -> None:
    settings = RestSettings(gateway_address=backend.address, api_keys=("k1", "k2"))
    async with rest_client(settings) as c:
        _assert_error(await _generate(c, {"prompt": "x"}), 401, None, "invalid_api_key")
        _assert_error(await _generate(c, {"prompt": "x"}, headers={"Authorization": "Bearer nope"}),
                      401, None, "invalid_api_key")
        # Auth is checked before the body is parsed.
        _assert_error(await c.post("/v1/images/generations", content=b"{"), 401, None, "invalid_api_key")
        _assert_error(await c.get("/v1/models"), 401, None, "invalid_api_key")
        assert backend.servicer.calls == []

        resp = await _generate(c, {"prompt": "x"}, headers={"Authorization": "Bearer k2"})
        assert resp.status_code == 200, resp.text
        assert backend.servicer.calls[0][1]["authorization"] == "Bearer k2"
        assert (await c.get("/v1/models", headers={"Authorization": "Bearer k1"})).status_code == 200
        assert (await c.get("/health")).status_code == 200
        assert (await c.get("/metrics")).status_code == 200


async def test_auth_off_forwards_authorization(client: httpx.AsyncClient, backend: Backend) -> None:
    resp = await _generate(client, {"prompt": "x"}, headers={"Authorization": "Bearer whatever"})
    assert resp.status_code == 200
    assert backend.servicer.calls[0][1]["authorization"] == "Bearer whatever"


async def test_models(client: httpx.AsyncClient) -> None:
    body = (await client.get("/v1/models")).json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["glm-image", "gpt-image-1", "dall-e-3"]
    assert all(m["object"] == "model" for m in body["data"])


async def test_retrieve_model_with_the_sdk(app: FastAPI, backend: Backend) -> None:
    async with _http(app) as http:
        sdk = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", max_retries=0, http_client=http)
        for name in ("glm-image", "gpt-image-1", "dall-e-3"):
            model = await sdk.models.retrieve(name)
            assert (model.id, model.object, model.owned_by) == (name, "model", "glmimage")
            assert isinstance(model.created, int)
        with pytest.raises(openai.NotFoundError) as info:
            await sdk.models.retrieve("sdxl")
    assert info.value.code == "model_not_found"
    assert info.value.body == {"message": info.value.body["message"], "type": "invalid_request_error",
                               "param": "model", "code": "model_not_found"}
    async with rest_client(RestSettings(gateway_address=backend.address, served_model="zai-org/GLM-Image")) as c:
        resp = await c.get("/v1/models/zai-org/GLM-Image")
        assert resp.status_code == 200 and resp.json()["id"] == "zai-org/GLM-Image"
        _assert_error(await c.get("/v1/models/glm-image"), 404, "model", "model_not_found")


def _preflight(origin: str) -> dict[str, str]:
    return {"origin": origin, "access-control-request-method": "POST",
            "access-control-request-headers": "authorization, content-type"}


async def test_cors_off_by_default(client: httpx.AsyncClient) -> None:
    origin = "https://app.example.com"
    resp = await client.options("/v1/images/generations", headers=_preflight(origin))
    assert "access-control-allow-origin" not in resp.headers
    resp = await _generate(client, {"prompt": "x"}, headers={"origin": origin})
    assert resp.status_code == 200 and "access-control-allow-origin" not in resp.headers
    assert rest_main.settings_from_args(rest_main.parse_args([])).cors_origins == ()


async def test_cors_for_the_given_origins_only(backend: Backend) -> None:
    allowed = ["https://app.example.com", "http://localhost:3000"]
    args = rest_main.parse_args(["--gateway-address", backend.address, "--api-key", "k",
                                 *[a for o in allowed for a in ("--cors-origin", o)]])
    settings = rest_main.settings_from_args(args)
    assert settings.cors_origins == tuple(allowed)
    async with rest_client(settings) as c:
        for origin in allowed:
            resp = await c.options("/v1/images/generations", headers=_preflight(origin))  # no key on a preflight
            assert resp.status_code == 200, resp.text
            assert resp.headers["access-control-allow-origin"] == origin
            assert "POST" in resp.headers["access-control-allow-methods"]
            assert "authorization" in resp.headers["access-control-allow-headers"].lower()
            resp = await _generate(c, {"prompt": "x"}, headers={"origin": origin, "authorization": "Bearer k"})
            assert resp.status_code == 200 and resp.headers["access-control-allow-origin"] == origin
            assert "x-request-id" in resp.headers["access-control-expose-headers"]
        other = "https://evil.example.net"
        resp = await c.options("/v1/images/generations", headers=_preflight(other))
        assert resp.status_code == 400 and "access-control-allow-origin" not in resp.headers
        resp = await _generate(c, {"prompt": "x"}, headers={"origin": other, "authorization": "Bearer k"})
        assert "access-control-allow-origin" not in resp.headers


async def test_health_ok(client: httpx.AsyncClient) -> None:
    resp = await client.get("/health")
    assert resp.status_code == 200, resp.text
    assert resp.json()["status"] == "ok"
    assert resp.json()["ar_workers"] == 1 and resp.json()["denoiser_workers"] == 1


async def test_health_not_serving(client: httpx.AsyncClient, backend: Backend) -> None:
    await backend.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    resp = await client.get("/health")
    assert resp.status_code == 503
    assert resp.json()["status"] == "unavailable"
    assert "NOT_SERVING" in resp.json()["reason"]


@pytest.mark.parametrize(
    ("ar_state", "dn_state", "missing"),
    [
        (gw.WORKER_STATE_AVAILABLE, gw.WORKER_STATE_UNHEALTHY, "denoiser"),
        (gw.WORKER_STATE_DRAINING, gw.WORKER_STATE_AVAILABLE, "AR"),
    ],
)
async def test_health_no_workers(
    client: httpx.AsyncClient, backend: Backend, ar_state: int, dn_state: int, missing: str
) -> None:
    backend.servicer.workers[0].state = ar_state
    backend.servicer.workers[1].state = dn_state
    resp = await client.get("/health")
    assert resp.status_code == 503
    assert f"no {missing} server is ready" in resp.json()["reason"]
    backend.servicer.workers.clear()
    reason = (await client.get("/health")).json()["reason"]
    assert "no AR server is configured" in reason and "no denoiser server is configured" in reason


async def test_health_says_which_stage_is_stuck(client: httpx.AsyncClient, backend: Backend) -> None:
    # A hung AR (SIGSTOP) keeps its connection: the stage is stuck, not gone, and /health says so.
    ar = backend.servicer.workers[0]
    ar.state, ar.stuck, ar.health = gw.WORKER_STATE_UNHEALTHY, True, "not answering health checks (hung)"
    resp = await client.get("/health")
    assert resp.status_code == 503
    body = resp.json()
    assert "AR stage is stuck" in body["reason"] and "hung" in body["reason"]
    assert body["stages"]["ar"] == {"ready": 0, "stuck": 1, "total": 1}
    assert ar.address not in resp.text
    # One stuck worker of several leaves the stage serving; the body still counts it.
    backend.servicer.workers.append(gw.WorkerStatus(address="ar:2", role=gw.WORKER_ROLE_AR,
                                                    state=gw.WORKER_STATE_AVAILABLE))
    resp = await client.get("/health")
    assert resp.status_code == 200 and resp.json()["stages"]["ar"] == {"ready": 1, "stuck": 1, "total": 2}


async def test_metrics(backend: Backend) -> None:
    async with rest_client(RestSettings(gateway_address=backend.address)) as c:
        assert (await _generate(c, {"prompt": "x", "n": 3})).status_code == 200
        assert (await _generate(c, {"prompt": ""})).status_code == 400
        text = (await c.get("/metrics")).text
    assert 'glmimage_rest_requests_total{route="/v1/images/generations",status="200"} 1.0' in text
    assert 'glmimage_rest_requests_total{route="/v1/images/generations",status="400"} 1.0' in text
    assert "glmimage_rest_images_total 3.0" in text
    assert 'glmimage_rest_request_duration_seconds_count{route="/v1/images/generations"} 2.0' in text


async def test_openapi_documents_body(client: httpx.AsyncClient) -> None:
    doc = (await client.get("/openapi.json")).json()
    assert "/v1/images/generations" in doc["paths"]
    props = doc["components"]["schemas"]["ImageGenerationRequest"]["properties"]
    assert all(p.get("description") for p in props.values())


# --- client disconnect ------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream-before-first-event"])
async def test_client_disconnect_cancels_grpc_call(app: FastAPI, backend: Backend, stream: bool) -> None:
    backend.servicer.block = True
    raw = RawClient(app, {"prompt": "slow", "stream": stream})
    await asyncio.wait_for(backend.servicer.started.wait(), 10)
    assert not raw.task.done()
    raw.hang_up()
    await asyncio.wait_for(backend.servicer.cancelled.wait(), 10)
    await asyncio.wait_for(raw.task, 10)
    assert raw.sent[0]["type"] == "http.response.start" and raw.sent[0]["status"] == 499


async def test_client_disconnect_mid_stream_cancels_grpc_call(app: FastAPI, backend: Backend) -> None:
    backend.servicer.block_after_first = True
    raw = RawClient(app, {"prompt": "slow", "stream": True, "partial_images": 2})
    await asyncio.wait_for(backend.servicer.started.wait(), 10)
    await asyncio.wait_for(raw.body_chunk_sent.wait(), 10)  # the 200 and the first progress comment are out
    assert raw.sent[0]["status"] == 200 and not raw.task.done()
    raw.hang_up()
    await asyncio.wait_for(backend.servicer.cancelled.wait(), 10)
    await asyncio.wait_for(raw.task, 10)
    assert raw.sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    assert b"image_generation" not in b"".join(m.get("body", b"") for m in raw.sent)


async def test_stream_cut_by_the_client_counts_as_499(backend: Backend) -> None:
    # The SSE response started with 200; the client left mid-stream: the metrics count the outcome, 499.
    app = create_app(RestSettings(gateway_address=backend.address))
    async with app.router.lifespan_context(app):
        backend.servicer.block_after_first = True
        raw = RawClient(app, {"prompt": "slow", "stream": True})
        await asyncio.wait_for(raw.body_chunk_sent.wait(), 10)
        assert raw.sent[0]["status"] == 200
        raw.hang_up()
        await asyncio.wait_for(backend.servicer.cancelled.wait(), 10)
        await asyncio.wait_for(raw.task, 10)
        backend.servicer.reset()
        async with _http(app) as c:  # a stream that runs to its end still counts as 200
            assert (await _generate(c, {"prompt": "x", "stream": True})).status_code == 200
            text = (await c.get("/metrics")).text
    assert 'glmimage_rest_requests_total{route="/v1/images/generations",status="499"} 1.0' in text
    assert 'glmimage_rest_requests_total{route="/v1/images/generations",status="200"} 1.0' in text


# --- streaming (SSE) ------------------------------------------------------------------------------------

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


def _image_usage(n_images: int = 1, cached: int | None = None) -> dict[str, Any]:
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


async def test_stream_events(client: httpx.AsyncClient, backend: Backend) -> None:
    resp = await _generate(client, {
        "prompt": "a fox", "stream": True, "partial_images": 2, "n": 2, "size": "512x256", "quality": "low",
        "output_format": "webp", "model": "dall-e-3",
    }, headers={"Authorization": "Bearer t"})
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/event-stream")
    assert resp.headers["cache-control"] == "no-cache"
    events, comments = parse_sse(resp.text)
    assert [(name, d["image_index"], d.get("partial_image_index")) for name, d in events] == [
        (PARTIAL, 0, 0), (PARTIAL, 0, 1), (PARTIAL, 1, 0), (PARTIAL, 1, 1), (COMPLETED, 0, None), (COMPLETED, 1, None),
    ]
    for name, data in events:
        assert set(data) == (PARTIAL_KEYS if name == PARTIAL else COMPLETED_KEYS)
        assert (data["size"], data["quality"], data["background"], data["output_format"]) == (
            "512x256", "low", "opaque", "webp")
        assert isinstance(data["created_at"], int)
        assert base64.b64decode(data["b64_json"]).startswith(PNG_MAGIC)
    # Each completed event bills its own image, so the events add up to the request's usage.
    assert [d["usage"] for name, d in events if name == COMPLETED] == [_image_usage(), _image_usage()]
    # quality=low is 10 steps; progress is sent as SSE comments, which clients ignore.
    assert comments == [f"progress image={i} step={k}/10" for i in range(2) for k in range(1, 11)]
    [(sreq, metadata)] = backend.servicer.stream_calls
    assert sreq.partial_images == 2
    assert (sreq.request.n, sreq.request.width, sreq.request.height) == (2, 512, 256)
    assert sreq.request.num_inference_steps == 10
    assert sreq.request.output_format == common_pb2.IMAGE_FORMAT_WEBP
    assert metadata["authorization"] == "Bearer t"
    assert metadata["x-request-id"] == resp.headers["x-request-id"] == sreq.request.request_id
    assert backend.servicer.calls == []


async def test_stream_without_partials(client: httpx.AsyncClient, backend: Backend) -> None:
    resp = await _generate(client, {"prompt": "x", "stream": True})
    events, _ = parse_sse(resp.text)
    assert [name for name, _ in events] == [COMPLETED]
    assert events[0][1]["usage"] == _image_usage()
    assert backend.servicer.stream_calls[0][0].partial_images == 0


async def test_stream_false_is_json(client: httpx.AsyncClient, backend: Backend) -> None:
    resp = await _generate(client, {"prompt": "x", "stream": False, "partial_images": 3})
    assert resp.headers["content-type"] == "application/json"
    assert len(resp.json()["data"]) == 1
    assert len(backend.servicer.calls) == 1 and backend.servicer.stream_calls == []


@pytest.mark.parametrize("n", [1, 3])
async def test_openai_sdk_stream(app: FastAPI, n: int) -> None:
    from openai.types import ImageGenCompletedEvent, ImageGenPartialImageEvent

    async with _http(app) as http:
        sdk = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", max_retries=0, http_client=http)
        stream = await sdk.images.generate(model="gpt-image-1", prompt="a lighthouse", n=n, size="256x256",
                                           stream=True, partial_images=2)
        events = [event async for event in stream]
    assert [type(e) for e in events] == [ImageGenPartialImageEvent] * 2 * n + [ImageGenCompletedEvent] * n
    partials = [e for e in events if isinstance(e, ImageGenPartialImageEvent)]
    completed = [e for e in events if isinstance(e, ImageGenCompletedEvent)]
    assert [e.partial_image_index for e in partials] == [0, 1] * n
    assert [e.model_dump()["image_index"] for e in completed] == list(range(n))  # the SDK keeps extensions
    for event in completed:
        assert base64.b64decode(event.b64_json).startswith(PNG_MAGIC)
        assert (event.size, event.output_format, event.background) == ("256x256", "png", "opaque")
        assert event.usage.input_tokens == PROMPT_TOKENS
        assert event.usage.output_tokens == COMPLETION_TOKENS_PER_IMAGE
        assert event.usage.input_tokens_details.text_tokens == PROMPT_TOKENS
    assert sum(e.usage.output_tokens for e in completed) == COMPLETION_TOKENS_PER_IMAGE * n


@pytest.mark.parametrize(("code", "http_status"), [
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
    (grpc.StatusCode.INVALID_ARGUMENT, 400),
    (grpc.StatusCode.UNIMPLEMENTED, 501),
    (grpc.StatusCode.UNAVAILABLE, 503),
], ids=lambda v: getattr(v, "name", str(v)))
async def test_stream_error_before_first_event_keeps_http_status(
    client: httpx.AsyncClient, backend: Backend, code: grpc.StatusCode, http_status: int
) -> None:
    backend.servicer.abort = (code, "nope")
    resp = await _generate(client, {"prompt": "x", "stream": True, "partial_images": 1})
    _assert_error(resp, http_status, None, code.name.lower())
    assert ("retry-after" in resp.headers) == (http_status == 429)


async def test_openai_sdk_stream_errors(app: FastAPI, backend: Backend) -> None:
    async with _http(app) as http:
        sdk = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", max_retries=0, http_client=http)
        backend.servicer.abort = (grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")
        with pytest.raises(openai.RateLimitError):
            await sdk.images.generate(prompt="x", stream=True, partial_images=1)
        backend.servicer.abort = None
        backend.servicer.abort_mid_stream = (grpc.StatusCode.DEADLINE_EXCEEDED, "too slow")
        stream = await sdk.images.generate(prompt="x", stream=True, partial_images=1)
        seen = []
        with pytest.raises(openai.APIError, match="too slow"):
            async for event in stream:
                seen.append(event.type)
        assert seen == [PARTIAL]


async def test_stream_error_after_first_event_is_an_error_event(client: httpx.AsyncClient, backend: Backend) -> None:
    backend.servicer.abort_mid_stream = (grpc.StatusCode.DEADLINE_EXCEEDED, "too slow")
    resp = await _generate(client, {"prompt": "x", "stream": True, "partial_images": 1})
    assert resp.status_code == 200  # already sent with the first event
    events, _ = parse_sse(resp.text)
    assert [name for name, _ in events] == [PARTIAL, "error"]
    assert events[-1][1]["error"] == {
        "message": "too slow", "type": "timeout_error", "param": None, "code": "deadline_exceeded"}


async def test_stream_without_result_is_an_error_event(client: httpx.AsyncClient, backend: Backend) -> None:
    backend.servicer.stream_without_result = True
    events, _ = parse_sse((await _generate(client, {"prompt": "x", "stream": True, "partial_images": 1})).text)
    assert [name for name, _ in events] == [PARTIAL, "error"]
    assert events[-1][1]["error"]["code"] == "incomplete_stream"


async def test_stream_cache_report(backend: Backend) -> None:
    backend.servicer.cached_tokens = 5
    async with rest_client(RestSettings(gateway_address=backend.address, enable_cache_report=True)) as c:
        events, _ = parse_sse((await _generate(c, {"prompt": "x", "n": 2, "stream": True})).text)
    assert [d["usage"] for _, d in events] == [_image_usage(cached=5)] * 2


# --- the gateway's own API keys ----------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_gateway_key_check_reaches_the_client(client: httpx.AsyncClient, backend: Backend, stream: bool) -> None:
    # REST checks no key here; the gateway does, on the forwarded authorization metadata.
    backend.servicer.required_authorization = "Bearer gw-key"
    body = {"prompt": "x", "stream": stream}
    _assert_error(await _generate(client, body), 401, None, "unauthenticated")
    _assert_error(await _generate(client, body, headers={"Authorization": "Bearer other"}), 401, None,
                  "unauthenticated")
    resp = await _generate(client, body, headers={"Authorization": "Bearer gw-key"})
    assert resp.status_code == 200, resp.text


async def test_health_uses_the_gateway_api_key(backend: Backend) -> None:
    backend.servicer.required_authorization = "Bearer for-rest"
    async with rest_client(RestSettings(gateway_address=backend.address)) as c:
        resp = await c.get("/health")
        assert resp.status_code == 503 and "--gateway-api-key" in resp.json()["reason"]
    async with rest_client(RestSettings(gateway_address=backend.address, gateway_api_key="for-rest")) as c:
        assert (await c.get("/health")).status_code == 200
        # Generation carries the client's key, never REST's own.
        _assert_error(await _generate(c, {"prompt": "x"}), 401, None, "unauthenticated")


def test_gateway_api_key_flag_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GLMIMAGE_GATEWAY_API_KEY", raising=False)
    monkeypatch.delenv("GLMIMAGE_API_KEYS", raising=False)
    assert rest_main.settings_from_args(rest_main.parse_args([])).gateway_api_key is None
    assert rest_main.settings_from_args(rest_main.parse_args(["--gateway-api-key", "a"])).gateway_api_key == "a"
    monkeypatch.setenv("GLMIMAGE_GATEWAY_API_KEY", "b")
    assert rest_main.settings_from_args(rest_main.parse_args([])).gateway_api_key == "b"
    # Neither given, but the front has keys of its own (the chart's GLMIMAGE_API_KEYS): it uses the first.
    monkeypatch.delenv("GLMIMAGE_GATEWAY_API_KEY")
    monkeypatch.setenv("GLMIMAGE_API_KEYS", "k1,k2")
    assert rest_main.settings_from_args(rest_main.parse_args([])).gateway_api_key == "k1"
    assert rest_main.settings_from_args(rest_main.parse_args(["--gateway-api-key", "a"])).gateway_api_key == "a"


async def test_same_key_on_rest_and_gateway_with_the_sdk(backend: Backend) -> None:
    backend.servicer.required_authorization = "Bearer shared"
    app = create_app(RestSettings(gateway_address=backend.address, api_keys=("shared",)))
    async with app.router.lifespan_context(app), _http(app) as http:
        sdk = openai.AsyncOpenAI(base_url="http://test/v1", api_key="shared", max_retries=0, http_client=http)
        assert len((await sdk.images.generate(prompt="x", n=2)).data) == 2
        events = [e async for e in await sdk.images.generate(prompt="x", stream=True)]
        assert [e.type for e in events] == [COMPLETED]
        with pytest.raises(openai.AuthenticationError):
            await sdk.with_options(api_key="wrong").images.generate(prompt="x")


# --- TLS to the gateway -------------------------------------------------------------------------------


@dataclass
class TlsBackend:
    address: str
    pki: Pki


@pytest_asyncio.fixture(scope="module")
async def tls_backend(backend: Backend, pki: Pki) -> AsyncIterator[TlsBackend]:
    """The same fake gateway servicer on a second port that demands mutual TLS."""
    server = grpc.aio.server()
    gw_grpc.add_GatewayServiceServicer_to_server(backend.servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(backend.health, server)
    port = server.add_secure_port("127.0.0.1:0", pki.server_credentials(mutual=True))
    await server.start()
    try:
        yield TlsBackend(f"127.0.0.1:{port}", pki)
    finally:
        await server.stop(grace=None)


@pytest.mark.parametrize("server_name", [None, "localhost"])
async def test_mutual_tls(tls_backend: TlsBackend, backend: Backend, server_name: str | None) -> None:
    pki = tls_backend.pki
    settings = RestSettings(gateway_address=tls_backend.address, gateway_tls_ca=pki.ca,
                            gateway_tls_client_cert=pki.client_cert, gateway_tls_client_key=pki.client_key,
                            gateway_tls_server_name=server_name)
    async with rest_client(settings) as c:
        resp = await _generate(c, {"prompt": "over TLS", "n": 2})
        assert resp.status_code == 200, resp.text
        assert len(resp.json()["data"]) == 2
        events, _ = parse_sse((await _generate(c, {"prompt": "x", "stream": True, "partial_images": 1})).text)
        assert [name for name, _ in events] == [PARTIAL, COMPLETED]
        assert (await c.get("/health")).status_code == 200
    assert [r.prompt for r, _ in backend.servicer.calls] == ["over TLS"]


@pytest.mark.parametrize("case", ["plaintext", "no client certificate", "untrusted gateway", "wrong server name"])
async def test_tls_refused(tls_backend: TlsBackend, backend: Backend, case: str) -> None:
    pki = tls_backend.pki
    settings = {
        "plaintext": RestSettings(gateway_address=tls_backend.address),
        "no client certificate": RestSettings(gateway_address=tls_backend.address, gateway_tls_ca=pki.ca),
        "untrusted gateway": RestSettings(
            gateway_address=tls_backend.address, gateway_tls_ca=pki.other_ca,
            gateway_tls_client_cert=pki.client_cert, gateway_tls_client_key=pki.client_key),
        "wrong server name": RestSettings(
            gateway_address=tls_backend.address, gateway_tls_ca=pki.ca, gateway_tls_client_cert=pki.client_cert,
            gateway_tls_client_key=pki.client_key, gateway_tls_server_name="not-the-gateway.example"),
    }[case]
    async with rest_client(replace(settings, request_timeout=10, health_timeout=10)) as c:
        _assert_error(await _generate(c, {"prompt": "x"}), 503, None, "unavailable")
        assert (await c.get("/health")).status_code == 503
    assert backend.servicer.calls == []


def test_tls_settings_and_flags(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="together"):
        RestSettings(gateway_tls_client_cert=tmp_path / "c.pem")
    with pytest.raises(SystemExit):
        rest_main.parse_args(["--gateway-tls-client-key", "k.pem"])
    args = rest_main.parse_args(["--gateway-address", "gw:443", "--gateway-tls-ca", "ca.pem",
                                 "--gateway-tls-client-cert", "c.pem", "--gateway-tls-client-key", "k.pem",
                                 "--gateway-tls-server-name", "gw.internal"])
    settings = rest_main.settings_from_args(args)
    assert (settings.gateway_tls_ca, settings.gateway_tls_client_cert, settings.gateway_tls_client_key,
            settings.gateway_tls_server_name) == (Path("ca.pem"), Path("c.pem"), Path("k.pem"), "gw.internal")
    assert settings.gateway_tls and not RestSettings().gateway_tls
    with pytest.raises(FileNotFoundError):  # a bad path fails when the app is built, not on the first request
        create_app(settings)


# --- fuzz ------------------------------------------------------------------------------------------

FIELD_NAMES = [*ImageGenerationRequest.model_fields, "style", "moderation", "unknown"]
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**40), max_value=2**40)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
    | st.sampled_from([
        "png", "jpeg", "webp", "gif", "url", "b64_json", "auto", "opaque", "transparent", "low", "hd",
        "256x256", "64x96", "0x0", "4096x4096", "glm-image", "dall-e-3", "1", "",
    ])
)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=4,
)
FIELD_DICTS = st.dictionaries(st.sampled_from(FIELD_NAMES), JSON_VALUES, max_size=8)
BODIES = st.one_of(FIELD_DICTS, FIELD_DICTS.map(lambda d: {**d, "prompt": "fuzz"}), JSON_VALUES)


def check_answer(resp: httpx.Response) -> None:
    """What any request must get: no 5xx, and a body in the documented shape for its status."""
    assert resp.status_code < 500, resp.text
    if resp.status_code != 200:
        assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
    elif resp.headers["content-type"].startswith("text/event-stream"):
        events, _ = parse_sse(resp.text)
        for name, data in events:
            (ImageGenPartialImageEvent if name == PARTIAL else ImageGenCompletedEvent).model_validate(data)
        assert events and events[-1][0] == COMPLETED
    else:
        body = ImagesResponse.model_validate(resp.json())
        assert len(body.data) == body.usage.image_count


@hyp_settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=BODIES)
async def test_fuzz_never_5xx(client: httpx.AsyncClient, body: Any) -> None:
    check_answer(await _generate(client, body))


if schemathesis is not None:
    # Cases generated from our own OpenAPI document: valid ones (which must still be answered sensibly) and
    # schema-violating ones (which must all be 4xx).
    _GENERATIONS = schemathesis.openapi.from_dict(create_app(RestSettings()).openapi())["/v1/images/generations"]
    _CASES = (_GENERATIONS["POST"].as_strategy(GenerationMode.POSITIVE)
              | _GENERATIONS["POST"].as_strategy(GenerationMode.NEGATIVE))

    @hyp_settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(case=_CASES)
    async def test_schemathesis_never_5xx(client: httpx.AsyncClient, case: Any) -> None:
        kwargs = case.as_transport_kwargs(base_url="http://test")
        if "data" in kwargs:  # raw bytes (not JSON); httpx calls that `content`
            kwargs["content"] = kwargs.pop("data")
        kwargs.pop("cookies", None)  # always empty: the API has no cookie parameters
        check_answer(await client.request(**kwargs))
else:
    def test_schemathesis_never_5xx() -> None:
        pytest.skip("schemathesis is not installed (it comes with the dev extra)")


async def test_normal_request_after_fuzz(client: httpx.AsyncClient) -> None:
    # Runs after the fuzz tests (file order): the app must still be healthy.
    resp = await _generate(client, {"prompt": "still fine", "n": 2})
    assert resp.status_code == 200, resp.text
    assert len(resp.json()["data"]) == 2
    assert (await client.get("/health")).status_code == 200


async def test_listen_socket_gives_accepted_connections_tcp_nodelay() -> None:
    # Without TCP_NODELAY every keep-alive response after the first waits ~40 ms (Nagle vs delayed ACK).
    sock = rest_main.listen_socket("127.0.0.1", 0)
    accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    server = await asyncio.start_server(on_connect, sock=sock)
    async with server:
        _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
        assert await asyncio.wait_for(accepted, 10) != 0
        writer.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_own_gateway_auth_sends_the_fronts_key_never_the_clients(backend: Backend, stream: bool) -> None:
    """--gateway-auth own: separate keys per hop; the client's REST key stays in the front."""
    backend.servicer.required_authorization = "Bearer gw-only"
    settings = RestSettings(gateway_address=backend.address, api_keys=("rest-only",), gateway_api_key="gw-only",
                            gateway_auth="own")
    async with rest_client(settings) as c:
        resp = await _generate(c, {"prompt": "x", "stream": stream}, headers={"Authorization": "Bearer rest-only"})
        assert resp.status_code == 200, resp.text
        (_, metadata), = backend.servicer.stream_calls if stream else backend.servicer.calls
        assert metadata["authorization"] == "Bearer gw-only"
        assert "rest-only" not in " ".join(metadata.values())
        # The gateway's key is not a REST key.
        _assert_error(await _generate(c, {"prompt": "x"}, headers={"Authorization": "Bearer gw-only"}), 401, None,
                      "invalid_api_key")


def test_own_gateway_auth_needs_both_key_sets() -> None:
    with pytest.raises(ValueError, match="--gateway-api-key"):
        RestSettings(api_keys=("r",), gateway_auth="own")
    with pytest.raises(ValueError, match="--api-key"):
        RestSettings(gateway_api_key="g", gateway_auth="own")
    with pytest.raises(ValueError, match="forward, own"):
        RestSettings(gateway_auth="both")
