"""GatewayService and its driver against real AR and denoiser servers (tiny model) on loopback."""
from __future__ import annotations

import asyncio
import contextlib
import io
import logging

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from PIL import Image

from gateway import downstream
from gateway.config import GatewayConfig
from gateway.driver import Driver
from gateway.scheduler.core import Scheduler
from gateway.scheduler.types import SchedulerConfig
from gateway.servicer import GatewayServicer
from glmimage.v1 import common_pb2, denoiser_service_pb2, denoiser_service_pb2_grpc, gateway_service_pb2_grpc
from glmimage.v1 import gateway_service_pb2 as pb
from runtime.limits import Limits
from runtime.server import start_server

PROMPT = 'a blue "OPEN" sign'


def _violations(err: grpc.aio.AioRpcError) -> list[tuple[str, str]]:
    """The google.rpc.BadRequest field violations in the status' rich details, as (field, description)."""
    status = rpc_status.from_call(err)
    assert status is not None, "no rich status details"
    found = []
    for detail in status.details:
        bad_request = error_details_pb2.BadRequest()
        assert detail.Unpack(bad_request), detail.type_url
        found += [(v.field, v.description) for v in bad_request.field_violations]
    return found


@contextlib.asynccontextmanager
async def running_gateway(ar_server, denoisers, scheduler: SchedulerConfig, *, lifted: Limits | None = None,
                          **config_fields):
    """``lifted``: admission applies these instead of the workers' and places jobs by no capability (a gateway that
    lets through what they refuse, and sends it to them, to test the path of a worker's own refusal)."""
    config = GatewayConfig(
        ar_addresses=(f"127.0.0.1:{ar_server.port}",),
        denoiser_addresses=tuple(f"127.0.0.1:{d.port}" for d in denoisers),
        scheduler=scheduler, request_timeout=60, **config_fields)
    driver = Driver(config) if lifted is None else Driver(config, Scheduler(config.scheduler))
    if lifted is not None:
        driver.members.limits = lambda: lifted  # type: ignore[method-assign]
        driver.members.capable = lambda needs: None  # type: ignore[method-assign]
    servicer = GatewayServicer(driver, config)
    server = await start_server(lambda s: gateway_service_pb2_grpc.add_GatewayServiceServicer_to_server(servicer, s),
                                ["glmimage.v1.GatewayService"], "127.0.0.1:0")
    await driver.start()
    await server.set_serving(True)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    stub = gateway_service_pb2_grpc.GatewayServiceStub(channel)
    # Ready when the health watchers have seen every worker SERVING.
    async with asyncio.timeout(30):
        while True:
            status = await stub.GetStatus(pb.GetStatusRequest())
            if (all(w.state == pb.WORKER_STATE_AVAILABLE for w in status.workers)
                    and len(status.workers) == 1 + len(denoisers)):
                break
            await asyncio.sleep(0.01)
    try:
        yield stub, driver
    finally:
        await channel.close()
        await server.stop(None)
        await driver.close()


@pytest.fixture
async def gateway(ar_server, denoiser_server, second_denoiser_server):
    denoisers = (denoiser_server, second_denoiser_server)
    async with running_gateway(ar_server, denoisers, SchedulerConfig(max_queued_outputs=8)) as (stub, driver):
        yield stub, driver, denoisers


async def test_n2_fans_out_and_sums_usage(gateway) -> None:
    stub, _, _ = gateway
    resp = await stub.GenerateImages(pb.GenerateImagesRequest(prompt=PROMPT, n=2, height=128, width=128, seed=4))
    assert [img.index for img in resp.images] == [0, 1]
    assert [img.seed for img in resp.images] == [4, 5]
    for img in resp.images:
        assert Image.open(io.BytesIO(img.image)).size == (128, 128)
    assert resp.usage.completion_tokens == sum(i.usage.completion_tokens for i in resp.images) > 0
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    assert (resp.height, resp.width) == (128, 128)


async def test_default_size_and_request_id_echo(gateway) -> None:
    stub, _, _ = gateway
    resp = await stub.GenerateImages(pb.GenerateImagesRequest(prompt=PROMPT, seed=1),
                                     metadata=(("x-request-id", "req-test-42"),))
    assert (resp.height, resp.width) == (256, 256) and resp.request_id == "req-test-42"


