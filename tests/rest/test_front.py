"""The REST front's own surface: its API keys and the gateway's, models, CORS, health, metrics, OpenAPI, TLS to the
gateway and its listening socket.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path

import grpc
import httpx
import openai
import pytest
import pytest_asyncio
from fastapi import FastAPI
from grpc_health.v1 import health_pb2, health_pb2_grpc

from glmimage.v1 import common_pb2
from glmimage.v1 import gateway_service_pb2 as gw
from glmimage.v1 import gateway_service_pb2_grpc as gw_grpc
from rest import __main__ as rest_main
from rest.app import RestSettings, create_app
from tests.support.certs import Pki
from tests.support.rest_gateway import (
    COMPLETED,
    PARTIAL,
    Backend,
    asgi_client,
    assert_error,
    generate,
    parse_sse,
    rest_client,
)

# --- auth, models, health, metrics ------------------------------------------------------------------


async def test_auth(backend: Backend) -> None:
    settings = RestSettings(gateway_address=backend.address, api_keys=("k1", "k2"))
    async with rest_client(settings) as c:
        assert_error(await generate(c, {"prompt": "x"}), 401, None, "invalid_api_key")
        assert_error(await generate(c, {"prompt": "x"}, headers={"Authorization": "Bearer nope"}),
                      401, None, "invalid_api_key")
        # Auth is checked before the body is parsed.
        assert_error(await c.post("/v1/images/generations", content=b"{"), 401, None, "invalid_api_key")
        assert_error(await c.get("/v1/models"), 401, None, "invalid_api_key")
        assert backend.servicer.calls == []

        resp = await generate(c, {"prompt": "x"}, headers={"Authorization": "Bearer k2"})
        assert resp.status_code == 200, resp.text
        assert backend.servicer.calls[0][1]["authorization"] == "Bearer k2"
        assert (await c.get("/v1/models", headers={"Authorization": "Bearer k1"})).status_code == 200
        assert (await c.get("/health")).status_code == 200
        assert (await c.get("/metrics")).status_code == 200


async def test_auth_off_forwards_authorization(client: httpx.AsyncClient, backend: Backend) -> None:
    resp = await generate(client, {"prompt": "x"}, headers={"Authorization": "Bearer whatever"})
    assert resp.status_code == 200
    assert backend.servicer.calls[0][1]["authorization"] == "Bearer whatever"


async def test_models(client: httpx.AsyncClient) -> None:
    body = (await client.get("/v1/models")).json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["glm-image", "gpt-image-1", "dall-e-3"]
    assert all(m["object"] == "model" for m in body["data"])


async def test_models_lists_the_adapters_the_gateway_shows_the_caller_s_key(backend: Backend) -> None:
    # The gateway checks keys (REST forwards the caller's): a list read with one key is never shown to another.
    backend.servicer.required_authorization = "Bearer gw-key"
    backend.servicer.loras = [common_pb2.LoraInfo(name="tiny-style")]
    async with rest_client(RestSettings(gateway_address=backend.address)) as c:
        good = (await c.get("/v1/models", headers={"Authorization": "Bearer gw-key"})).json()
        bad = (await c.get("/v1/models", headers={"Authorization": "Bearer other"})).json()
        assert_error(await c.get("/v1/models/tiny-style", headers={"Authorization": "Bearer other"}), 404, "model",
                     "model_not_found")
        assert_error(await generate(c, {"prompt": "x", "model": "tiny-style"},
                                    headers={"Authorization": "Bearer other"}), 401, None, "unauthenticated")
        resp = await generate(c, {"prompt": "x", "model": "tiny-style"}, headers={"Authorization": "Bearer gw-key"})
        assert resp.status_code == 200, resp.text
    assert [m["id"] for m in good["data"]][-1] == "tiny-style" and good["data"][-1]["parent"] == "glm-image"
    assert [m["id"] for m in bad["data"]] == ["glm-image", "gpt-image-1", "dall-e-3"]
    keys = [m["authorization"] for m in backend.servicer.list_loras_calls]
    assert list(dict.fromkeys(keys)) == ["Bearer gw-key", "Bearer other"]  # re-read only past the TTL or retry
    [(request, _)] = backend.servicer.calls
    assert [ref.name for ref in request.loras] == ["tiny-style"]


async def test_retrieve_model_with_the_sdk(app: FastAPI, backend: Backend) -> None:
    async with asgi_client(app) as http:
        sdk = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", max_retries=0, http_client=http)
        for name in ("glm-image", "gpt-image-1", "dall-e-3"):
            model = await sdk.models.retrieve(name)
            assert (model.id, model.object, model.owned_by) == (name, "model", "glmimage")
            assert isinstance(model.created, int)
        with pytest.raises(openai.NotFoundError) as info:
            await sdk.models.retrieve("sdxl")
    assert info.value.code == "model_not_found"
    assert info.value.body == {"message": info.value.body["message"], "type": "invalid_request_error",
                               "param": "model", "code": "model_not_found"}
    async with rest_client(RestSettings(gateway_address=backend.address, served_model="zai-org/GLM-Image")) as c:
        resp = await c.get("/v1/models/zai-org/GLM-Image")
        assert resp.status_code == 200 and resp.json()["id"] == "zai-org/GLM-Image"
        assert_error(await c.get("/v1/models/glm-image"), 404, "model", "model_not_found")


def _preflight(origin: str) -> dict[str, str]:
    return {"origin": origin, "access-control-request-method": "POST",
            "access-control-request-headers": "authorization, content-type"}


async def test_cors_off_by_default(client: httpx.AsyncClient) -> None:
    origin = "https://app.example.com"
    resp = await client.options("/v1/images/generations", headers=_preflight(origin))
    assert "access-control-allow-origin" not in resp.headers
    resp = await generate(client, {"prompt": "x"}, headers={"origin": origin})
    assert resp.status_code == 200 and "access-control-allow-origin" not in resp.headers
    assert rest_main.settings_from_args(rest_main.parse_args([])).cors_origins == ()


async def test_cors_for_the_given_origins_only(backend: Backend) -> None:
    allowed = ["https://app.example.com", "http://localhost:3000"]
    args = rest_main.parse_args(["--gateway-address", backend.address, "--api-key", "k",
                                 *[a for o in allowed for a in ("--cors-origin", o)]])
    settings = rest_main.settings_from_args(args)
    assert settings.cors_origins == tuple(allowed)
    async with rest_client(settings) as c:
        for origin in allowed:
            resp = await c.options("/v1/images/generations", headers=_preflight(origin))  # no key on a preflight
            assert resp.status_code == 200, resp.text
            assert resp.headers["access-control-allow-origin"] == origin
            assert "POST" in resp.headers["access-control-allow-methods"]
            assert "authorization" in resp.headers["access-control-allow-headers"].lower()
            resp = await generate(c, {"prompt": "x"}, headers={"origin": origin, "authorization": "Bearer k"})
            assert resp.status_code == 200 and resp.headers["access-control-allow-origin"] == origin
            assert "x-request-id" in resp.headers["access-control-expose-headers"]
        other = "https://evil.example.net"
        resp = await c.options("/v1/images/generations", headers=_preflight(other))
        assert resp.status_code == 400 and "access-control-allow-origin" not in resp.headers
        resp = await generate(c, {"prompt": "x"}, headers={"origin": other, "authorization": "Bearer k"})
        assert "access-control-allow-origin" not in resp.headers


async def test_health_ok(client: httpx.AsyncClient) -> None:
    resp = await client.get("/health")
    assert resp.status_code == 200, resp.text
    assert resp.json()["status"] == "ok"
    assert resp.json()["ar_workers"] == 1 and resp.json()["denoiser_workers"] == 1


async def test_health_not_serving(client: httpx.AsyncClient, backend: Backend) -> None:
    await backend.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    resp = await client.get("/health")
    assert resp.status_code == 503
    assert resp.json()["status"] == "unavailable"
    assert "NOT_SERVING" in resp.json()["reason"]


@pytest.mark.parametrize(
    ("ar_state", "dn_state", "missing"),
    [
        (gw.WORKER_STATE_AVAILABLE, gw.WORKER_STATE_UNHEALTHY, "denoiser"),
        (gw.WORKER_STATE_DRAINING, gw.WORKER_STATE_AVAILABLE, "AR"),
    ],
)
async def test_health_no_workers(
    client: httpx.AsyncClient, backend: Backend, ar_state: int, dn_state: int, missing: str
) -> None:
    backend.servicer.workers[0].state = ar_state
    backend.servicer.workers[1].state = dn_state
    resp = await client.get("/health")
    assert resp.status_code == 503
    assert f"no {missing} server is ready" in resp.json()["reason"]
    backend.servicer.workers.clear()
    reason = (await client.get("/health")).json()["reason"]
    assert "no AR server is configured" in reason and "no denoiser server is configured" in reason


async def test_health_says_which_stage_is_stuck(client: httpx.AsyncClient, backend: Backend) -> None:
    # A hung AR (SIGSTOP) keeps its connection: the stage is stuck, not gone, and /health says so.
    ar = backend.servicer.workers[0]
    ar.state, ar.stuck, ar.health = gw.WORKER_STATE_UNHEALTHY, True, "not answering health checks (hung)"
    resp = await client.get("/health")
    assert resp.status_code == 503
    body = resp.json()
    assert "AR stage is stuck" in body["reason"] and "hung" in body["reason"]
    assert body["stages"]["ar"] == {"ready": 0, "stuck": 1, "total": 1}
    assert ar.address not in resp.text
    # One stuck worker of several leaves the stage serving; the body still counts it.
    backend.servicer.workers.append(gw.WorkerStatus(address="ar:2", role=gw.WORKER_ROLE_AR,
                                                    state=gw.WORKER_STATE_AVAILABLE))
    resp = await client.get("/health")
    assert resp.status_code == 200 and resp.json()["stages"]["ar"] == {"ready": 1, "stuck": 1, "total": 2}


async def test_metrics(backend: Backend) -> None:
    async with rest_client(RestSettings(gateway_address=backend.address)) as c:
        assert (await generate(c, {"prompt": "x", "n": 3})).status_code == 200
        assert (await generate(c, {"prompt": ""})).status_code == 400
        text = (await c.get("/metrics")).text
    assert 'glmimage_rest_requests_total{route="/v1/images/generations",status="200"} 1.0' in text
    assert 'glmimage_rest_requests_total{route="/v1/images/generations",status="400"} 1.0' in text
    assert "glmimage_rest_images_total 3.0" in text
    assert 'glmimage_rest_request_duration_seconds_count{route="/v1/images/generations"} 2.0' in text


async def test_openapi_documents_body(client: httpx.AsyncClient) -> None:
    doc = (await client.get("/openapi.json")).json()
    assert "/v1/images/generations" in doc["paths"]
    props = doc["components"]["schemas"]["ImageGenerationRequest"]["properties"]
    assert all(p.get("description") for p in props.values())



# --- the gateway's own API keys ----------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_gateway_key_check_reaches_the_client(client: httpx.AsyncClient, backend: Backend, stream: bool) -> None:
    # REST checks no key here; the gateway does, on the forwarded authorization metadata.
    backend.servicer.required_authorization = "Bearer gw-key"
    body = {"prompt": "x", "stream": stream}
    assert_error(await generate(client, body), 401, None, "unauthenticated")
    assert_error(await generate(client, body, headers={"Authorization": "Bearer other"}), 401, None,
                  "unauthenticated")
    resp = await generate(client, body, headers={"Authorization": "Bearer gw-key"})
    assert resp.status_code == 200, resp.text


async def test_health_uses_the_gateway_api_key(backend: Backend) -> None:
    backend.servicer.required_authorization = "Bearer for-rest"
    async with rest_client(RestSettings(gateway_address=backend.address)) as c:
        resp = await c.get("/health")
        assert resp.status_code == 503 and "--gateway-api-key" in resp.json()["reason"]
    async with rest_client(RestSettings(gateway_address=backend.address, gateway_api_key="for-rest")) as c:
        assert (await c.get("/health")).status_code == 200
        # Generation carries the client's key, never REST's own.
        assert_error(await generate(c, {"prompt": "x"}), 401, None, "unauthenticated")


def test_gateway_api_key_flag_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GLMIMAGE_GATEWAY_API_KEY", raising=False)
    monkeypatch.delenv("GLMIMAGE_API_KEYS", raising=False)
    assert rest_main.settings_from_args(rest_main.parse_args([])).gateway_api_key is None
    assert rest_main.settings_from_args(rest_main.parse_args(["--gateway-api-key", "a"])).gateway_api_key == "a"
    monkeypatch.setenv("GLMIMAGE_GATEWAY_API_KEY", "b")
    assert rest_main.settings_from_args(rest_main.parse_args([])).gateway_api_key == "b"
    # Neither given, but the front has keys of its own (the chart's GLMIMAGE_API_KEYS): it uses the first.
    monkeypatch.delenv("GLMIMAGE_GATEWAY_API_KEY")
    monkeypatch.setenv("GLMIMAGE_API_KEYS", "k1,k2")
    assert rest_main.settings_from_args(rest_main.parse_args([])).gateway_api_key == "k1"
    assert rest_main.settings_from_args(rest_main.parse_args(["--gateway-api-key", "a"])).gateway_api_key == "a"


async def test_same_key_on_rest_and_gateway_with_the_sdk(backend: Backend) -> None:
    backend.servicer.required_authorization = "Bearer shared"
    app = create_app(RestSettings(gateway_address=backend.address, api_keys=("shared",)))
    async with app.router.lifespan_context(app), asgi_client(app) as http:
        sdk = openai.AsyncOpenAI(base_url="http://test/v1", api_key="shared", max_retries=0, http_client=http)
        assert len((await sdk.images.generate(prompt="x", n=2)).data) == 2
        events = [e async for e in await sdk.images.generate(prompt="x", stream=True)]
        assert [e.type for e in events] == [COMPLETED]
        with pytest.raises(openai.AuthenticationError):
            await sdk.with_options(api_key="wrong").images.generate(prompt="x")


# --- TLS to the gateway -------------------------------------------------------------------------------


@dataclass
class TlsBackend:
    address: str
    pki: Pki


@pytest_asyncio.fixture(scope="module")
async def tls_backend(backend: Backend, pki: Pki) -> AsyncIterator[TlsBackend]:
    """The same fake gateway servicer on a second port that demands mutual TLS."""
    server = grpc.aio.server()
    gw_grpc.add_GatewayServiceServicer_to_server(backend.servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(backend.health, server)
    port = server.add_secure_port("127.0.0.1:0", pki.server_credentials(mutual=True))
    await server.start()
    try:
        yield TlsBackend(f"127.0.0.1:{port}", pki)
    finally:
        await server.stop(grace=None)


@pytest.mark.parametrize("server_name", [None, "localhost"])
async def test_mutual_tls(tls_backend: TlsBackend, backend: Backend, server_name: str | None) -> None:
    pki = tls_backend.pki
    settings = RestSettings(gateway_address=tls_backend.address, gateway_tls_ca=pki.ca,
                            gateway_tls_client_cert=pki.client_cert, gateway_tls_client_key=pki.client_key,
                            gateway_tls_server_name=server_name)
    async with rest_client(settings) as c:
        resp = await generate(c, {"prompt": "over TLS", "n": 2})
        assert resp.status_code == 200, resp.text
        assert len(resp.json()["data"]) == 2
        events, _ = parse_sse((await generate(c, {"prompt": "x", "stream": True, "partial_images": 1})).text)
        assert [name for name, _ in events] == [PARTIAL, COMPLETED]
        assert (await c.get("/health")).status_code == 200
    assert [r.prompt for r, _ in backend.servicer.calls] == ["over TLS"]


@pytest.mark.parametrize("case", ["plaintext", "no client certificate", "untrusted gateway", "wrong server name"])
async def test_tls_refused(tls_backend: TlsBackend, backend: Backend, case: str) -> None:
    pki = tls_backend.pki
    settings = {
        "plaintext": RestSettings(gateway_address=tls_backend.address),
        "no client certificate": RestSettings(gateway_address=tls_backend.address, gateway_tls_ca=pki.ca),
        "untrusted gateway": RestSettings(
            gateway_address=tls_backend.address, gateway_tls_ca=pki.other_ca,
            gateway_tls_client_cert=pki.client_cert, gateway_tls_client_key=pki.client_key),
        "wrong server name": RestSettings(
            gateway_address=tls_backend.address, gateway_tls_ca=pki.ca, gateway_tls_client_cert=pki.client_cert,
            gateway_tls_client_key=pki.client_key, gateway_tls_server_name="not-the-gateway.example"),
    }[case]
    async with rest_client(replace(settings, request_timeout=10, health_timeout=10)) as c:
        assert_error(await generate(c, {"prompt": "x"}), 503, None, "unavailable")
        assert (await c.get("/health")).status_code == 503
    assert backend.servicer.calls == []


def test_tls_settings_and_flags(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="together"):
        RestSettings(gateway_tls_client_cert=tmp_path / "c.pem")
    with pytest.raises(SystemExit):
        rest_main.parse_args(["--gateway-tls-client-key", "k.pem"])
    args = rest_main.parse_args(["--gateway-address", "gw:443", "--gateway-tls-ca", "ca.pem",
                                 "--gateway-tls-client-cert", "c.pem", "--gateway-tls-client-key", "k.pem",
                                 "--gateway-tls-server-name", "gw.internal"])
    settings = rest_main.settings_from_args(args)
    assert (settings.gateway_tls_ca, settings.gateway_tls_client_cert, settings.gateway_tls_client_key,
            settings.gateway_tls_server_name) == (Path("ca.pem"), Path("c.pem"), Path("k.pem"), "gw.internal")
    assert settings.gateway_tls and not RestSettings().gateway_tls
    with pytest.raises(FileNotFoundError):  # a bad path fails when the app is built, not on the first request
        create_app(settings)



async def test_listen_socket_gives_accepted_connections_tcp_nodelay() -> None:
    # Without TCP_NODELAY every keep-alive response after the first waits ~40 ms (Nagle vs delayed ACK).
    sock = rest_main.listen_socket("127.0.0.1", 0)
    accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    server = await asyncio.start_server(on_connect, sock=sock)
    async with server:
        _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
        assert await asyncio.wait_for(accepted, 10) != 0
        writer.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_own_gateway_auth_sends_the_fronts_key_never_the_clients(backend: Backend, stream: bool) -> None:
    """--gateway-auth own: separate keys per hop; the client's REST key stays in the front."""
    backend.servicer.required_authorization = "Bearer gw-only"
    settings = RestSettings(gateway_address=backend.address, api_keys=("rest-only",), gateway_api_key="gw-only",
                            gateway_auth="own")
    async with rest_client(settings) as c:
        resp = await generate(c, {"prompt": "x", "stream": stream}, headers={"Authorization": "Bearer rest-only"})
        assert resp.status_code == 200, resp.text
        (_, metadata), = backend.servicer.stream_calls if stream else backend.servicer.calls
        assert metadata["authorization"] == "Bearer gw-only"
        assert "rest-only" not in " ".join(metadata.values())
        # The gateway's key is not a REST key.
        assert_error(await generate(c, {"prompt": "x"}, headers={"Authorization": "Bearer gw-only"}), 401, None,
                      "invalid_api_key")


def test_own_gateway_auth_needs_both_key_sets() -> None:
    with pytest.raises(ValueError, match="--gateway-api-key"):
        RestSettings(api_keys=("r",), gateway_auth="own")
    with pytest.raises(ValueError, match="--api-key"):
        RestSettings(gateway_api_key="g", gateway_auth="own")
    with pytest.raises(ValueError, match="forward, own"):
        RestSettings(gateway_auth="both")
