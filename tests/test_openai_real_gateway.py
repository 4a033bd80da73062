"""The REST front against the real gateway process, with zero-cost in-test backends: cache reporting (an AR that
reports cached prompt tokens), the gateway's own API keys, and mutual TLS between REST and the gateway."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio

from bench.zero_cost_backends import Backends, prompt_tokens, start_backends
from rest.app import RestSettings, create_app
from tests.support.certs import Pki
from tests.support.cluster import reap

pytestmark = pytest.mark.e2e

CACHED = 5
KEY = "gw-secret"
PROMPT = "a lighthouse at dusk, oil on canvas"
STARTUP_TIMEOUT_S = 30.0


@pytest_asyncio.fixture(scope="module")
async def backends() -> AsyncIterator[Backends]:
    servers = await start_backends(denoisers=2, cached_tokens=CACHED)
    try:
        yield servers
    finally:
        await servers.stop()


async def _wait_for_port(path: Path, proc: subprocess.Popen, timeout: float) -> str:
    """Bounded wait for the gateway's --port-file (written atomically once it listens)."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            pytest.fail(f"the gateway exited with code {proc.returncode} before listening")
        if time.monotonic() > deadline:
            pytest.fail(f"the gateway did not listen within {timeout:.0f}s")
        await asyncio.sleep(0.02)
    return path.read_text().strip()


@asynccontextmanager
async def gateway_process(backends: Backends, work: Path, *flags: str) -> AsyncIterator[str]:
    """`python -m gateway` in front of the in-test backends; yields its address."""
    port_file = work / "port"
    argv = [sys.executable, "-m", "gateway", "--port", "0", "--port-file", str(port_file), "--ar",
            backends.ar_address, *(f"--denoiser={d}" for d in backends.denoiser_addresses), "--log-level", "WARNING",
            # Requests may arrive before the health watches have seen the backends: let them wait, not fail fast.
            "--queue-without-workers", *flags]
    proc = subprocess.Popen(argv)
    try:
        yield f"127.0.0.1:{await _wait_for_port(port_file, proc, STARTUP_TIMEOUT_S)}"
    finally:
        proc.terminate()
        reap(proc, 10)


