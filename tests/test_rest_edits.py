"""POST /v1/images/edits: the openai SDK's multipart edits through the REST front to a scripted gateway on real gRPC
(tests/support/edit_gateway.py), its bad input (always 4xx naming the param), its body bounds and its OpenAPI."""
from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio
from fastapi import FastAPI
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai.types import ImageEditCompletedEvent, ImageEditPartialImageEvent

from glmimage.v1 import gateway_service_pb2 as gw
from rest.app import RestSettings, create_app
from rest.errors import param_of
from rest.translate import auto_size
from runtime.limits import MAX_ASPECT, Limits
from tests.support.edit_gateway import IMAGE_TOKENS_PER_REFERENCE, serve_edit_fake
from tests.support.fake_gateway import FakeServer
from tests.support.images import image_file

EDITS = "/v1/images/edits"


_image = image_file


RED, BLUE = _image(color=(255, 0, 0)), _image(color=(0, 0, 255))


@pytest.fixture(scope="module")
def edit_server() -> Iterator[FakeServer]:
    with serve_edit_fake() as srv:
        yield srv


@pytest.fixture()
def fake(edit_server: FakeServer) -> FakeServer:
    """The module's gateway, its calls cleared; the module's app keeps the default limits."""
    edit_server.servicer.reset()
    return edit_server


@asynccontextmanager
async def _app(server: FakeServer, limits: Limits | None = None, **settings: Any) -> AsyncIterator[FastAPI]:
    """A fresh app, lifespan included, after the fake gateway's calls are cleared and its GetLimits set to
    ``limits`` (the defaults when None): the app reads them at start."""
    server.servicer.reset()
    server.servicer.limits = limits or Limits()
    app = create_app(RestSettings(gateway_address=server.address, **settings))
    async with app.router.lifespan_context(app):
        assert app.state.limits.current == server.servicer.limits
        yield app


def _http(app: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


@pytest_asyncio.fixture(scope="module")
async def app(edit_server: FakeServer) -> AsyncIterator[FastAPI]:
    async with _app(edit_server) as app:
        yield app


@pytest_asyncio.fixture()
async def client(app: FastAPI, fake: FakeServer) -> AsyncIterator[httpx.AsyncClient]:
    async with _http(app) as c:
        yield c


@pytest_asyncio.fixture()
async def sdk(client: httpx.AsyncClient) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url="http://test/v1", api_key="sk-edit", max_retries=0,
                                  http_client=client) as sdk:
        yield sdk


def _requests(fake: FakeServer, method: str = "GenerateImages") -> list[Any]:
    return [c.request for c in fake.servicer.calls if c.method == method]


def _assert_error(resp: httpx.Response, status: int, param: str | None) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param, err
    return err


# --- the SDK ----------------------------------------------------------------------------------------------------


async def test_sdk_edit_two_images(sdk: openai.AsyncOpenAI, fake: FakeServer) -> None:
    res = await sdk.images.edit(image=[("red.png", RED, "image/png"), ("blue.png", BLUE, "image/png")],
                                prompt="make it a watercolour", size="64x64", n=2, quality="low",
                                output_format="webp", extra_body={"seed": 5, "guidance_scale": 2.0})
    [(req)] = _requests(fake)
    assert [ref.data for ref in req.reference_images] == [RED, BLUE]
    assert (req.prompt, req.n, req.width, req.height) == ("make it a watercolour", 2, 64, 64)
    assert (req.seed, req.guidance_scale, req.num_inference_steps) == (5, 2.0, 10)  # quality low: 10 steps
    metadata = fake.servicer.calls[-1].metadata
    assert metadata["authorization"] == "Bearer sk-edit" and metadata["x-request-id"]
    assert len(res.data) == 2 and res.size == "64x64" and res.output_format == "webp"
    usage = res.usage
    assert usage is not None
    image_tokens = IMAGE_TOKENS_PER_REFERENCE * 2 * 2  # two references, for each of the two outputs
    assert usage.input_tokens_details.image_tokens == image_tokens
    assert usage.input_tokens_details.text_tokens == 4 * 2  # the fake's prompt tokens: its words, per output
    assert usage.input_tokens == image_tokens + usage.input_tokens_details.text_tokens


