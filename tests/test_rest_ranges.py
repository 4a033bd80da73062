"""Every numeric field of every REST route at its type's extremes: a 400 naming the field (OpenAI's `param`), never
a 5xx, whether it comes as JSON (POST /v1/images/generations) or as a multipart form field (POST /v1/images/edits).

The front is served as `python -m rest` serves it (tests/support/rest_front.py) on a loopback port, over the
scripted gateway of tests/support/edit_gateway.py. The fields come from the request models themselves, so a numeric
field added later is fuzzed (and must be bounded by its proto field's type) without this file changing.
"""
from __future__ import annotations

import json
import logging
import typing
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
import pytest_asyncio
from pydantic import BaseModel

from rest.schemas import WIRE_FIELDS, ImageEditRequest, ImageGenerationRequest, wire_range
from tests.support.edit_gateway import serve_edit_fake
from tests.support.fake_gateway import FakeServer
from tests.support.images import image_file
from tests.support.rest_front import RestFront, errors_logged, serving

GENERATIONS, EDITS = "/v1/images/generations", "/v1/images/edits"
ROUTES = {GENERATIONS: ImageGenerationRequest, EDITS: ImageEditRequest}

# Outside every integer field's proto type (uint32), or not an integer: always a 400 naming the field.
INTS_OUT = ["4294967296", "9223372036854775808", "18446744073709551616", "-1", "-9223372036854775808", "1.5",
            "1e3"]
# Inside the proto type: answered (the limits decide, seed takes them), and a refusal names the field.
INTS_IN = ["2147483648", "4294967295"]
# NaN, the infinities, past float32 (the proto's float) and past float64: always a 400 naming the field.
FLOATS_OUT = ["NaN", "Infinity", "-Infinity", "3.5e38", "1e999", "-1e999", "-1.0"]
# Form fields are text: what a client would type for the same values.
FORM_SPELLING = {"NaN": "nan", "Infinity": "inf", "-Infinity": "-inf"}


def numeric_fields(model: type[BaseModel]) -> dict[str, type]:
    """Each int or float field of ``model`` (optional ones included) -> int or float."""
    out = {}
    for name, info in model.model_fields.items():
        kinds = set(typing.get_args(info.annotation) or (info.annotation,)) & {int, float}
        if kinds:
            (out[name],) = kinds
    return out


def cases() -> Iterator[tuple[str, str, str, bool]]:
    """(route, field, value as JSON text, always refused)."""
    for route, model in ROUTES.items():
        for name, kind in numeric_fields(model).items():
            if kind is int:
                yield from ((route, name, v, True) for v in INTS_OUT)
                yield from ((route, name, v, False) for v in INTS_IN)
            else:
                yield from ((route, name, v, True) for v in FLOATS_OUT)


CASES = list(cases())
PNG = image_file()


@pytest.fixture(scope="module")
def gateway() -> Iterator[FakeServer]:
    with serve_edit_fake() as srv:
        yield srv


@pytest_asyncio.fixture(scope="module")
async def front(gateway: FakeServer) -> AsyncIterator[RestFront]:
    async with serving(gateway.address) as front:
        yield front


@pytest_asyncio.fixture()
async def client(front: RestFront, gateway: FakeServer) -> AsyncIterator[httpx.AsyncClient]:
    gateway.servicer.reset()
    async with httpx.AsyncClient(base_url=front.base_url, timeout=30) as c:
        yield c


async def post(client: httpx.AsyncClient, route: str, name: str, value: str) -> httpx.Response:
    if route == GENERATIONS:
        body = f'{{"prompt": "a cat", {json.dumps(name)}: {value}}}'
        return await client.post(route, content=body, headers={"content-type": "application/json"})
    return await client.post(route, data={"prompt": "a cat", name: FORM_SPELLING.get(value, value)},
                             files={"image": ("cat.png", PNG, "image/png")})


def test_every_numeric_field_is_fuzzed_and_bounded_by_its_proto_type() -> None:
    fields = {name for model in ROUTES.values() for name in numeric_fields(model)}
    assert fields == {"n", "output_compression", "partial_images", "seed", "num_inference_steps", "guidance_scale"}
    assert fields <= set(WIRE_FIELDS)  # every one is sent as a proto field whose type bounds it
    for model in ROUTES.values():
        props = model.model_json_schema()["properties"]
        for name in numeric_fields(model):
            (typed,) = [b for b in props[name]["anyOf"] if b.get("type") in ("integer", "number")]
            low, high = wire_range(name)
            assert low <= typed["minimum"] and typed["maximum"] <= high, (model.__name__, name, typed)


@pytest.mark.parametrize(("route", "name", "value", "refused"), CASES,
                         ids=[f"{r.rsplit('/', 1)[1]}-{n}={v}" for r, n, v, _ in CASES])
async def test_a_number_at_its_type_extremes_is_a_400_naming_it(
        client: httpx.AsyncClient, gateway: FakeServer, caplog: pytest.LogCaptureFixture, route: str, name: str,
        value: str, refused: bool) -> None:
    caplog.set_level(logging.WARNING)
    resp = await post(client, route, name, value)
    assert resp.status_code < 500, resp.text
    assert not errors_logged(caplog.records), "the front logged an error"
    if resp.status_code == 200:
        assert not refused, resp.text
        return
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == name and error["type"] == "invalid_request_error", error
    assert "Traceback" not in error["message"] and "ValueError" not in error["message"]
    assert gateway.servicer.calls == []  # refused before any gateway call


async def test_the_reported_repro_and_the_largest_valid_numbers(client: httpx.AsyncClient,
                                                                 gateway: FakeServer) -> None:
    resp = await client.post(GENERATIONS, json={"prompt": "a cat", "n": 4294967296})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "n", resp.text
    # Each field at the largest value the limits take still goes through.
    resp = await client.post(GENERATIONS, json={"prompt": "a cat", "n": 1, "seed": 4294967295, "guidance_scale": 30.0,
                                                "num_inference_steps": 200, "output_compression": 100})
    assert resp.status_code == 200, resp.text
    (call,) = gateway.servicer.calls
    assert (call.request.seed, call.request.guidance_scale, call.request.num_inference_steps) == (4294967295, 30.0,
                                                                                                   200)
