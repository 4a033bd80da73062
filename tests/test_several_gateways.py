"""Several gateways behind one client: the REST front's round robin over per-address channels and its
resubmission when a gateway is gone, the same over one balanced channel (a dns:/// name, as the Helm chart gives
it), and the SDK's one round_robin channel with its retries."""
from __future__ import annotations

import asyncio
import io
import json
from collections.abc import AsyncIterator, Iterator
from contextlib import ExitStack, asynccontextmanager

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2
from PIL import Image

from glmimage import AsyncClient, Client, RetryPolicy
from glmimage.wire.channels import ROUND_ROBIN_CONFIG, balanced_target, split_addresses
from rest import upstream
from rest.app import RestSettings, create_app
from rest.upstream import GATEWAY_SERVICE, dns_host_port
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


# One balanced channel (a dns:/// name, or an ipv4: list, as the Helm chart's REST front dials its gateways):
# grpc's round_robin spreads the calls, and a call that fails UNAVAILABLE before answering goes round again.


def _balanced(fakes: list[FakeServer]) -> str:
    return "ipv4:" + ",".join(f.address for f in fakes)


def _unavailable_once(fake: FakeServer, method: str) -> int:
    """The next call of ``method`` on ``fake`` fails UNAVAILABLE (as a gateway going away answers), unless one is
    already set to: how many were added (0 or 1)."""
    with fake.servicer.lock:
        if fake.servicer.fail[method]:
            return 0
        fake.servicer.fail[method].append(grpc.StatusCode.UNAVAILABLE)
        return 1


async def _post(client: httpx.AsyncClient, stream: bool) -> httpx.Response:
    resp = await client.post("/v1/images/generations", json={**BODY, "stream": stream})
    if stream and resp.status_code == 200:
        events = [json.loads(line[5:]) for line in resp.text.splitlines() if line.startswith("data:")]
        assert events[-1]["type"] == "image_generation.completed", resp.text
    return resp


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_rest_resubmits_on_the_same_balanced_channel(fakes: list[FakeServer], stream: bool) -> None:
    """Each call that reaches fakes[1] fails UNAVAILABLE before answering; round_robin's next pick is fakes[0]."""
    method = "GenerateImagesStream" if stream else "GenerateImages"
    injected = refused = 0
    async with rest(_balanced(fakes)) as client:
        for _ in range(40):  # until fakes[1] has refused twice (the first calls may all go to the first one ready)
            injected += _unavailable_once(fakes[1], method)
            resp = await _post(client, stream)
            assert resp.status_code == 200, resp.text  # a refused request was answered by the other one
            refused = injected - len(fakes[1].servicer.fail[method])
            if refused >= 2:
                break
    assert refused >= 2
    assert _generations(fakes[0], method) >= refused


async def test_rest_on_a_balanced_channel_survives_a_stopped_gateway(fakes: list[FakeServer]) -> None:
    async with rest(_balanced(fakes)) as client:
        for _ in range(40):  # until round_robin has used both
            assert (await client.post("/v1/images/generations", json=BODY)).status_code == 200
            if all(_generations(f) for f in fakes):
                break
        assert all(_generations(f) for f in fakes)
        fakes[1].server.stop(None).wait()
        before = _generations(fakes[0])
        for _ in range(6):
            resp = await client.post("/v1/images/generations", json=BODY)
            assert resp.status_code == 200, resp.text
    assert _generations(fakes[0]) == before + 6


async def test_rest_on_one_balanced_channel_still_answers_503_when_every_gateway_refuses(
        fakes: list[FakeServer]) -> None:
    """Bounded: once per other backend, then the last failure is the answer (no loop over the same refusals)."""
    for fake in fakes:
        fake.servicer.fail["GenerateImages"].extend([grpc.StatusCode.UNAVAILABLE] * 10)
    async with rest(_balanced(fakes)) as client:
        assert (await client.post("/v1/images/generations", json=BODY)).status_code == 503
    assert sum(_generations(f) for f in fakes) == 2  # the first attempt and one resubmission