async def test_sdk_edit_with_the_fields_taken_and_ignored(sdk: openai.AsyncOpenAI, fake: FakeServer) -> None:
    await sdk.images.edit(image=("one.png", RED, "image/png"), prompt="x", size="64x64", input_fidelity="high",
                          user="u", safety_identifier="s", background="opaque")
    assert len(_requests(fake)) == 1
    with pytest.raises(openai.BadRequestError) as exc:
        await sdk.images.edit(image=("one.png", RED, "image/png"), prompt="x", extra_body={"num_inference_step": 3})
    assert exc.value.code == "unknown_parameter" and exc.value.param == "num_inference_step"
    assert "did you mean 'num_inference_steps'?" in exc.value.message


async def test_sdk_single_image_file(sdk: openai.AsyncOpenAI, fake: FakeServer) -> None:
    res = await sdk.images.edit(image=("one.jpg", _image(fmt="JPEG"), "image/jpeg"), prompt="night", size="96x64")
    [req] = _requests(fake)
    assert [ref.data for ref in req.reference_images] == [_image(fmt="JPEG")]
    assert (req.n, req.width, req.height) == (1, 96, 64)
    assert len(res.data) == 1 and res.usage is not None
    assert res.usage.input_tokens_details.image_tokens == IMAGE_TOKENS_PER_REFERENCE


@pytest.mark.parametrize("size", ["auto", None])
async def test_size_auto_follows_the_first_image(sdk: openai.AsyncOpenAI, fake: FakeServer, size: str | None) -> None:
    # Chosen: the first reference's own pixel count and aspect ratio, each side rounded (half up) to 32.
    extra = {} if size is None else {"size": size}
    res = await sdk.images.edit(image=[("wide.png", _image((100, 70)), "image/png"),
                                       ("tall.png", _image((64, 96)), "image/png")], prompt="x", **extra)
    [req] = _requests(fake)
    assert (req.width, req.height) == (96, 64)
    assert res.size == "96x64"


