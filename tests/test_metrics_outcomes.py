"""Outcomes as the metrics count them, on the real gateway (and the REST front before it) over simulated workers:
a request that hit its deadline counts as a deadline, not as cancelled; one whose client went away counts as
cancelled (REST: 499), not as ok (REST: the 200 its stream started with).

The simulated denoisers hold every job after its first step (the gate), so a request is in flight for as long
as a test needs; the deadlines are short, and nothing waits a fixed time.
"""
from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import httpx
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import GatewayMetrics
from glmimage.v1 import gateway_service_pb2 as pb
from rest.app import create_app
from rest.settings import RestSettings
from tests.support.asgi import RawClient
from tests.support.sim_gateway import Gateway, SimCluster, request, rpc_error, running_gateway, scrape, sim_cluster

DEADLINE_S = 1.0
HELD = {"num_inference_steps": 4}  # past the first step, the gate holds it


@dataclass
class Stack:
    cluster: SimCluster
    gateway: Gateway
    registry: CollectorRegistry

    def outcomes(self) -> dict[str, float]:
        return {labels[0][1]: v for (name, labels), v in scrape(self.registry).items()
                if name == "glmimage_gateway_requests_total"}

    async def ended(self) -> dict[str, float]:
        """The outcome counts once every request has ended, those that counted nothing left out."""
        await self.gateway.until(lambda s: s.active_requests == 0)
        return {outcome: n for outcome, n in self.outcomes().items() if n}


@pytest.fixture
async def stack() -> AsyncIterator[Stack]:
    registry = CollectorRegistry()
    async with sim_cluster() as cluster, running_gateway(
            [cluster.address(cluster.ar)], [cluster.address(d) for d in cluster.denoisers],
            metrics=GatewayMetrics(registry)) as gw:
        cluster.gate.clear()
        yield Stack(cluster, gw, registry)


async def test_a_call_past_its_deadline_counts_as_a_deadline(stack: Stack) -> None:
    err = await rpc_error(stack.gateway.stub.GenerateImages(request(**HELD), timeout=DEADLINE_S))
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert await stack.ended() == {"deadline_exceeded": 1}


async def test_a_stream_past_its_deadline_counts_as_a_deadline(stack: Stack) -> None:
    call = stack.gateway.stub.GenerateImagesStream(pb.GenerateImagesStreamRequest(request=request(**HELD)),
                                                   timeout=DEADLINE_S)
    assert (await call.read()).progress.step == 1
    assert (await rpc_error(call.read())).code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert await stack.ended() == {"deadline_exceeded": 1}


async def test_a_stream_its_client_cancelled_counts_as_cancelled(stack: Stack) -> None:
    call = stack.gateway.stub.GenerateImagesStream(pb.GenerateImagesStreamRequest(request=request(**HELD)))
    assert (await call.read()).progress.step == 1
    call.cancel()
    assert await stack.ended() == {"cancelled": 1}


# ---- the REST front before it ------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def rest(stack: Stack, **settings: object) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(RestSettings(gateway_address=f"127.0.0.1:{stack.gateway.port}", **settings))  # type: ignore[arg-type]
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        client.app = app  # type: ignore[attr-defined]
        yield client


def rest_statuses(text: str) -> dict[str, float]:
    return {s.labels["status"]: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == "glmimage_rest_requests_total" and s.labels["route"] == "/v1/images/generations"}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_rest_request_past_its_deadline_counts_as_504(stack: Stack, stream: bool) -> None:
    async with rest(stack, request_timeout=DEADLINE_S) as client:
        resp = await client.post("/v1/images/generations",
                                 json={"prompt": "slow", "size": "64x64", "stream": stream, **HELD})
        if stream:  # the 200 went out with the first progress; the deadline comes as an error event
            assert resp.status_code == 200 and '"code":"deadline_exceeded"' in resp.text
        else:
            assert resp.status_code == 504, resp.text
        assert rest_statuses((await client.get("/metrics")).text) == {"504": 1}
    assert await stack.ended() == {"deadline_exceeded": 1}


async def test_rest_stream_its_client_left_counts_as_499(stack: Stack) -> None:
    async with rest(stack) as client:
        raw = RawClient(client.app, {"prompt": "slow", "size": "64x64", "stream": True, **HELD})  # type: ignore[attr-defined]
        await raw.body_chunk_sent.wait()  # the 200 and the first progress comment are out
        raw.hang_up()
        await raw.task
        assert raw.sent[0]["status"] == 200
        assert rest_statuses((await client.get("/metrics")).text) == {"499": 1}
    assert await stack.ended() == {"cancelled": 1}
