"""A tenant's rate limits and priority through the real REST app, over the scripted gateway sending what the real one
sends (tests/support/rest_gateway.py): the six x-ratelimit-* headers on a JSON answer, on an event stream's response
and on an error; a quota refusal as OpenAI's 429 (`rate_limit_exceeded`, Retry-After) with httpx and the openai SDK;
a queue-full 429 as before; `priority` in a JSON body and an edit's form.
"""

from __future__ import annotations

import grpc
import httpx
import openai
import pytest

from glmimage.v1 import gateway_service_pb2 as gw
from rest.app import RestSettings, create_app
from rest.ratelimits import RATE_LIMIT_HEADERS
from runtime.errors import InvalidArgument
from tests.support.images import image_file
from tests.support.rest_gateway import (
    COMPLETED,
    RATE_LIMITS,
    SPENT,
    Backend,
    asgi_client,
    assert_error,
    generate,
    parse_sse,
    quota_refusal,
)


def figures(resp: httpx.Response) -> dict[str, str]:
    return {name: resp.headers[name] for name in RATE_LIMIT_HEADERS if name in resp.headers}


# --- the headers on every answer ---------------------------------------------------------------------------------


async def test_an_admitted_call_s_figures_are_the_json_answer_s_headers(client: httpx.AsyncClient,
                                                                         backend: Backend) -> None:
    backend.servicer.admitted_metadata = RATE_LIMITS
    resp = await generate(client, {"prompt": "x"})
    assert resp.status_code == 200, resp.text
    assert figures(resp) == dict(RATE_LIMITS)


async def test_an_admitted_stream_s_figures_are_its_response_headers(client: httpx.AsyncClient,
                                                                     backend: Backend) -> None:
    backend.servicer.admitted_metadata = RATE_LIMITS
    resp = await generate(client, {"prompt": "x", "stream": True})
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    assert figures(resp) == dict(RATE_LIMITS)
    events, _ = parse_sse(resp.text)
    assert [name for name, _ in events] == [COMPLETED]


async def test_a_tenant_without_quotas_gets_no_figures(client: httpx.AsyncClient) -> None:
    for body in ({"prompt": "x"}, {"prompt": "x", "stream": True}):
        resp = await generate(client, body)
        assert resp.status_code == 200 and figures(resp) == {}


async def test_an_admitted_call_that_fails_keeps_its_figures_on_the_error(client: httpx.AsyncClient,
                                                                          backend: Backend) -> None:
    backend.servicer.admitted_metadata = RATE_LIMITS
    backend.servicer.fail_after_admit = (grpc.StatusCode.UNAVAILABLE, "no denoiser is available")
    resp = await generate(client, {"prompt": "x"})
    assert_error(resp, 503, None, "unavailable")
    assert figures(resp) == dict(RATE_LIMITS)


# --- a quota refusal -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_a_quota_refusal_is_openai_s_rate_limit_answer(client: httpx.AsyncClient, backend: Backend,
                                                             stream: bool) -> None:
    backend.servicer.abort = quota_refusal("images_per_minute")
    resp = await generate(client, {"prompt": "x", "n": 2, "stream": stream})
    err = assert_error(resp, 429, None, "rate_limit_exceeded")
    assert err["type"] == "rate_limit_exceeded"
    assert "images_per_minute" in err["message"]  # the gateway's words, naming the quota
    assert resp.headers["retry-after"] == "12"
    assert figures(resp) == dict(SPENT)  # the refused call's trailing figures


@pytest.mark.parametrize(("delay", "expected"), [(11.2, "12"), (0.2, "1"), (3.0, "3")])
async def test_retry_after_falls_back_on_the_retry_info(client: httpx.AsyncClient, backend: Backend, delay: float,
                                                        expected: str) -> None:
    backend.servicer.abort = quota_refusal(delay=delay, retry_after=None)
    resp = await generate(client, {"prompt": "x"})
    assert_error(resp, 429, None, "rate_limit_exceeded")
    assert resp.headers["retry-after"] == expected  # whole seconds, rounded up, at least one


async def test_a_full_queue_keeps_today_s_answer(client: httpx.AsyncClient, backend: Backend) -> None:
    backend.servicer.abort = (grpc.StatusCode.RESOURCE_EXHAUSTED, "the gateway's queue is full")
    resp = await generate(client, {"prompt": "x"})
    err = assert_error(resp, 429, None, "resource_exhausted")
    assert err["type"] == "rate_limit_error"
    assert resp.headers["retry-after"] == "1"
    assert figures(resp) == {}