def test_auto_size_rule() -> None:
    assert auto_size(96, 64, 2048 * 2048) == (96, 64)
    assert auto_size(8, 8, 2048 * 2048) == (32, 32)  # never under 32
    assert auto_size(100, 70, 2048 * 2048) == (96, 64)
    assert auto_size(112, 80, 2048 * 2048) == (128, 96)  # 3.5 and 2.5 sides of 32 round up
    # Larger than the budget: scaled down to it, the aspect kept within the rounding.
    for width, height, budget in [(3000, 1500, 2048 * 2048), (4096, 4096, 512 * 512), (1000, 250, 256 * 256)]:
        w, h = auto_size(width, height, budget)
        assert w % 32 == 0 and h % 32 == 0 and w * h <= budget
        assert w * h > budget * 0.9
        assert abs(w / h - width / height) < 0.1 * width / height
    # A 4:1 reference never gives a target past the aspect bound the gateway holds targets to.
    assert auto_size(188, 47, 2048 * 2048) == (192, 64)  # rounded alone: 192x32, 6:1
    assert auto_size(188, 47, 192 * 32) == (128, 32)  # no room to widen: shortened
    for width in range(32, 400, 3):
        w, h = auto_size(width, -(-width // 4), 2048 * 2048)
        assert max(w, h) <= MAX_ASPECT * min(w, h), (width, w, h)


async def test_size_auto_within_a_lower_pixel_limit(edit_server: FakeServer) -> None:
    async with _app(edit_server, dataclasses.replace(Limits(), max_pixels=128 * 128)) as app, _http(app) as http:
        resp = await http.post(EDITS, files=[("image", ("big.png", _image((512, 256)), "image/png"))],
                               data={"prompt": "x"})
    assert resp.status_code == 200, resp.text
    [req] = _requests(edit_server)
    assert (req.width, req.height) == (160, 96)  # 181x90 scaled, each side rounded to 32; 15360 <= 16384 pixels


async def test_sdk_stream_edit_events(sdk: openai.AsyncOpenAI, fake: FakeServer) -> None:
    stream = await sdk.images.edit(image=[("red.png", RED, "image/png")], prompt="x", size="64x64", stream=True,
                                   partial_images=2)
    events = [event async for event in stream]
    assert [type(e) for e in events] == [ImageEditPartialImageEvent] * 2 + [ImageEditCompletedEvent]
    assert [e.type for e in events] == ["image_edit.partial_image"] * 2 + ["image_edit.completed"]
    assert [e.partial_image_index for e in events[:2]] == [0, 1]
    done = events[-1]
    assert isinstance(done, ImageEditCompletedEvent)
    assert done.usage.input_tokens_details.image_tokens == IMAGE_TOKENS_PER_REFERENCE
    assert done.usage.input_tokens == IMAGE_TOKENS_PER_REFERENCE + done.usage.input_tokens_details.text_tokens
    assert all("usage" not in e.model_dump() for e in events[:2])  # only completed carries usage
    [req] = _requests(fake, "GenerateImagesStream")
    assert req.partial_images == 2 and [ref.data for ref in req.request.reference_images] == [RED]


async def test_generation_usage_has_no_image_tokens(sdk: openai.AsyncOpenAI, fake: FakeServer) -> None:
    res = await sdk.images.generate(prompt="a red fox", size="64x64")
    assert res.usage is not None
    assert res.usage.input_tokens_details.image_tokens == 0
    assert res.usage.input_tokens_details.text_tokens == res.usage.input_tokens == 3


# --- bad input ----------------------------------------------------------------------------------------------------


def _file(data: bytes, name: str = "image[]", filename: str = "f.png") -> tuple[str, tuple[str, bytes, str]]:
    return (name, (filename, data, "image/png"))


def _text(name: str, value: str) -> tuple[str, tuple[None, bytes]]:
    return (name, (None, value.encode()))  # a part without a filename: a text field


ONE = [_file(RED)]
PROMPT = [_text("prompt", "x")]
BAD_FORMS: list[tuple[str, list[Any], str]] = [
    ("mask given", ONE + PROMPT + [_file(BLUE, "mask")], "mask"),
    ("mask as text", ONE + PROMPT + [_text("mask", "x")], "mask"),
    ("17 images", [_file(RED)] * 17 + PROMPT, "image"),
    ("18 images", [_file(RED)] * 18 + PROMPT, "image"),
    ("no image", PROMPT, "image"),
    ("not an image", [_file(b"hello, not a picture")] + PROMPT, "image"),
    ("second not an image", ONE + [_file(b"GIF89a nope")] + PROMPT, "image"),
    ("image URL as text", [_text("image", "https://example.com/cat.png")] + PROMPT, "image"),
    ("image[] as text", [_text("image[]", "https://example.com/cat.png")] + PROMPT, "image"),
    ("GIF", [_file(_image(fmt="GIF"), filename="a.gif")] + PROMPT, "image"),
    ("too elongated", [_file(_image((160, 32)))] + PROMPT, "image"),
    ("empty prompt", ONE + [_text("prompt", "")], "prompt"),
    ("blank prompt", ONE + [_text("prompt", "   ")], "prompt"),
    ("missing prompt", ONE, "prompt"),
    ("prompt as a file", ONE + [_file(b"x", "prompt")], "prompt"),
    ("n too big", ONE + PROMPT + [_text("n", "11")], "n"),
    ("n zero", ONE + PROMPT + [_text("n", "0")], "n"),
    ("n not a number", ONE + PROMPT + [_text("n", "two")], "n"),
    ("size garbage", ONE + PROMPT + [_text("size", "big")], "size"),
    ("size over the pixels", ONE + PROMPT + [_text("size", "4096x4096")], "size"),
    ("size too elongated", ONE + PROMPT + [_text("size", "1x8000")], "size"),
    ("output_format gif", ONE + PROMPT + [_text("output_format", "gif")], "output_format"),
    ("background transparent", ONE + PROMPT + [_text("background", "transparent")], "background"),
    ("stream not a bool", ONE + PROMPT + [_text("stream", "maybe")], "stream"),
    ("partial_images 4", ONE + PROMPT + [_text("stream", "true"), _text("partial_images", "4")], "partial_images"),
    ("seed negative", ONE + PROMPT + [_text("seed", "-1")], "seed"),
    ("guidance NaN", ONE + PROMPT + [_text("guidance_scale", "nan")], "guidance_scale"),
    ("steps too many", ONE + PROMPT + [_text("num_inference_steps", "1001")], "num_inference_steps"),
    ("response_format unknown", ONE + PROMPT + [_text("response_format", "png")], "response_format"),
    ("a typo", ONE + PROMPT + [_text("sead", "3")], "sead"),
    ("a generation's field", ONE + PROMPT + [_text("style", "vivid")], "style"),
    ("an unknown file", ONE + PROMPT + [_file(RED, "markup")], "markup"),
]


@pytest.mark.parametrize(("parts", "param"), [(p, q) for _, p, q in BAD_FORMS], ids=[i for i, _, _ in BAD_FORMS])
async def test_bad_forms_400(client: httpx.AsyncClient, fake: FakeServer, parts: list[Any], param: str) -> None:
    err = _assert_error(await client.post(EDITS, files=parts), 400, param)
    assert err["type"] == "invalid_request_error"
    assert fake.servicer.calls == []


@pytest.mark.parametrize(("kwargs", "status"), [
    ({"json": {"prompt": "x", "image": "https://example.com/cat.png"}}, 415),
    ({"data": {"prompt": "x", "image": "https://example.com/cat.png"}}, 415),  # urlencoded
    ({"content": b"--b\r\nbroken", "headers": {"content-type": "multipart/form-data; boundary=b"}}, 400),
    ({"content": b"x", "headers": {"content-type": "multipart/form-data"}}, 400),  # no boundary
])
async def test_not_a_multipart_form(client: httpx.AsyncClient, fake: FakeServer, kwargs: dict[str, Any],
                                    status: int) -> None:
    # A body cut short holds no part at all: the missing image is named.
    param = "image" if kwargs.get("content", b"").startswith(b"--b") else None
    _assert_error(await client.post(EDITS, **kwargs), status, param)
    assert fake.servicer.calls == []


SMALL = dataclasses.replace(Limits(), max_reference_bytes=16 << 10, max_reference_total_bytes=64 << 10)
FORM_BYTES = 8 << 10  # RestSettings.max_body_bytes: the room for the text fields


async def test_a_file_over_the_per_file_bound_is_413(edit_server: FakeServer) -> None:
    async with _app(edit_server, SMALL, max_body_bytes=FORM_BYTES) as app, _http(app) as http:
        resp = await http.post(EDITS, files=[_file(b"\x89PNG" + bytes(20 << 10))] + PROMPT)
        _assert_error(resp, 413, "image")
        # Under both bounds, three files pass the body bound and the per-file one, and are summed by check().
        ok = await http.post(EDITS, files=[_file(RED)] * 3 + PROMPT)
        assert ok.status_code == 200, ok.text
    assert len(_requests(edit_server)) == 1


async def test_a_body_over_the_total_bound_is_413_before_it_is_read(edit_server: FakeServer) -> None:
    chunk = bytes(8 << 10)
    pulled = 0

    async def body() -> AsyncIterator[bytes]:  # chunked: no Content-Length to refuse it by
        nonlocal pulled
        yield b'--b\r\nContent-Disposition: form-data; name="image"; filename="a.png"\r\n\r\n'
        for _ in range(64):  # one file of 512 KiB
            pulled += 1
            yield chunk

    async with _app(edit_server, SMALL, max_body_bytes=FORM_BYTES) as app, _http(app) as http:
        headers = {"content-type": "multipart/form-data; boundary=b"}
        _assert_error(await http.post(EDITS, content=body(), headers=headers), 413, None)
        bound = SMALL.max_reference_total_bytes + FORM_BYTES
        assert pulled * len(chunk) <= bound + len(chunk) < 64 * len(chunk)  # refused once past the bound
        # A declared Content-Length over the bound is refused before any of the body is read.
        declared = await http.post(EDITS, files=[_file(bytes(40 << 10))] * 2 + PROMPT)
        err = _assert_error(declared, 413, None)
        assert str(bound) in err["message"]
        # The JSON routes keep their own, smaller bound.
        _assert_error(await http.post("/v1/images/generations", json={"prompt": "x" * (16 << 10)}), 413, None)
    assert edit_server.servicer.calls == []


FIELD_NAMES = ["prompt", "n", "size", "quality", "output_format", "output_compression", "background", "stream",
               "partial_images", "seed", "num_inference_steps", "guidance_scale", "model", "user", "image", "mask"]
PARTS = st.one_of(
    st.tuples(st.sampled_from(FIELD_NAMES), st.text(max_size=40)).map(lambda nv: _text(*nv)),
    st.tuples(st.sampled_from(["image", "image[]", "prompt"]),
              st.sampled_from([RED, _image(fmt="GIF"), _image((33, 200)), b"", b"\x89PNG\r\n\x1a\n"])
              ).map(lambda nv: _file(nv[1], nv[0])),
)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(parts=st.lists(PARTS, min_size=1, max_size=6))
async def test_fuzz_forms_never_5xx(client: httpx.AsyncClient, parts: list[Any]) -> None:
    resp = await client.post(EDITS, files=parts)
    assert resp.status_code < 500, resp.text
    if resp.status_code != 200:
        assert set(resp.json()["error"]) == {"message", "type", "param", "code"}


def test_gateway_reference_fields_are_the_image_param() -> None:
    assert param_of("reference_images") == param_of("reference_images[3]") == "image"
    assert param_of("reference_imagesx") is None


# --- OpenAPI ------------------------------------------------------------------------------------------------------


async def test_openapi_documents_edits(client: httpx.AsyncClient) -> None:
    doc = (await client.get("/openapi.json")).json()
    op = doc["paths"][EDITS]["post"]
    assert op["requestBody"]["content"]["multipart/form-data"]["schema"] == {
        "$ref": "#/components/schemas/ImageEditRequest"}
    assert "422" not in op["responses"] and "413" in op["responses"]
    events = op["responses"]["200"]["content"]["text/event-stream"]["schema"]["oneOf"]
    assert {e["$ref"].rsplit("/", 1)[1] for e in events} == {"ImageEditPartialImageEvent", "ImageEditCompletedEvent"}
    schemas = doc["components"]["schemas"]
    props = schemas["ImageEditRequest"]["properties"]
    assert all(p.get("description") for p in props.values())
    assert props["image"]["maxItems"] == Limits().max_reference_images
    assert props["image"]["items"] == {"type": "string", "format": "binary"}
    assert set(schemas["ImageEditRequest"]["required"]) == {"prompt", "image"}
    for name in ("ImageEditPartialImageEvent", "ImageEditCompletedEvent"):
        assert name in schemas
    assert gw.GenerateImagesRequest.DESCRIPTOR.fields_by_name["reference_images"].number == 12
