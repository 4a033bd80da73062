"""Random JSON bodies at the REST front (hypothesis, and schemathesis from its own OpenAPI document): never a 5xx,
and a normal request still served after them.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hyp_settings
from hypothesis import strategies as st

from rest.app import RestSettings, create_app
from rest.schemas import (
    ImageGenCompletedEvent,
    ImageGenerationRequest,
    ImageGenPartialImageEvent,
    ImagesResponse,
)
from tests.support.rest_gateway import (
    COMPLETED,
    PARTIAL,
    generate,
    parse_sse,
)

# --- fuzz ------------------------------------------------------------------------------------------

FIELD_NAMES = [*ImageGenerationRequest.model_fields, "style", "moderation", "unknown"]
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**40), max_value=2**40)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
    | st.sampled_from([
        "png", "jpeg", "webp", "gif", "url", "b64_json", "auto", "opaque", "transparent", "low", "hd",
        "256x256", "64x96", "0x0", "4096x4096", "glm-image", "dall-e-3", "1", "",
    ])
)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=4,
)
FIELD_DICTS = st.dictionaries(st.sampled_from(FIELD_NAMES), JSON_VALUES, max_size=8)
BODIES = st.one_of(FIELD_DICTS, FIELD_DICTS.map(lambda d: {**d, "prompt": "fuzz"}), JSON_VALUES)


def check_answer(resp: httpx.Response) -> None:
    """What any request must get: no 5xx, and a body in the documented shape for its status."""
    assert resp.status_code < 500, resp.text
    if resp.status_code != 200:
        assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
    elif resp.headers["content-type"].startswith("text/event-stream"):
        events, _ = parse_sse(resp.text)
        for name, data in events:
            (ImageGenPartialImageEvent if name == PARTIAL else ImageGenCompletedEvent).model_validate(data)
        assert events and events[-1][0] == COMPLETED
    else:
        body = ImagesResponse.model_validate(resp.json())
        assert len(body.data) == body.usage.image_count


@hyp_settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=BODIES)
async def test_fuzz_never_5xx(client: httpx.AsyncClient, body: Any) -> None:
    check_answer(await generate(client, body))


def _schemathesis_cases() -> st.SearchStrategy:
    """Cases generated from our own OpenAPI document: valid ones (which must still be answered sensibly) and
    schema-violating ones (which must all be 4xx). Built at the first draw (st.deferred), so that only the worker
    running this file imports schemathesis, not every one collecting it."""
    import schemathesis
    from schemathesis import GenerationMode

    generations = schemathesis.openapi.from_dict(create_app(RestSettings()).openapi())["/v1/images/generations"]
    return (generations["POST"].as_strategy(GenerationMode.POSITIVE)
            | generations["POST"].as_strategy(GenerationMode.NEGATIVE))


@pytest.mark.skipif(importlib.util.find_spec("schemathesis") is None,
                    reason="schemathesis is not installed (it comes with the dev extra)")
@hyp_settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=st.deferred(_schemathesis_cases))
async def test_schemathesis_never_5xx(client: httpx.AsyncClient, case: Any) -> None:
    kwargs = case.as_transport_kwargs(base_url="http://test")
    if "data" in kwargs:  # raw bytes (not JSON); httpx calls that `content`
        kwargs["content"] = kwargs.pop("data")
    kwargs.pop("cookies", None)  # always empty: the API has no cookie parameters
    check_answer(await client.request(**kwargs))


async def test_normal_request_after_fuzz(client: httpx.AsyncClient) -> None:
    # Runs after the fuzz tests (file order): the app must still be healthy.
    resp = await generate(client, {"prompt": "still fine", "n": 2})
    assert resp.status_code == 200, resp.text
    assert len(resp.json()["data"]) == 2
    assert (await client.get("/health")).status_code == 200
