"""Several gateways behind one client: the REST front's round robin over per-address channels and its
resubmission when a gateway is gone, and the SDK's one round_robin channel with its retries."""
from __future__ import annotations

import io
import json
from collections.abc import AsyncIterator, Iterator
from contextlib import ExitStack, asynccontextmanager

import httpx
import pytest
from PIL import Image

from gateway.rest.app import RestSettings, create_app
from glmimage import AsyncClient, Client, RetryPolicy
from glmimage.channels import ROUND_ROBIN_CONFIG, balanced_target, split_addresses
from tests.support.fake_gateway import FakeServer, serve_fake

BODY = {"prompt": "two gateways", "size": "256x256"}
# Quick retries: a stopped gateway is left for the other at the first retry.
FAST_RETRY = RetryPolicy(max_attempts=4, initial_backoff=0.05, max_backoff=0.2)


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (16, 16)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture
def fakes() -> Iterator[list[FakeServer]]:
    with ExitStack() as stack:
        yield [stack.enter_context(serve_fake()) for _ in range(2)]


def _generations(fake: FakeServer, method: str = "GenerateImages") -> int:
    return fake.servicer.methods().count(method)


@asynccontextmanager
async def rest(addresses: str) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(RestSettings(gateway_address=addresses))
    transport = httpx.ASGITransport(app=app)
    async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        yield c


def test_addresses_parse_into_one_balanced_target() -> None:
    assert split_addresses(" 10.0.0.1:1, 10.0.0.2:2 ") == ["10.0.0.1:1", "10.0.0.2:2"]
    assert split_addresses(["dns:///gw:50050"]) == ["dns:///gw:50050"]
    assert split_addresses("ipv4:10.0.0.1:1,10.0.0.2:2") == ["ipv4:10.0.0.1:1,10.0.0.2:2"]
    lb = [("grpc.service_config", ROUND_ROBIN_CONFIG)]
    assert balanced_target(["10.0.0.1:1", "10.0.0.2:2"]) == ("ipv4:10.0.0.1:1,10.0.0.2:2", lb)
    assert balanced_target("[::1]:1,[::1]:2") == ("ipv6:[::1]:1,[::1]:2", lb)
    assert balanced_target("dns:///gw:50050") == ("dns:///gw:50050", lb)
    assert balanced_target("gw:50050") == ("gw:50050", [])  # one address: as before, pick_first
    with pytest.raises(ValueError, match="dns:///"):
        balanced_target("gw-a:1,gw-b:1")
    with pytest.raises(ValueError):
        RestSettings(gateway_address=" , ")


async def test_rest_alternates_between_gateways(fakes: list[FakeServer]) -> None:
    async with rest(",".join(f.address for f in fakes)) as client:
        for _ in range(4):
            assert (await client.post("/v1/images/generations", json=BODY)).status_code == 200
    assert [_generations(f) for f in fakes] == [2, 2]
    # The limits refresh read from a gateway (the fake has no GetLimits: it is skipped, on every gateway).


async def test_rest_resubmits_when_a_gateway_is_gone(fakes: list[FakeServer]) -> None:
    async with rest(",".join(f.address for f in fakes)) as client:
        assert (await client.post("/v1/images/generations", json=BODY)).status_code == 200
        fakes[1].server.stop(None).wait()
        for _ in range(6):
            resp = await client.post("/v1/images/generations", json=BODY)
            assert resp.status_code == 200, resp.text
        edit = await client.post("/v1/images/edits", data={"prompt": "edit", "size": "256x256"},
                                 files={"image": ("a.png", _png(), "image/png")})
        assert edit.status_code == 200, edit.text
    assert _generations(fakes[0]) >= 6


async def test_rest_resubmits_a_stream_before_its_first_event(fakes: list[FakeServer]) -> None:
    fakes[0].server.stop(None).wait()  # the first in the round robin is gone before any event
    async with rest(",".join(f.address for f in fakes)) as client:
        for _ in range(2):  # whichever the turn starts at
            resp = await client.post("/v1/images/generations", json={**BODY, "stream": True})
            assert resp.status_code == 200, resp.text
            events = [json.loads(line[5:]) for line in resp.text.splitlines() if line.startswith("data:")]
            assert events[-1]["type"] == "image_generation.completed"
    assert _generations(fakes[1], "GenerateImagesStream") == 2


async def test_rest_single_dead_gateway_still_answers_503() -> None:
    with serve_fake() as fake:
        address = fake.address
    async with rest(address) as client:
        assert (await client.post("/v1/images/generations", json=BODY)).status_code == 503


def test_sdk_reaches_both_and_survives_one_stopped(fakes: list[FakeServer]) -> None:
    with Client([f.address for f in fakes], retry=FAST_RETRY, timeout=10) as client:
        for _ in range(6):
            client.generate("sdk", size="256x256")
        assert all(_generations(f) > 0 for f in fakes)
        fakes[0].server.stop(None).wait()
        before = _generations(fakes[1])
        for _ in range(4):
            client.generate("sdk", size="256x256")
        assert _generations(fakes[1]) == before + 4


async def test_async_sdk_takes_a_comma_separated_string(fakes: list[FakeServer]) -> None:
    client = AsyncClient(",".join(f.address for f in fakes), retry=FAST_RETRY, timeout=10)
    try:
        for _ in range(6):
            await client.generate("sdk", size="256x256")
        fakes[1].server.stop(None).wait()
        for _ in range(3):
            await client.generate("sdk", size="256x256")
    finally:
        await client.close()
    assert _generations(fakes[1]) > 0 and _generations(fakes[0]) >= 3