async def test_a_balanced_channel_skips_a_gateway_that_is_not_serving() -> None:
    """Client-side health checking: a gateway that says NOT_SERVING (starting, or draining after SIGTERM) gets no
    new call although its port is open; it gets calls again once it says SERVING."""
    with serve_fake(with_health=True) as serving, serve_fake(with_health=True) as draining:
        draining.health.set(GATEWAY_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
        async with rest(_balanced([serving, draining])) as client:
            for _ in range(6):
                assert (await client.post("/v1/images/generations", json=BODY)).status_code == 200
            assert (_generations(serving), _generations(draining)) == (6, 0)
            draining.health.set(GATEWAY_SERVICE, health_pb2.HealthCheckResponse.SERVING)
            for _ in range(200):  # until its health watch has told the channel
                assert (await client.post("/v1/images/generations", json=BODY)).status_code == 200
                if _generations(draining):
                    break
            assert _generations(draining) > 0


async def test_rest_resubmits_on_a_dns_target() -> None:
    """dns:///name:port, as the chart gives the REST front: one resubmission per address the name resolves to."""
    with serve_fake() as fake:
        port = fake.address.rsplit(":", 1)[1]
        _unavailable_once(fake, "GenerateImages")
        async with rest(f"dns:///localhost:{port}") as client:
            assert (await client.post("/v1/images/generations", json=BODY)).status_code == 200
        assert _generations(fake) == 2


async def test_rest_starts_on_a_dns_name_that_resolves_to_nothing_yet() -> None:
    """In a fresh install the gateways' headless name has no address until the pods start: the front starts, is
    not ready (/health 503), answers 503 without resubmitting, and does not crash."""
    app = create_app(RestSettings(gateway_address="dns:///no-gateway-yet.invalid:50050", health_timeout=1.0))
    transport = httpx.ASGITransport(app=app)
    async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        health = await c.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "unavailable"
        assert (await c.post("/v1/images/generations", json=BODY)).status_code == 503
        assert (await c.get("/v1/models")).status_code == 200


async def test_other_backends_of_a_balanced_target() -> None:
    assert dns_host_port("dns:///gw.ns.svc.cluster.local:50050") == ("gw.ns.svc.cluster.local", "50050")
    assert dns_host_port("dns://10.0.0.10:53/gw:1") == ("gw", "1")
    assert dns_host_port("dns:gw") == ("gw", "443")
    assert dns_host_port("dns:///[::1]:7") == ("::1", "7")
    settings = RestSettings()
    cases = {"127.0.0.1:1": (0, 0), "ipv4:127.0.0.1:1,127.0.0.1:2,127.0.0.1:3": (2, 2), "ipv4:127.0.0.1:1": (0, 0),
             "dns:///no-gateway-yet.invalid:1": (0, 0),
             "dns:///localhost:1": (1, upstream.MAX_BALANCED_RESUBMISSIONS)}
    for address, (low, high) in cases.items():
        gateway = upstream.open_gateway(settings, None, address)
        try:
            assert low <= await gateway.other_backends() <= high, address
        finally:
            await gateway.channel.close()


async def test_a_balanced_tls_channel_checks_the_server_name_override(pki) -> None:
    """The chart's REST front dials its gateways by pod IP through the headless name over TLS: the name checked on
    every gateway's certificate is --gateway-tls-server-name, for each backend of the one channel."""
    credentials = pki.server_credentials(mutual=True)
    with serve_fake(credentials) as a, serve_fake(credentials) as b:
        def settings(server_name: str) -> RestSettings:
            return RestSettings(gateway_address=_balanced([a, b]), gateway_tls_ca=pki.ca,
                                gateway_tls_client_cert=pki.client_cert, gateway_tls_client_key=pki.client_key,
                                gateway_tls_server_name=server_name)

        for server_name, status in [("not-the-gateway.example", 503), ("localhost", 200)]:
            app = create_app(settings(server_name))
            transport = httpx.ASGITransport(app=app)
            async with (app.router.lifespan_context(app),
                        httpx.AsyncClient(transport=transport, base_url="http://t") as client):
                answered = False
                for _ in range(40):
                    resp = await client.post("/v1/images/generations", json=BODY)
                    if status == 200 and not answered and resp.status_code == 503:
                        continue  # the TLS handshakes may outlast the reconnect wait on a loaded machine
                    assert resp.status_code == status, resp.text
                    answered = True
                    if status != 200 or (_generations(a) and _generations(b)):
                        break
                assert answered
        assert _generations(a) and _generations(b)


async def test_resubmissions_share_one_deadline(fakes: list[FakeServer]) -> None:
    """A request resubmitted to the next gateway gets what is left of its timeout, not a fresh one: otherwise a
    request could run for the timeout once per gateway."""
    settings = RestSettings(gateway_address=",".join(f.address for f in fakes))
    gateways = upstream.open_gateways(settings, None)
    try:
        attempts = upstream.Resubmissions(gateways, "rid", timeout=0.2)
        await attempts.__anext__()
        assert 0 < attempts.remaining() <= 0.2
        loop = asyncio.get_running_loop()
        deadline = loop.time() + attempts.remaining()
        while loop.time() < deadline:  # let the whole timeout pass (the request's own clock, nothing to wait on)
            await asyncio.sleep(deadline - loop.time())
        with pytest.raises(StopAsyncIteration):  # the second gateway is left, but not the time to try it
            await attempts.__anext__()
        fresh = upstream.Resubmissions(gateways, "rid", timeout=30)
        await fresh.__anext__()
        await fresh.__anext__()  # the next gateway, with what is left of the same 30 s
        assert fresh.remaining() <= 30
    finally:
        await gateways.close()
