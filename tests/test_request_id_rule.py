"""One rule for a client's request id on every hop (runtime.logs.accepted_request_id): the REST front
(the id it echoes in x-request-id, logs and sends to the gateway) and every gRPC server (the id its logs carry) keep
the same ids and replace the same hostile ones with a fresh id of the same form."""
from __future__ import annotations

import re
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import httpx
import pytest
import pytest_asyncio
from grpc._cython import cygrpc

from glmimage.v1 import gateway_service_pb2 as gw
from glmimage.v1 import gateway_service_pb2_grpc as gw_grpc
from rest.app import RestSettings, create_app
from runtime.logs import MAX_REQUEST_ID_CHARS, accepted_request_id, request_id_var
from runtime.server import GrpcServer, request_id_from, start_server
from tests.support.rest_gateway import FakeGateway, asgi_client

FRESH = re.compile(r"req-[0-9a-f]{32}")

KEPT = [
    "my-req-42",
    "req-0123456789abcdef0123456789abcdef",
    "r" * MAX_REQUEST_ID_CHARS,
    "Root=1-5759e988-bd862e3f;Parent=53995c3f42cd8ad8;Sampled=1",  # an AWS trace header, kept whole
    "!#$%&'*+-.^_`|~",
]
REPLACED = [
    "",
    "r" * (MAX_REQUEST_ID_CHARS + 1),
    "a b",  # a space lets an id pass for more words of a log line
    "a\tb",
    "a\x00b",
    "a\x1b[31mred",
    "a\x7f",
    "a\nb",
    "ok\r\nSet-Cookie: session=stolen",  # header injection into the echoed response
    "ok\r\n2026-01-01 00:00:00 ERROR forged line",  # a forged log line
    "caf\u00e9",
    "\U0001F600",
]


@dataclass
class Stack:
    gateway: RecordingGateway
    server: GrpcServer
    rest: httpx.AsyncClient


class RecordingGateway(FakeGateway):
    """The scripted gateway, noting the id its server adopted for each call (what its log lines carry)."""

    def reset(self) -> None:
        super().reset()
        self.adopted: list[str] = []

    async def GenerateImages(self, request, context):  # type: ignore[override]
        self.adopted.append(request_id_var.get())
        return await super().GenerateImages(request, context)


@pytest_asyncio.fixture(scope="module")
async def stack() -> AsyncIterator[Stack]:
    gateway = RecordingGateway()
    server = await start_server(lambda s: gw_grpc.add_GatewayServiceServicer_to_server(gateway, s),
                                ["glmimage.v1.GatewayService"], "127.0.0.1:0")
    await server.set_serving(True)
    app = create_app(RestSettings(gateway_address=f"127.0.0.1:{server.port}"))
    try:
        async with app.router.lifespan_context(app), asgi_client(app) as rest:
            yield Stack(gateway, server, rest)
    finally:
        await server.stop(0)


@pytest.fixture(autouse=True)
def _reset(stack: Stack) -> None:
    stack.gateway.reset()


async def _through_rest(stack: Stack, *values: str) -> tuple[str, str, str]:
    """(the id REST echoed, the one the gateway received, the one the gateway's server adopted)."""
    headers = [("x-request-id", v.encode()) for v in values]  # bytes: the transport sends them as they are
    resp = await stack.rest.post("/v1/images/generations", json={"prompt": "a fox"}, headers=headers)
    assert resp.status_code == 200, resp.text
    [(_, metadata)] = stack.gateway.calls
    [adopted] = stack.gateway.adopted
    return resp.headers["x-request-id"], metadata["x-request-id"], adopted


async def _through_grpc(stack: Stack, *values: str) -> str | None:
    """The id the gRPC server adopted for a call with these x-request-id values; None if the client library
    refuses to send them (not valid gRPC metadata: the server can never see them from it)."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.server.port}") as channel:
        stub = gw_grpc.GatewayServiceStub(channel)
        try:
            await stub.GenerateImages(gw.GenerateImagesRequest(prompt="a fox"), timeout=10,
                                      metadata=tuple(("x-request-id", v) for v in values))
        except cygrpc.ExecuteBatchError:  # grpc refuses to send metadata that is not printable ASCII
            assert not stack.gateway.adopted, "refused after reaching the server"
            return None
    [adopted] = stack.gateway.adopted
    return adopted


@pytest.mark.parametrize("rid", KEPT)
def test_the_rule_keeps_a_fit_id(rid: str) -> None:
    assert accepted_request_id(rid) == accepted_request_id(rid.encode()) == rid
    assert request_id_from([("x-request-id", rid)]) == rid


@pytest.mark.parametrize("rid", REPLACED)
def test_the_rule_refuses_a_hostile_id(rid: str) -> None:
    assert accepted_request_id(rid) is None and accepted_request_id(rid.encode()) is None
    assert request_id_from([("x-request-id", rid)]) is None


@pytest.mark.parametrize("rid", KEPT)
async def test_both_fronts_keep_a_fit_id(stack: Stack, rid: str) -> None:
    assert await _through_rest(stack, rid) == (rid, rid, rid)
    stack.gateway.reset()
    assert await _through_grpc(stack, rid) == rid


@pytest.mark.parametrize("rid", REPLACED)
async def test_both_fronts_replace_a_hostile_id_with_a_fresh_one(stack: Stack, rid: str) -> None:
    echoed, sent, adopted = await _through_rest(stack, rid)
    assert FRESH.fullmatch(echoed) and sent == adopted == echoed
    stack.gateway.reset()
    adopted = await _through_grpc(stack, rid)
    assert adopted is None or (FRESH.fullmatch(adopted) and adopted != rid)


@pytest.mark.parametrize("values", [("first-id", "second-id"), ("first-id", "a b"), ("a b", "second-id"),
                                    ("", "second-id")])
async def test_a_repeated_id_is_judged_by_its_first_value_on_both(stack: Stack, values: tuple[str, str]) -> None:
    expected = accepted_request_id(values[0])
    echoed, _, _ = await _through_rest(stack, *values)
    stack.gateway.reset()
    adopted = await _through_grpc(stack, *values)
    assert adopted is not None
    for got in (echoed, adopted):
        assert got == expected if expected else FRESH.fullmatch(got), (values, got)