async def test_the_sdk_reads_the_429_and_the_headers(app, backend: Backend) -> None:
    async with asgi_client(app) as http:
        sdk = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", max_retries=0, http_client=http)
        backend.servicer.admitted_metadata = RATE_LIMITS
        raw = await sdk.images.with_raw_response.generate(prompt="x", n=2)
        assert len(raw.parse().data) == 2
        assert {name: raw.headers[name] for name in RATE_LIMIT_HEADERS} == dict(RATE_LIMITS)
        raw = await sdk.images.with_raw_response.generate(prompt="x", stream=True)
        assert {name: raw.headers[name] for name in RATE_LIMIT_HEADERS} == dict(RATE_LIMITS)
        assert [e.type async for e in raw.parse()] == [COMPLETED]

        backend.servicer.abort = quota_refusal()
        with pytest.raises(openai.RateLimitError) as info:
            await sdk.images.generate(prompt="x")
        err = info.value
        assert err.status_code == 429 and err.code == "rate_limit_exceeded" and err.type == "rate_limit_exceeded"
        assert "requests_per_minute" in err.message
        assert err.response.headers["retry-after"] == "12"
        assert err.response.headers["x-ratelimit-remaining-requests"] == "0"
        with pytest.raises(openai.RateLimitError):  # the stream's refusal comes before any event
            await sdk.images.generate(prompt="x", stream=True)


async def test_a_browser_may_read_the_figures(backend: Backend) -> None:
    app = create_app(RestSettings(gateway_address=backend.address, cors_origins=("https://app.example",)))
    backend.servicer.admitted_metadata = RATE_LIMITS
    async with app.router.lifespan_context(app), asgi_client(app) as client:
        resp = await generate(client, {"prompt": "x"}, headers={"Origin": "https://app.example"})
    assert resp.status_code == 200
    exposed = {h.strip() for h in resp.headers["access-control-expose-headers"].split(",")}
    assert {*RATE_LIMIT_HEADERS, "retry-after", "x-request-id"} <= exposed


# --- priority ------------------------------------------------------------------------------------------------

PRIORITIES = {"interactive": gw.PRIORITY_INTERACTIVE, "default": gw.PRIORITY_DEFAULT, "batch": gw.PRIORITY_BATCH}


@pytest.mark.parametrize("name", [*PRIORITIES, None])
async def test_priority_in_a_json_body(client: httpx.AsyncClient, backend: Backend, name: str | None) -> None:
    body = {"prompt": "x"} | ({} if name is None else {"priority": name})
    assert (await generate(client, body)).status_code == 200
    assert (await generate(client, {**body, "stream": True})).status_code == 200
    (request, _), = backend.servicer.calls
    (stream_request, _), = backend.servicer.stream_calls
    expected = gw.PRIORITY_UNSPECIFIED if name is None else PRIORITIES[name]
    assert request.priority == stream_request.request.priority == expected


@pytest.mark.parametrize("value", ["urgent", "Interactive", "", 1, True, None])
async def test_a_bad_priority_is_a_400_naming_it(client: httpx.AsyncClient, backend: Backend, value) -> None:
    resp = await generate(client, {"prompt": "x", "priority": value})
    if value is None:  # null: unset, as for every optional field
        assert resp.status_code == 200
        return
    assert_error(resp, 400, "priority")
    assert backend.servicer.calls == []


async def edit(client: httpx.AsyncClient, **fields: str) -> httpx.Response:
    return await client.post("/v1/images/edits", data={"prompt": "x", **fields},
                             files=[("image", ("ref.png", image_file(), "image/png"))])


@pytest.mark.parametrize("name", [*PRIORITIES, None])
async def test_priority_in_an_edit_s_form(client: httpx.AsyncClient, backend: Backend, name: str | None) -> None:
    resp = await edit(client, **({} if name is None else {"priority": name}))
    assert resp.status_code == 200, resp.text
    (request, _), = backend.servicer.calls
    assert request.priority == (gw.PRIORITY_UNSPECIFIED if name is None else PRIORITIES[name])
    assert len(request.reference_images) == 1


async def test_a_bad_priority_in_a_form_is_a_400_naming_it(client: httpx.AsyncClient, backend: Backend) -> None:
    assert_error(await edit(client, priority="asap"), 400, "priority")
    assert backend.servicer.calls == []


async def test_a_class_above_the_tenant_s_is_the_gateway_s_400_on_priority(client: httpx.AsyncClient,
                                                                          backend: Backend) -> None:
    # The gateway knows the tenant's max_priority; its refusal names the field, which the front names as the param.
    backend.servicer.abort = (InvalidArgument("priority", "tenant 'beta' may ask for 'default' at most"), "")
    err = assert_error(await generate(client, {"prompt": "x", "priority": "interactive"}), 400, "priority",
                       "invalid_argument")
    assert "at most" in err["message"]


def test_the_openapi_document_lists_priority(app) -> None:
    schemas = app.openapi()["components"]["schemas"]
    for model in ("ImageGenerationRequest", "ImageEditRequest"):
        prop = schemas[model]["properties"]["priority"]
        assert {"enum": ["interactive", "default", "batch"], "type": "string"} in prop["anyOf"]
        assert "max_priority" in prop["description"]
