"""What the REST front refuses before the gateway sees it, and how: unknown fields by name, bad values with the
OpenAI `param`, bodies that are not JSON or too large, unknown routes.
"""

from __future__ import annotations

import ast
import asyncio
import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from fastapi import FastAPI

from glmimage.v1 import common_pb2
from rest import __main__ as rest_main
from rest.app import RestSettings, create_app
from runtime.limits import from_proto
from tests.support.rest_gateway import (
    Backend,
    asgi_client,
    assert_error,
    generate,
    rest_client,
)

# --- validation ---------------------------------------------------------------------------------


async def test_unknown_fields_are_refused_by_name(client: httpx.AsyncClient, backend: Backend) -> None:
    # A typo must not give an image nobody asked for (the default steps, a random seed): OpenAI refuses it too.
    err = assert_error(await generate(client, {"prompt": "x", "num_inference_step": 3, "sead": 1}), 400,
                        "num_inference_step", "unknown_parameter")
    assert "'num_inference_step' (did you mean 'num_inference_steps'?)" in err["message"]
    assert "'sead' (did you mean 'seed'?)" in err["message"]
    # Named before any other fault of the body, which the typo likely explains.
    err = assert_error(await generate(client, {"prompt": "x", "n": "two", "x" * 1000: 1}), 400,
                        "x" * 64, "unknown_parameter")
    assert backend.servicer.calls == []


async def test_the_sdk_sends_what_is_accepted_and_nothing_unknown(app: FastAPI, backend: Backend) -> None:
    async with asgi_client(app) as http:
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
    ("output_format gif", {"prompt": "x", "output_format": "gif"}, "output_format"),
    ("output_compression 101", {"prompt": "x", "output_compression": 101}, "output_compression"),
    ("background transparent", {"prompt": "x", "background": "transparent"}, "background"),
    ("quality ultra", {"prompt": "x", "quality": "ultra"}, "quality"),
    ("stream as string", {"prompt": "x", "stream": "yes"}, "stream"),
    ("partial_images -1", {"prompt": "x", "stream": True, "partial_images": -1}, "partial_images"),
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
    err = assert_error(await generate(client, body), 400, param)
    assert err["type"] == "invalid_request_error"
    assert backend.servicer.calls == [] and backend.servicer.stream_calls == []


async def test_a_float32_limit_and_value_are_shown_as_the_client_wrote_them(backend: Backend) -> None:
    # GetLimits carries max_guidance as a float32: --max-guidance 30.01 arrives as 30.010000228881836.
    app = create_app(RestSettings(gateway_address=backend.address))
    async with app.router.lifespan_context(app), asgi_client(app) as client:
        app.state.limits.current = from_proto(common_pb2.Limits(max_guidance=30.01))
        assert app.state.limits.current.max_guidance != 30.01
        err = assert_error(await generate(client, {"prompt": "x", "guidance_scale": 30.02}), 400,
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
    root = Path(__file__).resolve().parents[2]
    sources = [*sorted((root / "rest").glob("*.py")), root / "runtime/admission.py",
               root / "runtime/limits.py"]
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
    err = assert_error(await generate(client, {"prompt": "x", "size": size}), 400, "size", "invalid_value")
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
    assert_error(resp, 400, param, code)


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
    err = assert_error(await client.post("/v1/images/generations", content=content, headers=headers), 415, None,
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
        err = assert_error(await generate(c, big), 413, None, "request_too_large")
        assert str(limit) in err["message"]

        async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: httpx sends it chunked
            data = json.dumps(big).encode()
            for i in range(0, len(data), 1000):
                yield data[i:i + 1000]

        resp = await c.post("/v1/images/generations", content=chunks(), headers={"content-type": "application/json"})
        assert "content-length" not in resp.request.headers
        assert_error(resp, 413, None, "request_too_large")
        # Just under the limit still works, both ways.
        small = {"prompt": "x" * 4000}
        assert (await generate(c, small)).status_code == 200

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


async def test_response_format_values(client: httpx.AsyncClient) -> None:
    """url and b64_json are OpenAI's two; anything else is a 400 on response_format (url: tests/test_jobs_e2e)."""
    assert_error(await generate(client, {"prompt": "x", "response_format": "png"}), 400, "response_format")


async def test_unknown_route_and_method_are_openai_shaped(client: httpx.AsyncClient) -> None:
    assert_error(await client.get("/v1/nope"), 404, None, "not_found")
    assert_error(await client.get("/v1/images/generations"), 405, None, "method_not_allowed")
