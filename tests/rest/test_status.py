"""The gateway's gRPC statuses as the REST front's HTTP answers, and a client that goes away cancelling its gRPC
call.
"""

from __future__ import annotations

import asyncio
import socket

import grpc
import httpx
import pytest
from fastapi import FastAPI

from rest.app import RestSettings, create_app
from runtime.errors import InvalidArgument
from tests.support.asgi import RawClient
from tests.support.rest_gateway import (
    Backend,
    asgi_client,
    assert_error,
    generate,
    rest_client,
)

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
    resp = await generate(client, {"prompt": "x"})
    err = assert_error(resp, http_status, None, code.name.lower())
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
    err = assert_error(await generate(client, {"prompt": "x"}), 400, param, "invalid_argument")
    assert err["message"] == f"{field}: must be a multiple of 32"


async def test_a_refusal_without_details_has_no_param(client: httpx.AsyncClient, backend: Backend) -> None:
    # An older gateway sends the field only in its text: REST does not guess it back out of the message.
    backend.servicer.abort = (grpc.StatusCode.INVALID_ARGUMENT, "height: must be a multiple of 32")
    assert_error(await generate(client, {"prompt": "x"}), 400, None, "invalid_argument")


async def test_gateway_down_is_503(backend: Backend) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    async with rest_client(RestSettings(gateway_address=dead, request_timeout=5, health_timeout=5)) as c:
        err = assert_error(await generate(c, {"prompt": "x"}), 503, None, "unavailable")
        resp = await c.get("/health")
        assert resp.status_code == 503
        assert "unreachable" in resp.json()["reason"]
        # gRPC's own text ("ipv4:127.0.0.1:PORT: Failed to connect to remote host") stays in the log.
        for text in (err["message"], resp.text):
            assert dead not in text and "ipv4" not in text and "127.0.0.1" not in text, text



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
        async with asgi_client(app) as c:  # a stream that runs to its end still counts as 200
            assert (await generate(c, {"prompt": "x", "stream": True})).status_code == 200
            text = (await c.get("/metrics")).text
    assert 'glmimage_rest_requests_total{route="/v1/images/generations",status="499"} 1.0' in text
    assert 'glmimage_rest_requests_total{route="/v1/images/generations",status="200"} 1.0' in text
