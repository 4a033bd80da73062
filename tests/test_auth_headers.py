"""The one key check (runtime.auth.bearer_token, key_hits) on both paths, the gateway's gRPC interceptor
and the REST front: a repeated authorization header is refused, and keys compare as UTF-8 bytes."""
from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import grpc
import httpx
import pytest

from gateway.auth import GatewayAuth
from rest.app import create_app
from rest.settings import RestSettings
from runtime.auth import bearer_token
from runtime.tenants import TenantsFile, tenants_from_keys
from tests.support.sim_gateway import Gateway, request, rpc_error, running_gateway, sim_cluster

KEY = "clé-für-tests-ü"  # not ASCII
KEY_UTF8 = b"Bearer " + KEY.encode("utf-8")
KEY_LATIN1 = b"Bearer " + KEY.encode("latin-1")  # the same characters, other bytes: not the key
OTHER = "other-key-for-tests"
METHOD = "/glmimage.v1.GatewayService/GenerateImages"


@pytest.mark.parametrize(("entries", "token"), [
    ([("authorization", "Bearer abc")], b"abc"),
    ([(b"authorization", b"bearer  abc ")], b"abc"),  # raw HTTP headers; the scheme in any case
    ([("authorization", "Bearer abc"), ("authorization", "Bearer abc")], None),  # repeated, even alike
    ([(b"authorization", b"Bearer abc"), (b"Authorization", b"Bearer xyz")], None),
    ([("authorization", "Basic abc")], None),
    ([("authorization", "Bearer ")], None),
    ([("x-other", "Bearer abc")], None),
    ([("authorization", f"Bearer {KEY}")], KEY.encode("utf-8")),  # text is compared as its UTF-8 bytes
    ([(b"authorization", KEY_UTF8)], KEY.encode("utf-8")),
])
def test_bearer_token(entries, token) -> None:
    assert bearer_token(entries) == token


# ---- gRPC: the gateway's interceptor --------------------------------------------------------------------------


def test_the_interceptor_compares_text_as_utf8() -> None:
    # gRPC clients send printable ASCII only (C-core refuses other metadata values before sending), so this path
    # sees a non-ASCII key only as text a server hands over; it compares that as UTF-8, like REST's raw bytes.
    check = GatewayAuth(TenantsFile(None, tenants_from_keys((KEY,), ()))).check
    assert check(METHOD, [("authorization", f"Bearer {KEY}")]) is None
    mojibake = KEY_UTF8.decode("latin-1")  # the key's UTF-8 bytes read as Latin-1: other text
    assert check(METHOD, [("authorization", mojibake)])[0] is grpc.StatusCode.UNAUTHENTICATED
    assert check(METHOD, [("authorization", f"Bearer {KEY}")] * 2)[0] is grpc.StatusCode.UNAUTHENTICATED


@contextlib.asynccontextmanager
async def gateway_with_keys() -> AsyncIterator[Gateway]:
    async with sim_cluster() as cluster, running_gateway(
            [cluster.address(cluster.ar)], [cluster.address(d) for d in cluster.denoisers],
            api_keys=(OTHER,)) as gw:
        yield gw


async def test_the_gateway_refuses_a_repeated_credential() -> None:
    async with gateway_with_keys() as gw:
        one = (("authorization", f"Bearer {OTHER}"),)
        assert len((await gw.stub.GenerateImages(request(), metadata=one)).images) == 1
        err = await rpc_error(gw.stub.GenerateImages(request(), metadata=one * 2))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED


# ---- REST: the front's own keys, and what it forwards ---------------------------------------------------------


@contextlib.asynccontextmanager
async def _client(**settings: object) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(RestSettings(**settings))  # type: ignore[arg-type]
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        yield client


@pytest.mark.parametrize(("headers", "status"), [
    ([(b"authorization", KEY_UTF8)], 200),
    ([(b"authorization", KEY_LATIN1)], 401),
    ([(b"authorization", KEY_UTF8), (b"authorization", KEY_UTF8)], 401),  # repeated, even alike
    ([(b"authorization", KEY_UTF8), (b"authorization", f"Bearer {OTHER}".encode())], 401),
])
async def test_rest_keys_compare_as_utf8_and_refuse_repeats(headers, status: int) -> None:
    # /v1/models needs no gateway (a failed ListLoras leaves the served names): only the key check is at work.
    async with _client(gateway_address="127.0.0.1:1", api_keys=(KEY,)) as client:
        resp = await client.get("/v1/models", headers=headers)
    assert resp.status_code == status, resp.text
    if status == 401:
        assert resp.json()["error"]["code"] == "invalid_api_key"


async def test_rest_forwards_no_repeated_credential_to_the_gateway() -> None:
    # REST checks no key here; the gateway checks the one it is forwarded, and is forwarded none of two.
    async with gateway_with_keys() as gw, _client(gateway_address=f"127.0.0.1:{gw.port}") as client:
        one = [(b"authorization", f"Bearer {OTHER}".encode())]
        body = {"prompt": "x", "size": "64x64"}
        assert (await client.post("/v1/images/generations", json=body, headers=one)).status_code == 200
        resp = await client.post("/v1/images/generations", json=body, headers=one * 2)
        assert resp.status_code == 401 and resp.json()["error"]["code"] == "unauthenticated", resp.text

