"""DenoiserService on the tiny real model, over a real gRPC server."""
from __future__ import annotations

import asyncio
import io

import grpc
import numpy as np
import pytest
from PIL import Image
from prometheus_client import REGISTRY

from glmimage.v1 import common_pb2, denoiser_service_pb2_grpc
from glmimage.v1 import denoiser_service_pb2 as pb
from runtime.details import ERROR_DOMAIN, error_info
from runtime.errors import DENOISER_BUSY
from services.denoiser.metrics import CancelReason, Outcome

PROMPT = 'A red sign that says "HELLO"'
LONG_STEPS = 200  # the server's maximum: a job that is still running whenever the test acts on it


def _row(height: int, width: int, value: int = 3) -> common_pb2.TokenRow:
    h, w = -(-height // 32) * 32, -(-width // 32) * 32
    return common_pb2.TokenRow(token_ids=[(value + i) % 128 for i in range((h // 16) * (w // 16))])


def _req(height: int, width: int, **fields) -> pb.DenoiseRequest:
    return pb.DenoiseRequest(prompt=PROMPT, prior_tokens=_row(height, width), height=height, width=width, **fields)


def _sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def _pixels(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


@pytest.fixture
async def dn(denoiser_server):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{denoiser_server.port}") as channel:
        yield denoiser_service_pb2_grpc.DenoiserServiceStub(channel)


@pytest.fixture
def servicer(denoiser_server):
    return denoiser_server.servicer


async def _until(predicate, timeout: float = 30.0) -> None:
    """Wait for a state change of the servicer (its flag flips on the event loop we share)."""
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.005)


async def _first_progress(call) -> pb.DenoiseStreamResponse:
    event = await call.read()
    assert event.WhichOneof("event") == "progress" and event.progress.step == 1
    return event


async def test_same_request_and_seed_give_identical_bytes_and_count_metrics(dn, servicer) -> None:
    ok, steps = _sample("glmimage_denoiser_jobs_total", outcome="ok"), _sample("glmimage_denoiser_step_seconds_count")
    timed = {m: _sample(f"glmimage_denoiser_{m}_seconds_count") for m in ("denoise", "decode", "encode")}
    req = _req(128, 128, seed=9)
    a, b = await dn.Denoise(req), await dn.Denoise(req)
    assert a.image == b.image and a.seed == b.seed == 9
    assert a.steps_completed == 2
    assert a.timings.denoise_seconds > 0 and a.timings.decode_seconds > 0 and a.timings.encode_seconds > 0
    other = await dn.Denoise(_req(128, 128, seed=10))
    assert other.image != a.image
    assert _sample("glmimage_denoiser_jobs_total", outcome="ok") == ok + 3
    assert _sample("glmimage_denoiser_step_seconds_count") == steps + 6
    for m, before in timed.items():
        assert _sample(f"glmimage_denoiser_{m}_seconds_count") == before + 3
    assert servicer.last_job.outcome is Outcome.OK and servicer.last_job.steps_done == 2
    assert _sample("glmimage_denoiser_busy") == 0


@pytest.mark.parametrize("fmt, pil_format", [(common_pb2.IMAGE_FORMAT_PNG, "PNG"),
                                             (common_pb2.IMAGE_FORMAT_JPEG, "JPEG"),
                                             (common_pb2.IMAGE_FORMAT_WEBP, "WEBP")])
async def test_output_formats_decode_at_the_requested_size(dn, fmt, pil_format) -> None:
    resp = await dn.Denoise(_req(128, 192, seed=1, output_format=fmt, output_compression=80))
    image = Image.open(io.BytesIO(resp.image))
    assert image.format == pil_format and image.size == (192, 128)
    assert resp.output_format == fmt and resp.timings.encode_seconds > 0


async def test_non_multiple_of_32_sizes_are_center_cropped_exactly(dn) -> None:
    # 100x150 runs at 128x160 with the same tokens and seed; the answer is its center, pixel for pixel.
    cropped = await dn.Denoise(_req(100, 150, seed=1))
    full = await dn.Denoise(_req(128, 160, seed=1))
    assert (cropped.height, cropped.width) == (100, 150)
    assert Image.open(io.BytesIO(cropped.image)).size == (150, 100)
    top, left = (128 - 100) // 2, (160 - 150) // 2
    assert np.array_equal(_pixels(cropped.image), _pixels(full.image)[top:top + 100, left:left + 150])


async def test_second_concurrent_job_is_refused_busy(dn, servicer) -> None:
    refused = _sample("glmimage_denoiser_jobs_total", outcome="rejected_busy")
    # Long enough (~0.5 s on an idle CPU) that the refused call surely lands while it runs.
    first = asyncio.ensure_future(dn.Denoise(_req(128, 128, num_inference_steps=24, seed=1)))
    await _until(lambda: servicer.busy)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await dn.Denoise(_req(64, 64, seed=2))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "busy" in err.value.details()
    assert (await first).steps_completed == 24  # the refusal did not disturb the running job
    assert _sample("glmimage_denoiser_jobs_total", outcome="rejected_busy") == refused + 1


async def test_the_occupancy_stream_and_a_busy_refusal_name_the_gateway_holding_the_slot(dn, servicer) -> None:
    watch = dn.WatchOccupancy(pb.WatchOccupancyRequest())
    free = await watch.read()
    assert not free.busy and not free.owner
    first = asyncio.ensure_future(dn.Denoise(_req(64, 64, num_inference_steps=LONG_STEPS, seed=1, owner="gw-a",
                                                 request_id="r/0#1")))
    held = await watch.read()
    assert (held.busy, held.owner, held.request_id) == (True, "gw-a", "r/0#1") and held.sequence > free.sequence
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await dn.Denoise(_req(64, 64, seed=2, owner="gw-b"))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error_info(err.value) == (DENOISER_BUSY, ERROR_DOMAIN, {"owner": "gw-a", "sequence": str(held.sequence)})
    # Its steps as they go, under the sequence the job took the slot with (the sequence orders holders, not steps).
    stepped = await watch.read()
    assert (stepped.busy, stepped.sequence, stepped.total_steps) == (True, held.sequence, LONG_STEPS)
    assert stepped.step >= 1 and held.step == 0
    first.cancel()
    after = await watch.read()
    while after.busy:  # steps finished before the cancel reached the worker
        assert after.sequence == held.sequence and after.step > stepped.step
        after = await watch.read()
    assert not after.busy and after.sequence > held.sequence and after.step == after.total_steps == 0
    watch.cancel()
    # Whoever sent them, no two jobs ever held the slot at once.
    assert _sample("glmimage_denoiser_busy_max") == 1


async def test_an_oversized_owner_never_reaches_the_occupancy_stream(dn, servicer) -> None:
    watch = dn.WatchOccupancy(pb.WatchOccupancyRequest())
    free = await watch.read()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await dn.Denoise(_req(64, 64, seed=1, owner="g" * (1 << 20)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == "owner: is 1048576 characters; the limit is 256"
    # The next state every follower reads is the next real job's, with a short owner: the refused one never held it.
    job = asyncio.ensure_future(dn.Denoise(_req(64, 64, seed=2, owner="gw-ok", request_id="r" * 256)))
    held = await watch.read()
    assert (held.busy, held.owner, held.sequence > free.sequence) == (True, "gw-ok", True)
    await job
    watch.cancel()


async def _assert_stopped_early(servicer, reason: CancelReason, min_steps: int = 1) -> None:
    """The worker stopped at the step after the cancel reached it, and the slot is free for the next job."""
    await servicer.wait_idle()
    job = servicer.last_job
    assert job.outcome is Outcome.CANCELLED and job.cancel_reason is reason
    assert min_steps <= job.steps_done < LONG_STEPS
    if job.steps_at_cancel is not None:  # None when the engine saw the deadline before gRPC cancelled the call
        assert job.steps_done <= job.steps_at_cancel + 1
    assert not servicer.busy and _sample("glmimage_denoiser_busy") == 0


async def test_cancel_mid_denoise_stops_at_the_next_step_and_frees_the_slot(dn, servicer) -> None:
    cancelled = _sample("glmimage_denoiser_cancelled_jobs_total", reason="client")
    jobs = _sample("glmimage_denoiser_jobs_total", outcome="cancelled")
    prompt_stops = _sample("glmimage_denoiser_steps_after_cancel_bucket", le="1.0")
    call = dn.Denoise(_req(256, 256, num_inference_steps=LONG_STEPS, seed=1))
    task = asyncio.ensure_future(call)
    await _until(lambda: servicer.current_job is not None and servicer.current_job.steps_done >= 1)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await _assert_stopped_early(servicer, CancelReason.CLIENT)
    assert _sample("glmimage_denoiser_cancelled_jobs_total", reason="client") == cancelled + 1
    assert _sample("glmimage_denoiser_jobs_total", outcome="cancelled") == jobs + 1
    assert _sample("glmimage_denoiser_steps_after_cancel_bucket", le="1.0") == prompt_stops + 1
    resp = await dn.Denoise(_req(64, 64, seed=2))  # the next job runs
    assert resp.steps_completed == 2


async def test_a_job_sent_right_after_a_cancel_waits_for_the_slot_instead_of_busy(dn, servicer) -> None:
    refused = _sample("glmimage_denoiser_jobs_total", outcome="rejected_busy")
    call = dn.Denoise(_req(256, 256, num_inference_steps=LONG_STEPS, seed=1))
    task = asyncio.ensure_future(call)
    await _until(lambda: servicer.current_job is not None and servicer.current_job.steps_done >= 1)
    call.cancel()  # what a gateway does when its client goes away, then it dispatches the next job at once
    resp = await dn.Denoise(_req(64, 64, seed=2))
    assert resp.steps_completed == 2
    assert _sample("glmimage_denoiser_jobs_total", outcome="rejected_busy") == refused
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_passed_deadline_stops_the_job_and_frees_the_slot(dn, servicer) -> None:
    cancelled = _sample("glmimage_denoiser_cancelled_jobs_total", reason="deadline")
    # 512x512: 200 steps take several seconds even on a quiet machine (at 256x256 they could beat the deadline).
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await dn.Denoise(_req(512, 512, num_inference_steps=LONG_STEPS, seed=1), timeout=1.5)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # No lower bound: on a loaded machine the deadline may pass during the glyph encoding, before step 1.
    await _assert_stopped_early(servicer, CancelReason.DEADLINE, min_steps=0)
    assert _sample("glmimage_denoiser_cancelled_jobs_total", reason="deadline") == cancelled + 1
    resp = await dn.Denoise(_req(64, 64, seed=2))
    assert resp.steps_completed == 2


@pytest.mark.parametrize("steps, partials, preview_at", [(8, 3, [2, 4, 6]), (2, 3, [1]), (3, 0, [])])
async def test_stream_reports_every_step_then_previews_then_the_result(dn, steps, partials, preview_at) -> None:
    # 96x80 runs at 96x96: previews are cropped like the result, and encoded in the job's format.
    job = _req(96, 80, num_inference_steps=steps, seed=4, output_format=common_pb2.IMAGE_FORMAT_JPEG)
    events = [e async for e in dn.DenoiseStream(pb.DenoiseStreamRequest(job=job, partial_images=partials))]
    kinds = [e.WhichOneof("event") for e in events]
    assert kinds[-1] == "result" and kinds.count("result") == 1
    progress = [(e.progress.step, e.progress.total_steps) for e in events if e.HasField("progress")]
    assert progress == [(s, steps) for s in range(1, steps + 1)]
    previews = [e.partial_image for e in events if e.HasField("partial_image")]
    assert [(p.partial_image_index, p.step) for p in previews] == list(enumerate(preview_at))
    for p in previews:
        # Each preview follows the progress event of its own step.
        at = next(i for i, e in enumerate(events) if e.HasField("partial_image") and e.partial_image == p)
        assert events[at - 1].progress.step == p.step
        image = Image.open(io.BytesIO(p.image))
        assert image.format == "JPEG" and image.size == (80, 96)
    result = events[-1].result
    assert result.steps_completed == steps and Image.open(io.BytesIO(result.image)).size == (80, 96)
    if previews:  # taking previews leaves the job itself untouched: same bytes as the unary call
        assert result.image == (await dn.Denoise(job)).image
        assert previews[-1].image != result.image


async def test_cancelled_stream_stops_the_job_and_shares_the_busy_slot(dn, servicer) -> None:
    refused = _sample("glmimage_denoiser_jobs_total", outcome="rejected_busy")
    job = _req(256, 256, num_inference_steps=LONG_STEPS, seed=1)
    call = dn.DenoiseStream(pb.DenoiseStreamRequest(job=job, partial_images=3))
    await _first_progress(call)
    assert servicer.busy and _sample("glmimage_denoiser_busy") == 1
    with pytest.raises(grpc.aio.AioRpcError) as err:  # one slot for both RPCs
        await dn.Denoise(_req(64, 64, seed=2))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await dn.DenoiseStream(pb.DenoiseStreamRequest(job=_req(64, 64, seed=2))).read()
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert _sample("glmimage_denoiser_jobs_total", outcome="rejected_busy") == refused + 2
    call.cancel()
    await _assert_stopped_early(servicer, CancelReason.CLIENT)
    events = [e async for e in dn.DenoiseStream(pb.DenoiseStreamRequest(job=_req(64, 64, seed=2)))]
    assert events[-1].result.steps_completed == 2


@pytest.mark.parametrize("overrides, field", [
    ({"prompt": ""}, "prompt"),
    ({"prompt": "x" * 8193}, "prompt"),
    ({"prior_tokens": common_pb2.TokenRow(token_ids=[1, 2, 3])}, "prior_tokens"),
    # 100x150 runs at 128x160: the row must be 8*10 = 80 ids, not the unrounded 6*9 = 54.
    ({"height": 100, "width": 150, "prior_tokens": common_pb2.TokenRow(token_ids=[1] * 54)}, "prior_tokens"),
    ({"prior_tokens": common_pb2.TokenRow(token_ids=[128] * 16)}, "prior_tokens"),
    ({"prior_tokens": common_pb2.TokenRow(token_ids=[-1] + [0] * 15)}, "prior_tokens"),
    ({"height": 0}, "height"),
    ({"width": 0}, "width"),
    ({"height": 4096, "width": 4096, "prior_tokens": _row(4096, 4096)}, "height"),
    ({"height": 64, "width": 2**32 - 1}, "width"),
    ({"num_inference_steps": 201}, "num_inference_steps"),
    ({"guidance_scale": 31.0}, "guidance_scale"),
    ({"guidance_scale": -0.5}, "guidance_scale"),
    ({"output_compression": 101}, "output_compression"),
    ({"output_format": 4}, "output_format"),  # proto3 enums are open: undeclared values arrive as they are
    ({"output_format": -1}, "output_format"),
    # Ids every gateway that follows the denoiser receives (WatchOccupancy), and its log lines: bounded.
    ({"owner": "g" * 1_000_000}, "owner"),
    ({"owner": "gw\nforged"}, "owner"),
    ({"request_id": "r" * 257}, "request_id"),
])
async def test_invalid_requests_name_the_field(dn, overrides, field) -> None:
    invalid = _sample("glmimage_denoiser_jobs_total", outcome="invalid")
    fields = {"prompt": PROMPT, "prior_tokens": _row(64, 64), "height": 64, "width": 64, **overrides}
    for call in (dn.Denoise(pb.DenoiseRequest(**fields)),
                 dn.DenoiseStream(pb.DenoiseStreamRequest(job=pb.DenoiseRequest(**fields))).read()):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith(f"{field}:")
    assert _sample("glmimage_denoiser_jobs_total", outcome="invalid") == invalid + 2


@pytest.mark.parametrize("partials", [4, 100])
async def test_stream_partial_images_must_be_0_to_3(dn, partials) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await dn.DenoiseStream(pb.DenoiseStreamRequest(job=_req(64, 64), partial_images=partials)).read()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("partial_images:")
