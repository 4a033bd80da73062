"""The REST front's `step_cache` (a body field, a form field for edits) and the `quality` profiles that pick one,
through a scripted gateway that serves GetLimits: what reaches the gateway, what is refused and how."""
from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from glmimage.v1 import common_pb2
from rest.__main__ import parse_args, settings_from_args
from rest.app import RestSettings, create_app
from rest.settings import QualityProfile, quality_profile_arg
from runtime.limits import Limits
from tests.support.edit_gateway import serve_edit_fake
from tests.support.fake_gateway import FakeServer
from tests.support.images import image_file

GENERATIONS, EDITS = "/v1/images/generations", "/v1/images/edits"
CACHING = dataclasses.replace(Limits(), step_cache=True)  # what a gateway whose denoisers all cache advertises
OFF, BALANCED, AGGRESSIVE = common_pb2.STEP_CACHE_OFF, common_pb2.STEP_CACHE_BALANCED, common_pb2.STEP_CACHE_AGGRESSIVE


@pytest.fixture(scope="module")
def server() -> Iterator[FakeServer]:
    with serve_edit_fake() as srv:
        yield srv


@asynccontextmanager
async def _client(server: FakeServer, limits: Limits = CACHING, **settings: Any) -> AsyncIterator[httpx.AsyncClient]:
    server.servicer.reset()
    server.servicer.limits = limits
    app: FastAPI = create_app(RestSettings(gateway_address=server.address, **settings))
    async with app.router.lifespan_context(app):
        assert app.state.limits.current == limits
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            yield client


def _sent(server: FakeServer) -> int:
    [call] = [c for c in server.servicer.calls if c.method.startswith("GenerateImages")]
    return call.request.step_cache


@pytest.mark.parametrize("body, want", [
    ({}, OFF),  # quality auto
    ({"quality": "high"}, OFF),
    ({"quality": "hd"}, OFF),
    ({"quality": "low"}, AGGRESSIVE),
    ({"quality": "medium"}, BALANCED),
    ({"quality": "standard"}, BALANCED),
    ({"step_cache": "balanced"}, BALANCED),
    ({"quality": "high", "step_cache": "aggressive"}, AGGRESSIVE),  # the explicit level wins over the profile
    ({"quality": "low", "step_cache": "off"}, OFF),
])
async def test_the_level_sent_is_the_explicit_one_else_the_quality_profile_s(
        server: FakeServer, body: dict, want: int) -> None:
    async with _client(server) as client:
        resp = await client.post(GENERATIONS, json={"prompt": "a fox", **body})
    assert resp.status_code == 200, resp.text
    assert _sent(server) == want


async def test_an_edit_takes_step_cache_as_a_form_field(server: FakeServer) -> None:
    async with _client(server) as client:
        resp = await client.post(EDITS, data={"prompt": "make it red", "step_cache": "aggressive"},
                                 files=[("image", ("a.png", image_file((64, 64)), "image/png"))])
    assert resp.status_code == 200, resp.text
    assert _sent(server) == AGGRESSIVE


@pytest.mark.parametrize("value", ["fast", "", "OFF", 1, None, True])
async def test_an_unknown_level_is_a_400_naming_step_cache(server: FakeServer, value: Any) -> None:
    body = {"prompt": "a fox", "step_cache": value}
    async with _client(server) as client:
        resp = await client.post(GENERATIONS, json=body)
    if value is None:  # JSON null: not given
        assert resp.status_code == 200
        return
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "step_cache"
    assert server.servicer.calls == [] or all(c.method == "GetLimits" for c in server.servicer.calls)


async def test_where_the_denoisers_cannot_cache_a_named_level_is_refused_and_a_profile_runs_uncached(
        server: FakeServer) -> None:
    async with _client(server, limits=Limits()) as client:  # step_cache unset: not every denoiser caches
        refused = await client.post(GENERATIONS, json={"prompt": "a fox", "step_cache": "balanced"})
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert error["param"] == "step_cache" and "cannot cache steps" in error["message"]
        server.servicer.reset()
        assert (await client.post(GENERATIONS, json={"prompt": "a fox", "quality": "low"})).status_code == 200
        assert _sent(server) == OFF
        server.servicer.reset()
        assert (await client.post(GENERATIONS, json={"prompt": "a fox", "step_cache": "off"})).status_code == 200


async def test_the_quality_flag_sets_a_profile_and_openapi_documents_the_field(server: FakeServer) -> None:
    args = parse_args(["--quality", "high=40:balanced", "--quality", "low=4"])
    settings = settings_from_args(args)
    assert settings.quality_profiles["high"] == QualityProfile(40, "balanced")
    assert settings.quality_profiles["low"] == QualityProfile(4, "off")
    assert settings.quality_profiles["medium"] == RestSettings().quality_profiles["medium"]
    for bad in ("ultra=10", "low=x", "low=10:fast", "low"):
        with pytest.raises(ValueError):
            quality_profile_arg(bad)
        with pytest.raises(SystemExit):
            parse_args(["--quality", bad])
    async with _client(server, quality_profiles={**RestSettings().quality_profiles,
                                                 "high": QualityProfile(40, "balanced")}) as client:
        assert (await client.post(GENERATIONS, json={"prompt": "a", "quality": "high"})).status_code == 200
        assert _sent(server) == BALANCED
        doc = (await client.get("/openapi.json")).json()
    for model in ("ImageGenerationRequest", "ImageEditRequest"):
        prop = doc["components"]["schemas"][model]["properties"]["step_cache"]
        assert all(f'"{level}"' in json.dumps(prop) for level in ("off", "balanced", "aggressive")), prop
        assert prop["description"].startswith("Extension")