@pytest.mark.parametrize("request_, field", [
    (pb.GenerateImagesRequest(prompt=""), "prompt"),
    (pb.GenerateImagesRequest(prompt="x", n=11), "n"),
    (pb.GenerateImagesRequest(prompt="x", height=64), "width"),
    (pb.GenerateImagesRequest(prompt="x", output_compression=101), "output_compression"),
    # Sampling is the AR's, but checked here too so a bad value never reaches a shared AR batch.
    (pb.GenerateImagesRequest(prompt="x", sampling=common_pb2.SamplingParams(temperature=0.0)), "sampling.temperature"),
    (pb.GenerateImagesRequest(prompt="x", sampling=common_pb2.SamplingParams(top_p=1.5)), "sampling.top_p"),
    (pb.GenerateImagesRequest(prompt="x", sampling=common_pb2.SamplingParams(top_k=2_000_000)), "sampling.top_k"),
    # Range-checked before any arithmetic: rounded up to a multiple of 32 this no longer fits uint32, and the AR
    # batch task once died on it and held the AR slot for good.
    (pb.GenerateImagesRequest(prompt="x", height=2**32 - 1, width=2**32 - 1), "height"),
    (pb.GenerateImagesRequest(prompt="x", height=64, width=2**32 - 1), "width"),  # the larger side is at fault
    # Within the pixel budget but past the aspect bound references are held to too.
    (pb.GenerateImagesRequest(prompt="x", height=10, width=9000), "width"),
    (pb.GenerateImagesRequest(prompt="x", height=8000, width=1), "height"),
    (pb.GenerateImagesRequest(prompt="x" * 8193), "prompt"),
    (pb.GenerateImagesRequest(prompt="x", num_inference_steps=201), "num_inference_steps"),
    (pb.GenerateImagesRequest(prompt="x", guidance_scale=float("nan")), "guidance_scale"),
    (pb.GenerateImagesRequest(prompt="x", guidance_scale=-1.0), "guidance_scale"),
    (pb.GenerateImagesRequest(prompt="x", output_format=99), "output_format"),
    (pb.GenerateImagesRequest(prompt="x", n=2, seed=2**32 - 1), "seed"),  # output 1 would need seed 2**32
])
async def test_invalid_requests_name_the_field(gateway, request_, field) -> None:
    stub, driver, _ = gateway
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.GenerateImages(request_)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(f"{field}:")
    # The same field, structured: the text after it is the violation's description.
    assert _violations(err.value) == [(field, err.value.details().removeprefix(f"{field}: "))]
    assert driver.scheduler.snapshot().active_requests == 0  # refused before admission


async def test_service_errors_pass_through_with_their_status(ar_server, denoiser_server) -> None:
    # A gateway that admits more steps than its denoisers apply: the denoiser rejects 201 steps; the
    # gateway must not retry that elsewhere nor hide the reason.
    async with running_gateway(ar_server, (denoiser_server,), SchedulerConfig(),
                               lifted=Limits(max_steps=1000)) as (stub, _):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.GenerateImages(pb.GenerateImagesRequest(prompt=PROMPT, height=64, width=64,
                                                               num_inference_steps=201))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("num_inference_steps:")
    assert [f for f, _ in _violations(err.value)] == ["num_inference_steps"]  # the denoiser's field, relayed


def _no_slot_held(status: pb.GetStatusResponse) -> bool:
    return (status.active_requests == 0 and status.pending_ar_outputs == 0 and status.pending_denoise_outputs == 0
            and all(w.inflight == 0 and not w.current_job for w in status.workers))


async def test_an_exception_in_an_ar_batch_fails_only_its_culprit_and_frees_the_slot(ar_server,
                                                                                     denoiser_server) -> None:
    # The class of bug behind a wedged AR: a batch task that dies of an exception nobody expected. With the edge
    # check lifted (pixel budget far above uint32), the rounded-up size makes building the AR request raise.
    scheduler = SchedulerConfig(ar_batch_delay=0.5, ar_batch_max_outputs=8)
    async with running_gateway(ar_server, (denoiser_server,), scheduler,
                               lifted=Limits(max_pixels=2**80)) as (stub, driver):
        def call(height: int, width: int, seed: int):
            return stub.GenerateImages(pb.GenerateImagesRequest(prompt=PROMPT, height=height, width=width,
                                                                seed=seed), timeout=30)

        # Same rounded size, so the long batching window puts them into one batch.
        bad, good = await asyncio.gather(call(2**32 - 1, 2**32 - 1, 1), call(2**32 - 1, 2**32 - 1, 2),
                                         return_exceptions=True)
        for err in (bad, good):  # each is the culprit of its own solo retry: both fail, neither hangs
            assert isinstance(err, grpc.aio.AioRpcError) and err.code() == grpc.StatusCode.INTERNAL, err
            assert "Error" not in err.details() and "<class" not in err.details()
        assert driver.scheduler.counters.requeues["ar_batch_split"] == 2
        assert _no_slot_held(await stub.GetStatus(pb.GetStatusRequest()))
        # ... and the next request is served at once.
        resp = await stub.GenerateImages(pb.GenerateImagesRequest(prompt=PROMPT, height=64, width=64, seed=3),
                                         timeout=30)
        assert len(resp.images) == 1


