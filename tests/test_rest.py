"""OpenAI-compatible REST front (gateway/rest) against a real grpc.aio GatewayService fake."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import re
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
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

from gateway.rest.app import RestSettings, create_app
from gateway.rest.schemas import ImageGenerationRequest
from glmimage.v1 import common_pb2
from glmimage.v1 import gateway_service_pb2 as gw
from glmimage.v1 import gateway_service_pb2_grpc as gw_grpc

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PROMPT_TOKENS = 11
COMPLETION_TOKENS_PER_IMAGE = 257


def _png(index: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (index * 20 % 256, 0, 0)).save(buf, format="PNG")
    return buf.getvalue()


class FakeGateway(gw_grpc.GatewayServiceServicer):
    """Answers GenerateImages with n tiny PNGs; can abort, block, or report cached tokens."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.calls: list[tuple[gw.GenerateImagesRequest, dict[str, str]]] = []
        self.abort: tuple[grpc.StatusCode, str] | None = None
        self.cached_tokens = 0
        self.block = False
        self.started = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.workers = [
            gw.WorkerStatus(address="ar:1", role=gw.WORKER_ROLE_AR, state=gw.WORKER_STATE_AVAILABLE),
            gw.WorkerStatus(address="dn:1", role=gw.WORKER_ROLE_DENOISER, state=gw.WORKER_STATE_BUSY),
        ]

    async def GenerateImages(
        self, request: gw.GenerateImagesRequest, context: grpc.aio.ServicerContext
    ) -> gw.GenerateImagesResponse:
        metadata = {k: v for k, v in context.invocation_metadata() if isinstance(v, str)}
        self.calls.append((request, metadata))
        if self.abort is not None:
            await context.abort(*self.abort)
        if self.block:
            self.started.set()
            try:
                await asyncio.Event().wait()  # until the client cancels
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
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
        return gw.GetStatusResponse(workers=self.workers, active_requests=0)


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
        "style": "vivid", "some_future_field": {"x": 1},
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
    ("size not string", {"prompt": "x", "size": 256}, "size"),
    ("response_format url", {"prompt": "x", "response_format": "url"}, "response_format"),
    ("output_format gif", {"prompt": "x", "output_format": "gif"}, "output_format"),
    ("output_compression 101", {"prompt": "x", "output_compression": 101}, "output_compression"),
    ("background transparent", {"prompt": "x", "background": "transparent"}, "background"),
    ("quality ultra", {"prompt": "x", "quality": "ultra"}, "quality"),
    ("stream true", {"prompt": "x", "stream": True}, "stream"),
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
    assert backend.servicer.calls == []


@pytest.mark.parametrize(
    ("content", "param", "code"),
    [
        (b'{"prompt": "x",', None, "invalid_json"),
        (b"not json", None, "invalid_json"),
        (b'{"prompt": "\\ud800"}', "prompt", "invalid_value"),  # lone surrogate
        (b'{"prompt": "x", "guidance_scale": NaN}', "guidance_scale", None),
        (b'{"prompt": "x", "guidance_scale": 1e999}', "guidance_scale", None),
        (b"\xff\xfe\x00", None, None),  # not UTF-8 at all
    ],
)
async def test_raw_bodies_400(
    client: httpx.AsyncClient, content: bytes, param: str | None, code: str | None
) -> None:
    headers = {"content-type": "application/json"}
    resp = await client.post("/v1/images/generations", content=content, headers=headers)
    _assert_error(resp, 400, param, code)


async def test_stream_message(client: httpx.AsyncClient) -> None:
    err = _assert_error(await _generate(client, {"prompt": "x", "stream": True}), 400, "stream")
    assert "streaming is not supported yet" in err["message"]
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


@pytest.mark.parametrize(("code", "http_status"), STATUS_TABLE, ids=[c.name for c, _ in STATUS_TABLE])
async def test_grpc_status_mapping(
    client: httpx.AsyncClient, backend: Backend, code: grpc.StatusCode, http_status: int
) -> None:
    backend.servicer.abort = (code, f"upstream says {code.name}")
    resp = await _generate(client, {"prompt": "x"})
    err = _assert_error(resp, http_status, None, code.name.lower())
    assert err["message"] == f"upstream says {code.name}"
    assert ("retry-after" in resp.headers) == (http_status == 429)
    if http_status == 429:
        assert err["type"] == "rate_limit_error"
        assert int(resp.headers["retry-after"]) >= 1


async def test_gateway_down_is_503(backend: Backend) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    async with rest_client(RestSettings(gateway_address=dead, request_timeout=5, health_timeout=5)) as c:
        _assert_error(await _generate(c, {"prompt": "x"}), 503, None, "unavailable")
        resp = await c.get("/health")
        assert resp.status_code == 503
        assert "unreachable" in resp.json()["reason"]


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
    assert f"no {missing} worker" in resp.json()["reason"]
    backend.servicer.workers.clear()
    assert "no AR and no denoiser" in (await client.get("/health")).json()["reason"]


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


async def test_client_disconnect_cancels_grpc_call(app: FastAPI, backend: Backend) -> None:
    # Raw ASGI call: receive() hands over the body, then reports http.disconnect on demand.
    backend.servicer.block = True
    body = json.dumps({"prompt": "slow"}).encode()
    disconnect = asyncio.Event()
    sent: list[dict[str, Any]] = []
    body_sent = False

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": "/v1/images/generations", "raw_path": b"/v1/images/generations", "query_string": b"",
        "root_path": "", "headers": [(b"host", b"test"), (b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1234), "server": ("test", 80),
    }
    task = asyncio.create_task(app(scope, receive, send))
    await asyncio.wait_for(backend.servicer.started.wait(), 10)
    assert not task.done()
    disconnect.set()
    await asyncio.wait_for(backend.servicer.cancelled.wait(), 10)
    await asyncio.wait_for(task, 10)
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499


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


@hyp_settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=BODIES)
async def test_fuzz_never_5xx(client: httpx.AsyncClient, body: Any) -> None:
    resp = await _generate(client, body)
    assert resp.status_code < 500, (body, resp.text)
    if resp.status_code == 200:
        assert len(resp.json()["data"]) == resp.json()["usage"]["image_count"]
    else:
        assert set(resp.json()["error"]) == {"message", "type", "param", "code"}


async def test_normal_request_after_fuzz(client: httpx.AsyncClient) -> None:
    # Runs after the fuzz test (file order): the app must still be healthy.
    resp = await _generate(client, {"prompt": "still fine", "n": 2})
    assert resp.status_code == 200, resp.text
    assert len(resp.json()["data"]) == 2


def test_settings_are_replaceable() -> None:
    s = replace(RestSettings(), api_keys=("a",))
    assert s.api_keys == ("a",) and s.quality_steps["auto"] == 0
