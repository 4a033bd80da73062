"""A stream cut by its gateway's exit (UNAVAILABLE after events were relayed) is run again from the start by the
REST front on another gateway, once (issue 32): the client gets the progress again and then the one completed
result; a second cut ends the stream with an error event, as any failure after the first event did before."""
from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack

import pytest

from tests.support.fake_gateway import FakeServer, serve_fake
from tests.test_several_gateways import rest

BODY = {"prompt": "midstream", "size": "256x256", "stream": True}


@pytest.fixture
def fakes() -> Iterator[list[FakeServer]]:
    with ExitStack() as stack:
        yield [stack.enter_context(serve_fake()) for _ in range(2)]


def _streams(fake: FakeServer) -> int:
    return fake.servicer.methods().count("GenerateImagesStream")


def _events(text: str) -> list[dict]:
    return [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:")]


async def test_a_stream_cut_mid_way_is_resumed_from_the_start_on_another_gateway(fakes: list[FakeServer]) -> None:
    fakes[1].servicer.midstream_fails = False  # the first one goes away after its first event; the other does not
    async with rest(",".join(f.address for f in fakes)) as client:
        for _ in range(2):  # whichever the round robin starts at
            resp = await client.post("/v1/images/generations", json=BODY)
            assert resp.status_code == 200, resp.text
            events = _events(resp.text)
            assert [e["type"] for e in events] == ["image_generation.completed"], resp.text
    assert _streams(fakes[0]) == 1 and _streams(fakes[1]) == 2  # the cut one ran again there, once


async def test_a_stream_is_resumed_once_only(fakes: list[FakeServer]) -> None:
    async with rest(",".join(f.address for f in fakes)) as client:
        resp = await client.post("/v1/images/generations", json=BODY)
    assert resp.status_code == 200  # the events had begun: the failure is an event
    (event,) = _events(resp.text)
    assert event["type"] == "error" and event["error"]["code"] == "unavailable", event  # the second cut's
    assert _streams(fakes[0]) + _streams(fakes[1]) == 2


async def test_with_one_gateway_a_cut_stream_ends_with_an_error_event() -> None:
    with serve_fake() as fake:
        async with rest(fake.address) as client:
            resp = await client.post("/v1/images/generations", json=BODY)
        assert fake.servicer.methods().count("GenerateImagesStream") == 1  # no other gateway to run it
    (event,) = _events(resp.text)
    assert event["type"] == "error" and event["error"]["code"] == "gateway_unavailable", event