async def test_an_exception_in_a_denoise_task_fails_its_request_and_frees_the_denoiser(
        ar_server, denoiser_server, monkeypatch: pytest.MonkeyPatch) -> None:
    async with running_gateway(ar_server, (denoiser_server,), SchedulerConfig(ar_batch_delay=0.0)) as (stub, driver):
        build = downstream.denoise_request

        def explode(action, admitted, *rest):
            if admitted.request.prompt == "boom":
                raise RuntimeError("boom")
            return build(action, admitted, *rest)

        monkeypatch.setattr(downstream, "denoise_request", explode)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.GenerateImages(pb.GenerateImagesRequest(prompt="boom", height=64, width=64), timeout=30)
        assert err.value.code() == grpc.StatusCode.INTERNAL and "boom" not in err.value.details()
        assert _no_slot_held(await stub.GetStatus(pb.GetStatusRequest()))
        resp = await stub.GenerateImages(pb.GenerateImagesRequest(prompt=PROMPT, height=64, width=64), timeout=30)
        assert len(resp.images) == 1


async def test_a_request_the_ar_refuses_does_not_fail_its_batch_mates(ar_server, denoiser_server) -> None:
    # A gateway that admits longer prompts than its AR applies: the AR (8192 characters) refuses this one
    # inside a batch it shares with two good requests (a long batching window puts all three in one batch).
    scheduler = SchedulerConfig(ar_batch_delay=0.5, ar_batch_max_outputs=8)
    async with running_gateway(ar_server, (denoiser_server,), scheduler,
                               lifted=Limits(max_prompt_chars=10_000)) as (stub, driver):
        def call(prompt: str, seed: int):
            return stub.GenerateImages(pb.GenerateImagesRequest(prompt=prompt, height=64, width=64, seed=seed))

        good, bad, good2 = await asyncio.gather(call(PROMPT, 1), call("x" * 9000, 2), call(PROMPT, 3),
                                                return_exceptions=True)
        assert isinstance(bad, grpc.aio.AioRpcError) and bad.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert bad.details().startswith("prompt:"), bad.details()
        # The AR named it requests[0].prompt in its batch; the client sent one request and reads its own name.
        assert _violations(bad) == [("prompt", bad.details().removeprefix("prompt: "))]
        assert [img.seed for img in good.images] == [1] and [img.seed for img in good2.images] == [3]
        assert driver.scheduler.counters.requeues["ar_batch_split"] == 3


async def test_a_cancelled_request_does_not_fail_the_one_queued_behind_it(ar_server, denoiser_server) -> None:
    async with running_gateway(ar_server, (denoiser_server,), SchedulerConfig()) as (stub, driver):
        slow = stub.GenerateImages(pb.GenerateImagesRequest(prompt=PROMPT, height=256, width=256, seed=1,
                                                            num_inference_steps=200))
        first = asyncio.ensure_future(slow)
        async with asyncio.timeout(30):
            while not any(w.current_job for w in driver.snapshot().workers):
                await asyncio.sleep(0.01)
        queued = asyncio.ensure_future(stub.GenerateImages(pb.GenerateImagesRequest(prompt=PROMPT, height=64,
                                                                                    width=64, seed=2)))
        async with asyncio.timeout(30):
            while driver.snapshot().pending_denoise_outputs == 0:
                await asyncio.sleep(0.01)
        slow.cancel()  # the denoiser is still finishing a step when the gateway hands it the queued job
        assert [img.seed for img in (await queued).images] == [2]
        assert driver.scheduler.counters.requeues["denoise_failed"] == 0
        with pytest.raises(asyncio.CancelledError):
            await first


