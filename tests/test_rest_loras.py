"""The REST front's LoRA adapters, through a scripted gateway that serves GetLimits and ListLoras and refuses an
adapter it does not know as the real one does (INVALID_ARGUMENT, field "loras"): the `loras` body field (a JSON
form field on edits) as it reaches the gateway, every malformed one a 400 naming it, `model` naming an adapter
(vLLM's convention), the adapters on /v1/models, and a failing ListLoras touching nothing else."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import math
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from types import SimpleNamespace
from typing import Any

import grpc
import httpx
import openai
import pytest
from fastapi import FastAPI

from glmimage.v1 import common_pb2, gateway_service_pb2
from rest.adapters import AdapterCache
from rest.app import RestSettings, create_app
from rest.errors import param_of
from rest.schemas import LORA_NAME_PATTERN
from runtime.errors import InvalidArgument
from runtime.limits import Limits, check_lora_name
from tests.support.edit_gateway import serve_edit_fake
from tests.support.fake_gateway import FakeServer
from tests.support.images import image_file

GENERATIONS, EDITS = "/v1/images/generations", "/v1/images/edits"
STYLE, INK = "tiny-style", "ink.v2"
DEFAULT_LIMITS = Limits()
SERVED = [common_pb2.LoraInfo(name=STYLE, description="demo", default_scale=0.8, size_bytes=1234),
          common_pb2.LoraInfo(name=INK, default_scale=1.0)]


@pytest.fixture(scope="module")
def server() -> Iterator[FakeServer]:
    with serve_edit_fake() as srv:
        yield srv


@asynccontextmanager
async def _client(server: FakeServer, limits: Limits = DEFAULT_LIMITS, loras: list[common_pb2.LoraInfo] | None = None,
                  **settings: Any) -> AsyncIterator[httpx.AsyncClient]:
    server.servicer.reset()
    server.servicer.limits = limits
    server.servicer.loras = SERVED if loras is None else loras
    app: FastAPI = create_app(RestSettings(gateway_address=server.address, **settings))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            yield client


def _generations(server: FakeServer) -> list[gateway_service_pb2.GenerateImagesRequest]:
    return [c.request if c.method == "GenerateImages" else c.request.request
            for c in server.servicer.calls if c.method.startswith("GenerateImages")]


def _sent(server: FakeServer) -> list[tuple[str, float | None]]:
    """The adapters of the one gateway call: (name, scale or None when unset)."""
    [request] = _generations(server)
    return [(ref.name, ref.scale if ref.HasField("scale") else None) for ref in request.loras]


def _assert_400(resp: httpx.Response, param: str) -> None:
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error
    assert "Traceback" not in error["message"]


def _edit(**fields: Any) -> dict[str, Any]:
    return {"data": {"prompt": "make it red", **fields},
            "files": [("image", ("a.png", image_file((64, 64)), "image/png"))]}


# --- the field ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_body_loras_reach_the_gateway_in_order_with_unset_scales_unset(server: FakeServer, stream: bool) -> None:
    body = {"prompt": "a fox", "stream": stream, "loras": [{"name": STYLE, "scale": 0.5}, {"name": INK}]}
    async with _client(server) as client:
        resp = await client.post(GENERATIONS, json=body)
    assert resp.status_code == 200, resp.text
    assert _sent(server) == [(STYLE, 0.5), (INK, None)]


async def test_no_loras_sends_none_and_never_asks_for_the_list(server: FakeServer) -> None:
    async with _client(server) as client:
        for body in ({"prompt": "a fox"}, {"prompt": "a fox", "loras": []}, {"prompt": "a fox", "loras": None},
                     {"prompt": "a fox", "model": "gpt-image-1"}):
            server.servicer.calls.clear()
            resp = await client.post(GENERATIONS, json=body)
            assert resp.status_code == 200, resp.text
            assert _sent(server) == []
            assert "ListLoras" not in server.servicer.methods()


async def test_an_edit_takes_loras_as_one_json_form_field(server: FakeServer) -> None:
    loras = json.dumps([{"name": INK, "scale": -1.25}, {"name": STYLE}])
    async with _client(server) as client:
        resp = await client.post(EDITS, **_edit(loras=loras))
    assert resp.status_code == 200, resp.text
    assert _sent(server) == [(INK, -1.25), (STYLE, None)]


MALFORMED: list[Any] = [
    "tiny-style",  # not a list
    {"name": STYLE},
    [STYLE],  # an item not an object
    [1], [None], [[{"name": STYLE}]],
    [{}],  # no name
    [{"scale": 1}],
    [{"name": STYLE, "weight": 1}],  # an extra key
    [{"name": STYLE, "scale": 1, "x": None}],
    [{"name": 1}],  # a name not a string
    [{"name": None}], [{"name": [STYLE]}],
    [{"name": STYLE, "scale": "0.5"}],  # a scale not a number
    [{"name": STYLE, "scale": True}],
    [{"name": STYLE, "scale": [1]}],
    [{"name": STYLE}, 7],  # the second one bad
    [{"name": STYLE}] * 5,  # more than the 4 of the limits in force
]
# Well-formed, refused by the limits model's checks, which name the item.
REFUSED: list[tuple[Any, str]] = [
    ([{"name": ""}], "loras[0].name"),
    ([{"name": "../etc/passwd"}], "loras[0].name"),
    ([{"name": "a/b"}], "loras[0].name"),
    ([{"name": ".hidden"}], "loras[0].name"),
    ([{"name": "x" * 129}], "loras[0].name"),
    ([{"name": "a..b"}], "loras[0].name"),
    ([{"name": STYLE}, {"name": "é"}], "loras[1].name"),
    ([{"name": STYLE}, {"name": STYLE, "scale": 2}], "loras[1].name"),  # twice
    ([{"name": STYLE, "scale": 4.5}], "loras[0].scale"),
    ([{"name": STYLE, "scale": -5}], "loras[0].scale"),
    ([{"name": STYLE}, {"name": INK, "scale": 1e39}], "loras[1].scale"),
]


@pytest.mark.parametrize("loras", MALFORMED, ids=[json.dumps(m)[:40] for m in MALFORMED])
async def test_a_malformed_loras_is_a_400_naming_loras(server: FakeServer, loras: Any) -> None:
    async with _client(server) as client:
        _assert_400(await client.post(GENERATIONS, json={"prompt": "a fox", "loras": loras}), "loras")
        _assert_400(await client.post(EDITS, **_edit(loras=json.dumps(loras))), "loras")
    assert _generations(server) == []


@pytest.mark.parametrize(("loras", "param"), REFUSED, ids=[p + json.dumps(m)[:30] for m, p in REFUSED])
async def test_a_refused_adapter_is_a_400_naming_the_item(server: FakeServer, loras: Any, param: str) -> None:
    async with _client(server) as client:
        _assert_400(await client.post(GENERATIONS, json={"prompt": "a fox", "loras": loras}), param)
        _assert_400(await client.post(EDITS, **_edit(loras=json.dumps(loras))), param)
    assert _generations(server) == []


@pytest.mark.parametrize("scale", ["NaN", "Infinity", "-Infinity"])
async def test_a_scale_that_is_no_finite_number_is_named(server: FakeServer, scale: str) -> None:
    # Python's JSON reads these words; the limits model refuses them like any scale out of range.
    body = f'{{"prompt": "a fox", "loras": [{{"name": "{STYLE}", "scale": {scale}}}]}}'
    async with _client(server) as client:
        _assert_400(await client.post(GENERATIONS, content=body, headers={"content-type": "application/json"}),
                    "loras[0].scale")


@pytest.mark.parametrize("text", ["tiny-style", "[", "", "{'name': 'x'}"])
async def test_an_edit_s_loras_that_is_not_json_is_a_400_naming_loras(server: FakeServer, text: str) -> None:
    async with _client(server) as client:
        _assert_400(await client.post(EDITS, **_edit(loras=text)), "loras")
    assert _generations(server) == []


async def test_a_pool_that_serves_no_adapters_refuses_any(server: FakeServer) -> None:
    async with _client(server, limits=dataclasses.replace(Limits(), max_loras_per_request=0)) as client:
        resp = await client.post(GENERATIONS, json={"prompt": "a fox", "loras": [{"name": STYLE}]})
        _assert_400(resp, "loras")
        assert "serves no LoRA adapters" in resp.json()["error"]["message"]
        _assert_400(await client.post(GENERATIONS, json={"prompt": "a fox", "model": STYLE}), "model")
        assert (await client.post(GENERATIONS, json={"prompt": "a fox", "loras": []})).status_code == 200


@pytest.mark.parametrize("stream", [False, True])
async def test_an_adapter_the_gateway_does_not_know_is_a_400_naming_loras(server: FakeServer, stream: bool) -> None:
    # The front checks the form only; the gateway knows which exist (INVALID_ARGUMENT, field "loras").
    async with _client(server) as client:
        resp = await client.post(GENERATIONS, json={"prompt": "a fox", "stream": stream,
                                                    "loras": [{"name": "not-served"}]})
        _assert_400(resp, "loras")
        assert "not-served" in resp.json()["error"]["message"]
        _assert_400(await client.post(EDITS, **_edit(loras='[{"name": "not-served"}]')), "loras")


def test_gateway_fields_of_the_adapters_are_the_rest_params() -> None:
    for field in ("loras", "loras[0].name", "loras[3].scale"):
        assert param_of(field) == field
    assert param_of("lorasx") is None


# --- model names an adapter ---------------------------------------------------------------------------------------


async def test_model_naming_an_adapter_runs_it_at_its_default_scale(server: FakeServer) -> None:
    async with _client(server) as client:
        resp = await client.post(GENERATIONS, json={"prompt": "a fox", "model": STYLE})
        assert resp.status_code == 200, resp.text
        assert _sent(server) == [(STYLE, None)]
        server.servicer.calls.clear()
        resp = await client.post(EDITS, **_edit(model=INK))
        assert resp.status_code == 200, resp.text
        assert _sent(server) == [(INK, None)]


async def test_model_s_adapter_comes_after_the_body_s_loras(server: FakeServer) -> None:
    async with _client(server) as client:
        resp = await client.post(GENERATIONS, json={"prompt": "a fox", "model": STYLE,
                                                    "loras": [{"name": INK, "scale": 0.25}]})
    assert resp.status_code == 200, resp.text
    assert _sent(server) == [(INK, 0.25), (STYLE, None)]


async def test_model_s_adapter_named_again_or_past_the_count_is_a_400(server: FakeServer) -> None:
    async with _client(server, limits=dataclasses.replace(Limits(), max_loras_per_request=2)) as client:
        twice = {"prompt": "a fox", "model": STYLE, "loras": [{"name": INK}, {"name": STYLE, "scale": 1}]}
        resp = await client.post(GENERATIONS, json=twice)
        _assert_400(resp, "loras[1].name")
        assert "model" in resp.json()["error"]["message"]
        many = {"prompt": "a fox", "model": STYLE, "loras": [{"name": INK}, {"name": "third"}]}
        _assert_400(await client.post(GENERATIONS, json=many), "loras")
    assert _generations(server) == []


@pytest.mark.parametrize("model", ["sdxl", "../x", "", "x" * 300])
async def test_a_model_that_is_neither_served_nor_an_adapter_is_the_404_it_was(server: FakeServer,
                                                                              model: str) -> None:
    async with _client(server) as client:
        resp = await client.post(GENERATIONS, json={"prompt": "a fox", "model": model})
        assert resp.status_code == 404, resp.text
        assert resp.json()["error"]["param"] == "model" and resp.json()["error"]["code"] == "model_not_found"
        resp = await client.post(EDITS, **_edit(model=model))
        assert resp.status_code == 404 and resp.json()["error"]["param"] == "model"
    assert _generations(server) == []


async def test_the_list_is_read_once_per_ttl_with_the_caller_s_credential(server: FakeServer) -> None:
    async with _client(server) as client:
        headers = {"Authorization": "Bearer caller"}
        answers = await asyncio.gather(*(client.post(GENERATIONS, json={"prompt": "a", "model": STYLE},
                                                     headers=headers) for _ in range(5)))
        assert [r.status_code for r in answers] == [200] * 5
        reads = [c for c in server.servicer.calls if c.method == "ListLoras"]
        assert len(reads) == 1 and reads[0].metadata["authorization"] == "Bearer caller"
        # Another credential is read for itself: a list is shown only to the credential it was read with.
        assert (await client.get("/v1/models", headers={"Authorization": "Bearer other"})).status_code == 200
        reads = [c for c in server.servicer.calls if c.method == "ListLoras"]
        assert [r.metadata["authorization"] for r in reads] == ["Bearer caller", "Bearer other"]


async def test_with_gateway_auth_own_the_list_is_read_with_the_front_s_key(server: FakeServer) -> None:
    async with _client(server, api_keys=("client-key",), gateway_auth="own", gateway_api_key="front-key") as client:
        resp = await client.get("/v1/models", headers={"Authorization": "Bearer client-key"})
    assert resp.status_code == 200 and STYLE in [m["id"] for m in resp.json()["data"]]
    [read] = [c for c in server.servicer.calls if c.method == "ListLoras"]
    assert read.metadata["authorization"] == "Bearer front-key"


# --- /v1/models -------------------------------------------------------------------------------------------------


async def test_models_lists_each_adapter_with_the_served_model_as_parent(server: FakeServer) -> None:
    async with _client(server) as client:
        body = (await client.get("/v1/models")).json()
        sdk = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", max_retries=0, http_client=client)
        card = await sdk.models.retrieve(STYLE)
        missing = await client.get("/v1/models/not-served")
    ids = [m["id"] for m in body["data"]]
    assert ids == ["glm-image", "gpt-image-1", "dall-e-3", INK, STYLE]  # adapters by name
    by_id = {m["id"]: m for m in body["data"]}
    assert by_id[STYLE] == {"id": STYLE, "object": "model", "created": by_id["glm-image"]["created"],
                            "owned_by": "glmimage", "root": STYLE, "parent": "glm-image"}
    assert by_id["gpt-image-1"]["parent"] is None and by_id["gpt-image-1"]["root"] is None
    assert (card.id, card.owned_by, card.parent, card.root) == (STYLE, "glmimage", "glm-image", STYLE)  # type: ignore
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


async def test_an_adapter_named_like_a_served_model_is_the_served_model(server: FakeServer) -> None:
    loras = [common_pb2.LoraInfo(name="dall-e-3"), *SERVED]
    async with _client(server, loras=loras) as client:
        ids = [m["id"] for m in (await client.get("/v1/models")).json()["data"]]
        assert ids.count("dall-e-3") == 1
        assert (await client.post(GENERATIONS, json={"prompt": "a", "model": "dall-e-3"})).status_code == 200
    assert _sent(server) == []


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED,
                                  grpc.StatusCode.INTERNAL, grpc.StatusCode.UNIMPLEMENTED,
                                  grpc.StatusCode.PERMISSION_DENIED])
async def test_a_failing_list_leaves_models_and_plain_generations_working(server: FakeServer,
                                                                          code: grpc.StatusCode) -> None:
    async with _client(server) as client:
        server.servicer.fail["ListLoras"] = [code] * 10
        resp = await client.get("/v1/models")
        assert resp.status_code == 200
        assert [m["id"] for m in resp.json()["data"]] == ["glm-image", "gpt-image-1", "dall-e-3"]
        assert (await client.get(f"/v1/models/{STYLE}")).status_code == 404
        assert (await client.get("/v1/models/glm-image")).status_code == 200
        for body in ({"prompt": "a fox"}, {"prompt": "a fox", "loras": [{"name": STYLE}]}):
            resp = await client.post(GENERATIONS, json=body)
            assert resp.status_code == 200, resp.text
        # A model the pool could not place is answered as the gateway's failure, or as an unknown model where the
        # gateway shows this credential no adapters (or predates ListLoras).
        resp = await client.post(GENERATIONS, json={"prompt": "a fox", "model": STYLE})
        want = {grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.UNAUTHENTICATED: 401,
                grpc.StatusCode.INTERNAL: 500, grpc.StatusCode.UNIMPLEMENTED: 404,
                grpc.StatusCode.PERMISSION_DENIED: 404}[code]
        assert resp.status_code == want, resp.text
        assert set(resp.json()["error"]) == {"message", "type", "param", "code"}


# --- the cache ----------------------------------------------------------------------------------------------------


class _Stub:
    """ListLoras of a gateway: answers ``names`` (after ``gate``, when set), or raises ``error``."""

    def __init__(self, names: tuple[str, ...] = (STYLE,)) -> None:
        self.names, self.calls = names, 0
        self.error: grpc.StatusCode | None = None
        self.gate: asyncio.Event | None = None

    async def ListLoras(self, request: Any, *, metadata: Any, timeout: float) -> gateway_service_pb2.ListLorasResponse:
        self.calls += 1
        if self.gate is not None:
            await self.gate.wait()
        if self.error is not None:
            raise grpc.aio.AioRpcError(self.error, grpc.aio.Metadata(), grpc.aio.Metadata(), "injected")
        return gateway_service_pb2.ListLorasResponse(loras=[common_pb2.LoraInfo(name=n) for n in self.names])


def _gateways(*stubs: _Stub) -> Any:
    """What the cache reads of upstream.Gateways: the order to try them in, each connected at once."""
    async def connected() -> None:
        pass

    members = [SimpleNamespace(stub=stub, connected=connected) for stub in stubs]
    return SimpleNamespace(attempts=lambda: members)


async def test_the_cache_reads_once_per_ttl_with_one_read_in_flight() -> None:
    stub = _Stub()
    stub.gate = asyncio.Event()
    cache = AdapterCache(ttl=0.5, retry=0.05)
    meta = (("authorization", "Bearer k"),)
    waiting = [asyncio.create_task(cache.get(_gateways(stub), meta, 5)) for _ in range(10)]
    await asyncio.sleep(0.05)
    stub.gate.set()
    assert [set(a) for a in await asyncio.gather(*waiting)] == [{STYLE}] * 10
    assert stub.calls == 1
    assert set(await cache.get(_gateways(stub), meta, 5)) == {STYLE} and stub.calls == 1  # fresh
    await asyncio.sleep(0.55)
    stub.names = (STYLE, INK)
    assert set(await cache.get(_gateways(stub), meta, 5)) == {STYLE, INK} and stub.calls == 2


async def test_a_caller_that_leaves_does_not_cancel_the_read_others_wait_for() -> None:
    stub = _Stub()
    stub.gate = asyncio.Event()
    cache = AdapterCache()
    first = asyncio.create_task(cache.get(_gateways(stub), (), 5))
    second = asyncio.create_task(cache.get(_gateways(stub), (), 5))
    await asyncio.sleep(0.02)
    first.cancel()
    stub.gate.set()
    assert set(await second) == {STYLE} and stub.calls == 1


async def test_the_cache_keeps_a_list_while_the_gateway_is_away_and_drops_it_when_refused() -> None:
    stub = _Stub()
    cache = AdapterCache(ttl=0, retry=0)
    assert set(await cache.get(_gateways(stub), (), 5)) == {STYLE}
    stub.error = grpc.StatusCode.UNAVAILABLE
    assert set(await cache.get(_gateways(stub), (), 5)) == {STYLE}  # away: the last list stands
    stub.error = grpc.StatusCode.UNAUTHENTICATED  # the key is refused now
    with pytest.raises(grpc.aio.AioRpcError):
        await cache.get(_gateways(stub), (), 5)
    with pytest.raises(grpc.aio.AioRpcError):  # and the refusal is not forgotten for the old list
        await cache.get(_gateways(stub), (), 5)


async def test_a_failed_read_stands_for_the_retry_interval() -> None:
    stub = _Stub()
    stub.error = grpc.StatusCode.UNAVAILABLE
    cache = AdapterCache(retry=60)
    for _ in range(3):
        with pytest.raises(grpc.aio.AioRpcError):
            await cache.get(_gateways(stub), (), 5)
    assert stub.calls == 1


async def test_the_next_gateway_is_asked_when_one_is_away_or_older() -> None:
    away, older, serving = _Stub(), _Stub(), _Stub((INK,))
    away.error, older.error = grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNIMPLEMENTED
    assert set(await AdapterCache().get(_gateways(away, older, serving), (), 5)) == {INK}
    assert set(await AdapterCache().get(_gateways(away, older), (), 5)) == set()  # an older one serves none
    with pytest.raises(grpc.aio.AioRpcError):
        await AdapterCache().get(_gateways(away, away), (), 5)
    refusing = _Stub()
    refusing.error = grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.aio.AioRpcError):  # a refusal is the answer: the next gateway shares the keys
        await AdapterCache().get(_gateways(refusing, serving), (), 5)
    refusing.error = grpc.StatusCode.PERMISSION_DENIED  # this credential may not see the list: it is shown none
    assert set(await AdapterCache().get(_gateways(refusing, serving), (), 5)) == set()


async def test_the_cache_holds_a_bounded_number_of_credentials() -> None:
    stub = _Stub()
    cache = AdapterCache(max_credentials=3)
    for i in range(10):
        await cache.get(_gateways(stub), (("authorization", f"Bearer {i}"),), 5)
    assert len(cache._entries) == 3


# --- OpenAPI and the SDK ------------------------------------------------------------------------------------------


async def test_openapi_documents_loras_with_the_limits_in_force(server: FakeServer) -> None:
    async with _client(server, limits=dataclasses.replace(Limits(), max_loras_per_request=3)) as client:
        doc = (await client.get("/openapi.json")).json()
    schemas = doc["components"]["schemas"]
    for model in ("ImageGenerationRequest", "ImageEditRequest"):
        prop = schemas[model]["properties"]["loras"]
        [array] = [b for b in prop["anyOf"] if b.get("type") == "array"]
        assert array["maxItems"] == 3 and array["items"] == {"$ref": "#/components/schemas/LoraRef"}
        assert prop["description"].startswith("Extension")
    ref = schemas["LoraRef"]
    assert ref["required"] == ["name"] and ref["additionalProperties"] is False
    assert ref["properties"]["name"]["maxLength"] == 128
    assert (ref["properties"]["scale"]["minimum"], ref["properties"]["scale"]["maximum"]) == (-4, 4)
    encoding = doc["paths"][EDITS]["post"]["requestBody"]["content"]["multipart/form-data"]["encoding"]
    assert encoding == {"loras": {"contentType": "application/json"}}
    assert "adapter" in schemas["ImageGenerationRequest"]["properties"]["model"]["description"]
    assert {"root", "parent"} <= set(schemas["ModelCard"]["properties"])


@pytest.mark.parametrize("name", ["a", "A9", "tiny-style", "ink.v2", "x_y", "-a", ".a", "a/b", "é", "a b", ""])
def test_the_documented_name_pattern_is_the_limits_model_s(name: str) -> None:
    import re

    try:
        check_lora_name(name, "loras[0].name")
        valid = True
    except InvalidArgument:
        valid = False
    assert valid == bool(re.fullmatch(LORA_NAME_PATTERN.strip("^$"), name))


async def test_the_openai_sdk_sends_loras_as_extra_body_and_an_adapter_as_model(server: FakeServer) -> None:
    async with _client(server) as client:
        sdk = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", max_retries=0, http_client=client)
        await sdk.images.generate(prompt="a fox", model=STYLE, extra_body={"loras": [{"name": INK, "scale": 0.5}]})
        assert _sent(server) == [(INK, 0.5), (STYLE, None)]
        server.servicer.calls.clear()
        await sdk.images.edit(image=("a.png", image_file((64, 64)), "image/png"), prompt="make it red",
                              extra_body={"loras": json.dumps([{"name": STYLE, "scale": 2}])})
        assert _sent(server) == [(STYLE, 2.0)]
        with pytest.raises(openai.BadRequestError) as info:
            await sdk.images.generate(prompt="a fox", extra_body={"loras": [{"name": STYLE, "scale": math.pi * 2}]})
    assert info.value.param == "loras[0].scale"  # type: ignore[attr-defined]
