"""Streaming (SSE) from the REST front: events, partial images, errors before and after the first event, usage.
"""

from __future__ import annotations

import base64

import grpc
import httpx
import openai
import pytest
from fastapi import FastAPI

from glmimage.v1 import common_pb2
from rest.app import RestSettings
from tests.support.rest_gateway import (
    COMPLETED,
    COMPLETED_KEYS,
    COMPLETION_TOKENS_PER_IMAGE,
    PARTIAL,
    PARTIAL_KEYS,
    PNG_MAGIC,
    PROMPT_TOKENS,
    Backend,
    asgi_client,
    assert_error,
    generate,
    image_usage,
    parse_sse,
    rest_client,
)


async def test_stream_events(client: httpx.AsyncClient, backend: Backend) -> None:
    resp = await generate(client, {
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
    assert [d["usage"] for name, d in events if name == COMPLETED] == [image_usage(), image_usage()]
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
    resp = await generate(client, {"prompt": "x", "stream": True})
    events, _ = parse_sse(resp.text)
    assert [name for name, _ in events] == [COMPLETED]
    assert events[0][1]["usage"] == image_usage()
    assert backend.servicer.stream_calls[0][0].partial_images == 0


async def test_stream_false_is_json(client: httpx.AsyncClient, backend: Backend) -> None:
    resp = await generate(client, {"prompt": "x", "stream": False, "partial_images": 3})
    assert resp.headers["content-type"] == "application/json"
    assert len(resp.json()["data"]) == 1
    assert len(backend.servicer.calls) == 1 and backend.servicer.stream_calls == []


@pytest.mark.parametrize("n", [1, 3])
async def test_openai_sdk_stream(app: FastAPI, n: int) -> None:
    from openai.types import ImageGenCompletedEvent, ImageGenPartialImageEvent

    async with asgi_client(app) as http:
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
    resp = await generate(client, {"prompt": "x", "stream": True, "partial_images": 1})
    assert_error(resp, http_status, None, code.name.lower())
    assert ("retry-after" in resp.headers) == (http_status == 429)


async def test_openai_sdk_stream_errors(app: FastAPI, backend: Backend) -> None:
    async with asgi_client(app) as http:
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
    resp = await generate(client, {"prompt": "x", "stream": True, "partial_images": 1})
    assert resp.status_code == 200  # already sent with the first event
    events, _ = parse_sse(resp.text)
    assert [name for name, _ in events] == [PARTIAL, "error"]
    assert events[-1][1]["error"] == {
        "message": "too slow", "type": "timeout_error", "param": None, "code": "deadline_exceeded"}


async def test_stream_without_result_is_an_error_event(client: httpx.AsyncClient, backend: Backend) -> None:
    backend.servicer.stream_without_result = True
    events, _ = parse_sse((await generate(client, {"prompt": "x", "stream": True, "partial_images": 1})).text)
    assert [name for name, _ in events] == [PARTIAL, "error"]
    assert events[-1][1]["error"]["code"] == "incomplete_stream"


async def test_stream_cache_report(backend: Backend) -> None:
    backend.servicer.cached_tokens = 5
    async with rest_client(RestSettings(gateway_address=backend.address, enable_cache_report=True)) as c:
        events, _ = parse_sse((await generate(c, {"prompt": "x", "n": 2, "stream": True})).text)
    assert [d["usage"] for _, d in events] == [image_usage(cached=5)] * 2