async def test_an_ar_batch_nobody_waits_for_is_stopped(ar_server, denoiser_server) -> None:
    from prometheus_client import REGISTRY

    def cancelled() -> float:
        return REGISTRY.get_sample_value("glmimage_ar_failures_total", {"reason": "cancelled"}) or 0.0

    before = cancelled()
    async with running_gateway(ar_server, (denoiser_server,), SchedulerConfig()) as (stub, driver):
        # A 512x512 AR batch takes the tiny model seconds. The caller goes away once the AR runs the batch (not
        # once the gateway sent it: a call cancelled before the AR read it never reaches the model, so nothing is
        # there to stop; and not after a fixed delay: on a loaded machine the batch may not have started by then).
        call = stub.GenerateImages(pb.GenerateImagesRequest(prompt=PROMPT, height=512, width=512, seed=1))
        async with asyncio.timeout(60):
            while not REGISTRY.get_sample_value("glmimage_ar_busy"):
                await asyncio.sleep(0.01)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        async with asyncio.timeout(30):  # the AR stops the batch, and the gateway frees its slot when it has
            while cancelled() == before or any(w.inflight for w in driver.snapshot().workers):
                await asyncio.sleep(0.01)
        resp = await stub.GenerateImages(pb.GenerateImagesRequest(prompt=PROMPT, height=64, width=64, seed=2))
        assert [img.seed for img in resp.images] == [2]


async def test_clients_reusing_a_request_id_both_get_their_images(gateway) -> None:
    stub, _, _ = gateway
    meta = (("x-request-id", "same-id"),)
    a, b = await asyncio.gather(
        stub.GenerateImages(pb.GenerateImagesRequest(prompt=PROMPT, height=64, width=64, seed=1), metadata=meta),
        stub.GenerateImages(pb.GenerateImagesRequest(prompt=PROMPT, height=64, width=64, seed=2), metadata=meta))
    assert a.images[0].seed == 1 and b.images[0].seed == 2


async def test_queue_bound_refuses_with_resource_exhausted(gateway, caplog: pytest.LogCaptureFixture) -> None:
    stub, _, _ = gateway
    caplog.set_level(logging.INFO, logger="gateway.driver")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await asyncio.gather(*(stub.GenerateImages(pb.GenerateImagesRequest(prompt=PROMPT, n=5, height=64, width=64))
                               for _ in range(3)))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # The client reads what it can do; the server flag behind the refusal is in the gateway's log only.
    assert "retry later" in err.value.details() and "--" not in err.value.details()
    assert any("RESOURCE_EXHAUSTED" in r.getMessage() and "--max-queued-outputs=" in r.getMessage()
               for r in caplog.records)


async def test_client_cancel_frees_the_denoisers(gateway) -> None:
    stub, driver, denoisers = gateway
    call = stub.GenerateImages(pb.GenerateImagesRequest(prompt=PROMPT, n=2, height=256, width=256,
                                                        num_inference_steps=200, seed=3))
    task = asyncio.ensure_future(call)
    async with asyncio.timeout(30):
        while not all(d.servicer.busy for d in denoisers):
            await asyncio.sleep(0.005)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    async with asyncio.timeout(10):
        while any(d.servicer.busy for d in denoisers) or driver.snapshot().active_requests:
            await asyncio.sleep(0.005)
    status = await stub.GetStatus(pb.GetStatusRequest())
    assert status.active_requests == 0 and status.pending_denoise_outputs == 0
    assert all(w.state == pb.WORKER_STATE_AVAILABLE and not w.current_job for w in status.workers)


async def test_stream_with_the_real_denoiser(gateway) -> None:
    stub, _, (denoiser, _) = gateway
    # Until the denoiser implements DenoiseStream this cannot run; an empty job is refused cheaply once it does.
    async with grpc.aio.insecure_channel(f"127.0.0.1:{denoiser.port}") as channel:
        probe = denoiser_service_pb2_grpc.DenoiserServiceStub(channel).DenoiseStream(
            denoiser_service_pb2.DenoiseStreamRequest(job=denoiser_service_pb2.DenoiseRequest()))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await probe.read()
        if err.value.code() == grpc.StatusCode.UNIMPLEMENTED:
            pytest.skip("the denoiser does not implement DenoiseStream yet")
    call = stub.GenerateImagesStream(pb.GenerateImagesStreamRequest(
        request=pb.GenerateImagesRequest(prompt=PROMPT, n=2, height=64, width=64, seed=5, num_inference_steps=3),
        partial_images=1))
    *streamed, last = [event async for event in call]
    for index in (0, 1):
        progress = [e.progress for e in streamed if e.HasField("progress") and e.progress.image_index == index]
        assert [(p.step, p.total_steps) for p in progress] == [(1, 3), (2, 3), (3, 3)]
        previews = [e.partial_image for e in streamed
                    if e.HasField("partial_image") and e.partial_image.image_index == index]
        assert [p.partial_image_index for p in previews] == [0]
        Image.open(io.BytesIO(previews[0].image)).load()
    assert [i.seed for i in last.completed.images] == [5, 6]
    for img in last.completed.images:
        assert Image.open(io.BytesIO(img.image)).size == (64, 64)
    assert last.completed.usage.completion_tokens == sum(i.usage.completion_tokens for i in last.completed.images)
