"""DenoiserService on the tiny real model, over a real gRPC server."""
from __future__ import annotations

import asyncio
import io

import grpc
import pytest
from PIL import Image

from glmimage.v1 import common_pb2, denoiser_service_pb2_grpc
from glmimage.v1 import denoiser_service_pb2 as pb

PROMPT = 'A red sign that says "HELLO"'


def _row(height: int, width: int, value: int = 3) -> common_pb2.TokenRow:
    h, w = -(-height // 32) * 32, -(-width // 32) * 32
    return common_pb2.TokenRow(token_ids=[(value + i) % 128 for i in range((h // 16) * (w // 16))])


@pytest.fixture
async def dn(denoiser_server):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{denoiser_server.port}") as channel:
        yield denoiser_service_pb2_grpc.DenoiserServiceStub(channel)


async def _until(predicate, timeout: float = 30.0) -> None:
    """Wait for a state change of the servicer (its flag flips on the event loop we share)."""
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.005)


async def test_same_request_and_seed_give_identical_bytes(dn) -> None:
    req = pb.DenoiseRequest(prompt=PROMPT, prior_tokens=_row(256, 256), height=256, width=256, seed=9)
    a, b = await dn.Denoise(req), await dn.Denoise(req)
    assert a.image == b.image and a.seed == b.seed == 9
    assert a.steps_completed == 2
    assert a.timings.denoise_seconds > 0 and a.timings.decode_seconds > 0 and a.timings.encode_seconds > 0
    other = await dn.Denoise(pb.DenoiseRequest(prompt=PROMPT, prior_tokens=_row(256, 256), height=256, width=256,
                                               seed=10))
    assert other.image != a.image


@pytest.mark.parametrize("fmt, pil_format", [(common_pb2.IMAGE_FORMAT_PNG, "PNG"),
                                             (common_pb2.IMAGE_FORMAT_JPEG, "JPEG"),
                                             (common_pb2.IMAGE_FORMAT_WEBP, "WEBP")])
async def test_output_formats_decode_at_the_requested_size(dn, fmt, pil_format) -> None:
    resp = await dn.Denoise(pb.DenoiseRequest(prompt=PROMPT, prior_tokens=_row(128, 192), height=128, width=192,
                                              seed=1, output_format=fmt, output_compression=80))
    image = Image.open(io.BytesIO(resp.image))
    assert image.format == pil_format and image.size == (192, 128)


async def test_non_multiple_of_32_sizes_are_center_cropped(dn) -> None:
    resp = await dn.Denoise(pb.DenoiseRequest(prompt=PROMPT, prior_tokens=_row(100, 150), height=100, width=150,
                                              seed=1))
    assert Image.open(io.BytesIO(resp.image)).size == (150, 100)
    assert (resp.height, resp.width) == (100, 150)


async def test_second_concurrent_job_is_refused_busy(dn, denoiser_server) -> None:
    long_job = pb.DenoiseRequest(prompt=PROMPT, prior_tokens=_row(256, 256), height=256, width=256,
                                 num_inference_steps=40, seed=1)
    first = asyncio.ensure_future(dn.Denoise(long_job))
    await _until(lambda: denoiser_server.servicer.busy)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await dn.Denoise(long_job)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "busy" in err.value.details()
    assert (await first).steps_completed == 40


async def test_cancel_stops_the_job_and_frees_the_slot(dn, denoiser_server) -> None:
    long_job = pb.DenoiseRequest(prompt=PROMPT, prior_tokens=_row(256, 256), height=256, width=256,
                                 num_inference_steps=200, seed=1)
    call = dn.Denoise(long_job)
    task = asyncio.ensure_future(call)
    await _until(lambda: denoiser_server.servicer.busy)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await _until(lambda: not denoiser_server.servicer.busy, timeout=10)
    # The slot is free again and the next job runs.
    resp = await dn.Denoise(pb.DenoiseRequest(prompt=PROMPT, prior_tokens=_row(64, 64), height=64, width=64, seed=2))
    assert resp.steps_completed == 2


@pytest.mark.parametrize("overrides, field", [
    ({"prompt": ""}, "prompt"),
    ({"prior_tokens": common_pb2.TokenRow(token_ids=[1, 2, 3])}, "prior_tokens"),
    ({"prior_tokens": common_pb2.TokenRow(token_ids=[128] * 16)}, "prior_tokens"),
    ({"height": 0}, "height"),
    ({"num_inference_steps": 201}, "num_inference_steps"),
    ({"guidance_scale": 31.0}, "guidance_scale"),
    ({"output_compression": 101}, "output_compression"),
])
async def test_invalid_requests_name_the_field(dn, overrides, field) -> None:
    fields = {"prompt": PROMPT, "prior_tokens": _row(64, 64), "height": 64, "width": 64, **overrides}
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await dn.Denoise(pb.DenoiseRequest(**fields))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(f"{field}:")
