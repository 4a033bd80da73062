"""The REST front's images endpoint on the happy path: shape, usage, defaults, model names, the OpenAI SDK, and the
cached-token report.
"""

from __future__ import annotations

import base64
import json
import re

import grpc
import httpx
import openai
import pytest
from fastapi import FastAPI

from glmimage.v1 import common_pb2
from rest.app import RestSettings
from tests.support.rest_gateway import (
    COMPLETION_TOKENS_PER_IMAGE,
    PNG_MAGIC,
    PROMPT_TOKENS,
    Backend,
    asgi_client,
    assert_error,
    generate,
    image_usage,
    rest_client,
)

# --- happy path -------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 3])
async def test_generate_shape_and_usage(client: httpx.AsyncClient, backend: Backend, n: int) -> None:
    resp = await generate(client, {"prompt": "a red fox", "n": n, "size": "512x256", "quality": "low"},
                           headers={"X-Request-Id": "my-req-42"})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert isinstance(body["created"], int)
    assert len(body["data"]) == n
    for item in body["data"]:
        assert base64.b64decode(item["b64_json"]).startswith(PNG_MAGIC)
    assert body["size"] == "512x256"
    assert body["output_format"] == "png"
    assert body["quality"] == "low"
    assert body["background"] == "opaque"
    assert body["usage"] == image_usage(n)
    assert resp.headers["x-request-id"] == "my-req-42"
    [(req, metadata)] = backend.servicer.calls
    assert metadata["x-request-id"] == "my-req-42"
    assert (req.prompt, req.n, req.width, req.height) == ("a red fox", n, 512, 256)
    assert req.num_inference_steps == 10  # quality=low
    assert not req.HasField("seed") and not req.HasField("guidance_scale")


async def test_defaults_request_id_and_extensions(client: httpx.AsyncClient, backend: Backend) -> None:
    resp = await generate(client, {
        "prompt": "a cat", "size": "auto", "output_format": "webp", "output_compression": 80, "seed": 7,
        "guidance_scale": 2.5, "num_inference_steps": 12, "quality": "high", "partial_images": 2,
        "user": "u1",
        # OpenAI fields taken and ignored on purpose
        "style": "vivid", "moderation": "low", "safety_identifier": "s1",
    })
    assert resp.status_code == 200, resp.text
    assert resp.json()["size"] == "256x256"
    assert resp.json()["output_format"] == "webp"
    rid = resp.headers["x-request-id"]
    assert re.fullmatch(r"req-[0-9a-f]{32}", rid)
    [(req, metadata)] = backend.servicer.calls
    assert metadata["x-request-id"] == rid
    assert req.request_id == rid
    assert req.output_format == common_pb2.IMAGE_FORMAT_WEBP
    assert req.output_compression == 80 and req.seed == 7 and req.guidance_scale == 2.5
    assert req.num_inference_steps == 12  # overrides quality
    assert "authorization" not in metadata


async def test_zero_steps_means_the_denoiser_default(client: httpx.AsyncClient, backend: Backend) -> None:
    # 0 is the denoiser's default all along the stack (gateway and denoiser read it so), whatever quality says;
    # the schema documents it, and 1001 is refused naming the field.
    resp = await generate(client, {"prompt": "x", "quality": "high", "num_inference_steps": 0})
    assert resp.status_code == 200, resp.text
    [(req, _)] = backend.servicer.calls
    assert req.num_inference_steps == 0
    assert_error(await generate(client, {"prompt": "x", "num_inference_steps": 1001}), 400,
                  "num_inference_steps")
    doc = (await client.get("/openapi.json")).json()
    field = doc["components"]["schemas"]["ImageGenerationRequest"]["properties"]["num_inference_steps"]
    assert "0 means the denoiser's default" in field["description"]
    assert any(branch.get("minimum") == 0 for branch in field.get("anyOf", [field]))


@pytest.mark.parametrize("model", ["glm-image", "gpt-image-1", "dall-e-3", None])
async def test_model_names_accepted(client: httpx.AsyncClient, model: str | None) -> None:
    resp = await generate(client, {"prompt": "x", "model": model})
    assert resp.status_code == 200, resp.text


async def test_unknown_model_404(client: httpx.AsyncClient, backend: Backend) -> None:
    assert_error(await generate(client, {"prompt": "x", "model": "sdxl"}), 404, "model", "model_not_found")
    assert backend.servicer.calls == []


async def test_openai_sdk(app: FastAPI, backend: Backend) -> None:
    async with asgi_client(app) as http:
        sdk = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", max_retries=0, http_client=http)
        res = await sdk.images.generate(model="gpt-image-1", prompt="a lighthouse", n=2, size="256x256")
        assert len(res.data) == 2
        assert base64.b64decode(res.data[0].b64_json).startswith(PNG_MAGIC)
        assert res.usage is not None
        assert res.usage.input_tokens == PROMPT_TOKENS * 2
        assert res.usage.output_tokens == COMPLETION_TOKENS_PER_IMAGE * 2
        assert res.usage.input_tokens_details.text_tokens == PROMPT_TOKENS * 2
        assert res.usage.model_dump()["image_count"] == 2  # the SDK keeps extra fields
        with pytest.raises(openai.NotFoundError):
            await sdk.images.generate(model="nope", prompt="x")
        backend.servicer.abort = (grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")
        with pytest.raises(openai.RateLimitError):
            await sdk.images.generate(prompt="x")



# --- usage: cached tokens ------------------------------------------------------------------------


async def test_cache_report_hidden_by_default(client: httpx.AsyncClient, backend: Backend) -> None:
    backend.servicer.cached_tokens = 5
    usage = (await generate(client, {"prompt": "x"})).json()["usage"]
    assert "prompt_tokens_details" not in usage
    assert "cached" not in json.dumps(usage)


async def test_cache_report_when_enabled(backend: Backend) -> None:
    settings = RestSettings(gateway_address=backend.address, enable_cache_report=True)
    async with rest_client(settings) as c:
        usage = (await generate(c, {"prompt": "x"})).json()["usage"]
        assert "prompt_tokens_details" not in usage  # enabled, but nothing cached
        backend.servicer.cached_tokens = 5
        usage = (await generate(c, {"prompt": "x", "n": 2})).json()["usage"]
        assert usage["prompt_tokens_details"] == {"cached_tokens": 10}