@pytest_asyncio.fixture(scope="module")
async def plain_gateway(backends: Backends, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[str]:
    # The gateway passes cached_tokens through as the AR reports them; hiding them is the REST front's rule.
    async with gateway_process(backends, tmp_path_factory.mktemp("gateway")) as address:
        yield address


@pytest_asyncio.fixture(scope="module")
async def keyed_gateway(backends: Backends, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[str]:
    async with gateway_process(backends, tmp_path_factory.mktemp("gateway-keys"), "--api-key", KEY) as address:
        yield address


@pytest_asyncio.fixture(scope="module")
async def tls_gateway(backends: Backends, pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[str]:
    flags = ["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key), "--tls-client-ca", str(pki.ca)]
    async with gateway_process(backends, tmp_path_factory.mktemp("gateway-tls"), *flags) as address:
        yield address


@asynccontextmanager
async def rest(settings: RestSettings) -> AsyncIterator[httpx.AsyncClient]:
    """The REST app in this process (lifespan included), reached through httpx's ASGI transport."""
    app = create_app(settings)
    transport = httpx.ASGITransport(app=app)
    async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        yield c


def _sdk(http: httpx.AsyncClient, api_key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://t/v1", api_key=api_key, max_retries=0, http_client=http)


def gateway_streams() -> bool:
    """Whether this gateway build implements GenerateImagesStream (the generated base class answers UNIMPLEMENTED)."""
    from gateway.servicer import GatewayServicer
    from glmimage.v1.gateway_service_pb2_grpc import GatewayServiceServicer

    return GatewayServicer.GenerateImagesStream is not GatewayServiceServicer.GenerateImagesStream


# --- cache report ---------------------------------------------------------------------------------------


async def _usage(client: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    resp = await client.post("/v1/images/generations", json={"prompt": PROMPT, "size": "64x64", **body})
    assert resp.status_code == 200, resp.text
    return resp.json()["usage"]


@pytest.fixture
def cached_tokens(backends: Backends) -> Iterator[None]:
    backends.ar_servicer.cached_tokens = CACHED
    yield
    backends.ar_servicer.cached_tokens = CACHED


async def test_cached_tokens_hidden_by_default(plain_gateway: str, cached_tokens: None) -> None:
    async with rest(RestSettings(gateway_address=plain_gateway)) as client:
        usage = await _usage(client, n=3)
    assert "prompt_tokens_details" not in usage
    # The rest of the usage block went through the gateway intact, summed over the outputs.
    assert usage["input_tokens"] == usage["prompt_tokens"] == 3 * prompt_tokens(PROMPT)
    assert usage["output_tokens"] == usage["completion_tokens"] == 3 * ((64 // 16) ** 2 + 1)
    assert usage["image_count"] == 3


async def test_cached_tokens_shown_when_enabled(plain_gateway: str, backends: Backends, cached_tokens: None) -> None:
    async with rest(RestSettings(gateway_address=plain_gateway, enable_cache_report=True)) as client:
        assert (await _usage(client, n=3))["prompt_tokens_details"] == {"cached_tokens": 3 * CACHED}
        assert (await _usage(client))["prompt_tokens_details"] == {"cached_tokens": CACHED}
        backends.ar_servicer.cached_tokens = 0
        assert "prompt_tokens_details" not in await _usage(client, n=2)  # enabled, but nothing was cached


async def test_cached_tokens_on_streamed_events(plain_gateway: str, cached_tokens: None) -> None:
    if not gateway_streams():
        pytest.skip("this gateway build has no GenerateImagesStream yet")
    async with rest(RestSettings(gateway_address=plain_gateway, enable_cache_report=True)) as client:
        resp = await client.post("/v1/images/generations",
                                 json={"prompt": PROMPT, "size": "64x64", "n": 2, "stream": True})
    if resp.status_code == 501:
        pytest.skip(f"the gateway answered UNIMPLEMENTED: {resp.json()['error']['message']}")
    assert resp.status_code == 200, resp.text
    events = [json.loads(line.removeprefix("data: ")) for line in resp.text.splitlines() if line.startswith("data: ")]
    assert [e["type"] for e in events] == ["image_generation.completed"] * 2  # one per image
    assert [e["usage"]["prompt_tokens_details"] for e in events] == [{"cached_tokens": CACHED}] * 2


# --- the gateway's API keys, checked on the key the REST client sent --------------------------------------


async def test_gateway_key_end_to_end(keyed_gateway: str) -> None:
    async with rest(RestSettings(gateway_address=keyed_gateway, gateway_api_key=KEY)) as http:
        res = await _sdk(http, KEY).images.generate(prompt=PROMPT, n=2, size="64x64")
        assert len(res.data) == 2
        with pytest.raises(openai.AuthenticationError) as refused:
            await _sdk(http, "wrong").images.generate(prompt=PROMPT, size="64x64")
        assert refused.value.code == "unauthenticated"  # the gateway's verdict, not REST's
        if gateway_streams():
            events = [e async for e in await _sdk(http, KEY).images.generate(prompt=PROMPT, size="64x64",
                                                                              stream=True)]
            assert [e.type for e in events] == ["image_generation.completed"]
            with pytest.raises(openai.AuthenticationError):
                await _sdk(http, "wrong").images.generate(prompt=PROMPT, size="64x64", stream=True)
        # /health uses REST's own key for GetStatus.
        assert (await http.get("/health")).status_code == 200


async def test_health_without_gateway_key_says_why(keyed_gateway: str) -> None:
    async with rest(RestSettings(gateway_address=keyed_gateway)) as http:
        resp = await http.get("/health")
    if resp.status_code == 200:
        pytest.skip("this gateway leaves GetStatus open")
    assert resp.status_code == 503
    assert "--gateway-api-key" in resp.json()["reason"]


async def test_rest_keys_in_front_of_gateway_keys(keyed_gateway: str) -> None:
    settings = RestSettings(gateway_address=keyed_gateway, api_keys=(KEY,), gateway_api_key=KEY)
    async with rest(settings) as http:
        assert len((await _sdk(http, KEY).images.generate(prompt=PROMPT, size="64x64")).data) == 1
        with pytest.raises(openai.AuthenticationError) as refused:
            await _sdk(http, "wrong").images.generate(prompt=PROMPT, size="64x64")
        assert refused.value.code == "invalid_api_key"  # REST's own check, before any gRPC


# --- mutual TLS between REST and the gateway ---------------------------------------------------------------


async def test_mutual_tls_to_the_gateway(tls_gateway: str, pki: Pki) -> None:
    settings = RestSettings(gateway_address=tls_gateway, gateway_tls_ca=pki.ca, gateway_tls_client_cert=pki.client_cert,
                            gateway_tls_client_key=pki.client_key)
    async with rest(settings) as http:
        assert len((await _sdk(http, "x").images.generate(prompt=PROMPT, n=2, size="64x64")).data) == 2
        assert (await http.get("/health")).status_code == 200


async def test_tls_gateway_refuses_rest_without_client_certificate(tls_gateway: str, pki: Pki) -> None:
    async with rest(RestSettings(gateway_address=tls_gateway, gateway_tls_ca=pki.ca, request_timeout=10)) as http:
        resp = await http.post("/v1/images/generations", json={"prompt": PROMPT, "size": "64x64"})
        assert resp.status_code == 503, resp.text
        assert (await http.get("/health")).status_code == 503
