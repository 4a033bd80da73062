"""Step caching in the denoiser (services.denoiser.step_cache) on the tiny real model: it caches steps on random
weights, counts them, and leaves nothing behind for the next job, whatever that job is and however the cached one
ended (edits, previews, a cancel within a step, an invalid level)."""
from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest
from prometheus_client import REGISTRY

from glmimage.v1 import common_pb2, denoiser_service_pb2_grpc
from glmimage.v1 import denoiser_service_pb2 as pb
from runtime.errors import Cancelled, InvalidArgument
from services.denoiser.engine import DenoiseJob, JobControl, PartialPreview
from services.denoiser.step_cache import DEFAULT_SCHEDULES, Schedule, StepCacheLevel, supported
from tests.test_denoiser_edit import SQUARE, WIDE, _edit, _target

STEPS = 16
OFF, BALANCED, AGGRESSIVE = StepCacheLevel.OFF, StepCacheLevel.BALANCED, StepCacheLevel.AGGRESSIVE


def _job(level: StepCacheLevel, steps: int = STEPS, size: int = 64, **fields) -> DenoiseJob:
    tokens = list(_target(size, size).token_ids)
    return DenoiseJob(prompt='a "cached" sign', token_ids=tokens, height=size, width=size, steps=steps, seed=5,
                      step_cache=level, **fields)


def _hooks(engine) -> int:
    """diffusers hooks left on the transformer's modules (a cache switched off leaves none)."""
    return sum(len(m._diffusers_hook.hooks) for m in engine.pipe.transformer.modules()
               if hasattr(m, "_diffusers_hook"))


def _steps(kind: str) -> float:
    return REGISTRY.get_sample_value("glmimage_denoiser_steps_total", {"kind": kind}) or 0.0


# ---- the schedule ----------------------------------------------------------------------------------------------


def test_schedule_flags_parse_and_refuse_what_cannot_run() -> None:
    assert Schedule.parse("interval=3,warmup=2") == Schedule(interval=3, warmup=2, order=1, lite=False)
    assert Schedule.parse(" interval=4 , warmup=2, order=2, lite=1 ") == Schedule(4, 2, 2, True)
    for level, schedule in DEFAULT_SCHEDULES.items():
        assert Schedule.parse(schedule.spec()) == schedule, level
    for bad in ("interval=1,warmup=3", "interval=2", "warmup=2", "interval=2,warmup=0", "interval=x,warmup=2",
                "interval=2,warmup=2,order=9", "interval=2,warmup=2,speed=3", "interval"):
        with pytest.raises(ValueError):
            Schedule.parse(bad)


def test_a_reply_says_when_no_step_could_be_cached() -> None:
    balanced = DEFAULT_SCHEDULES[BALANCED]
    for steps in range(1, balanced.warmup + 1):  # the tiny model's default 2 steps are inside the warm-up
        note = balanced.uncached_note(BALANCED, steps)
        assert note and f"first {balanced.warmup} steps" in note and f"ran {steps}" in note
    assert balanced.cached_steps(balanced.warmup + 1) == 1 and not balanced.uncached_note(BALANCED, balanced.warmup + 1)


def test_the_engine_and_the_gateway_pass_the_note_on(denoise_engine) -> None:
    from gateway.servicer import response_of
    from rest.translate import image_json

    short = denoise_engine.run(denoise_engine.validate(_job(BALANCED, steps=2)))
    assert short.steps_cached == 0 and "no step was cached" in short.step_cache_note
    assert not denoise_engine.run(denoise_engine.validate(_job(OFF, steps=2))).step_cache_note  # nothing asked
    long = denoise_engine.run(denoise_engine.validate(_job(BALANCED)))
    assert long.steps_cached and not long.step_cache_note
    # Through the gateway's reply and the REST front's data[i].
    from gateway.driver import Outcome
    from glmimage.v1 import ar_service_pb2, gateway_service_pb2
    from runtime.admission import Admitted
    from services.denoiser.servicer import result_to_proto

    admitted = Admitted(gateway_service_pb2.GenerateImagesRequest(prompt="p"), n=1, height=64, width=64)
    resp = response_of(Outcome([result_to_proto(short)], [ar_service_pb2.PriorOutput(seed=5)]), admitted, "req-1")
    assert resp.images[0].steps_cached == 0 and resp.images[0].step_cache_note == short.step_cache_note
    assert image_json(resp.images[0])["step_cache_note"] == short.step_cache_note


def test_the_denoiser_flags_take_a_schedule_per_level() -> None:
    from services.denoiser.__main__ import parse_args

    args = parse_args(["--step-cache-balanced", "interval=3,warmup=4"])
    assert args.step_cache_balanced == Schedule(3, 4) and args.step_cache_aggressive == DEFAULT_SCHEDULES[AGGRESSIVE]
    with pytest.raises(SystemExit):
        parse_args(["--step-cache-aggressive", "interval=1,warmup=1"])


# ---- the engine --------------------------------------------------------------------------------------------------


def test_the_tiny_model_can_cache(denoise_engine) -> None:
    assert supported(denoise_engine.pipe.transformer)
    assert denoise_engine.limits.step_cache


@pytest.mark.parametrize("level", [BALANCED, AGGRESSIVE])
def test_a_cached_job_caches_the_steps_its_schedule_says_and_leaves_nothing_behind(denoise_engine, level) -> None:
    eng = denoise_engine
    off = eng.run(eng.validate(_job(OFF)))
    cached = eng.run(eng.validate(_job(level)))
    again = eng.run(eng.validate(_job(level)))
    off_after = eng.run(eng.validate(_job(OFF)))
    schedule = DEFAULT_SCHEDULES[level]
    assert cached.steps_cached == schedule.cached_steps(STEPS) > 0
    assert cached.steps_completed == STEPS and off.steps_cached == 0
    assert again.image == cached.image  # a cached job is reproducible by seed: no state carried over
    assert off_after.image == off.image  # and an uncached job after it gives the uncached image exactly
    assert cached.image != off.image
    assert _hooks(eng) == 0 and not eng.pipe.transformer.is_cache_enabled


def test_the_aggressive_level_caches_more_than_the_balanced_one(denoise_engine) -> None:
    counts = [denoise_engine.run(denoise_engine.validate(_job(level))).steps_cached
              for level in (OFF, BALANCED, AGGRESSIVE)]
    assert counts[0] == 0 < counts[1] < counts[2] < STEPS


def test_without_guidance_there_is_one_call_per_step_and_the_count_holds(denoise_engine) -> None:
    job = _job(BALANCED, guidance_scale=1.0)  # no uncond call: one context only
    result = denoise_engine.run(denoise_engine.validate(job))
    assert result.steps_cached == DEFAULT_SCHEDULES[BALANCED].cached_steps(STEPS)


def test_an_edit_with_the_cache_on_never_extrapolates_a_reference_pass(denoise_engine) -> None:
    """The references are written into the DiT's KV cache before the loop; the step cache starts at the first
    step, so every reference pass is computed, and the next edit is not affected."""
    from services.denoiser.servicer import job_from_proto

    eng = denoise_engine
    edit = job_from_proto(_edit(64, 96, [SQUARE, WIDE], num_inference_steps=STEPS, seed=2))
    plain = eng.run(eng.validate(edit))
    cached = eng.run(eng.validate(dataclasses.replace(edit, step_cache=AGGRESSIVE)))
    assert cached.steps_cached == DEFAULT_SCHEDULES[AGGRESSIVE].cached_steps(STEPS)
    assert cached.image != plain.image
    assert eng.run(eng.validate(edit)).image == plain.image
    # The cached edit runs as closely as the cached text-to-image job does: a fidelity, not an equality.
    assert cached.prepare_seconds > 0


def test_previews_of_a_cached_job_come_at_their_steps(denoise_engine) -> None:
    previews: list[PartialPreview] = []
    control = JobControl(on_event=lambda e: previews.append(e) if isinstance(e, PartialPreview) else None)
    result = denoise_engine.run(denoise_engine.validate(_job(BALANCED, partial_images=3)), control)
    assert [p.step for p in previews] == [4, 8, 12] and result.steps_cached > 0


def test_a_cached_job_cancelled_within_a_step_leaves_a_clean_transformer(denoise_engine) -> None:
    eng = denoise_engine
    control = JobControl()
    calls = [0]

    def cancel_on_the_fifth_call(module, args, kwargs) -> None:
        calls[0] += 1
        if calls[0] == 5:  # inside step 3 (cond and uncond per step): on a cached step of the schedule
            control.cancel.set()

    hook = eng.pipe.transformer.register_forward_pre_hook(cancel_on_the_fifth_call, with_kwargs=True)
    try:
        with pytest.raises(Cancelled):
            eng.run(eng.validate(_job(AGGRESSIVE)), control)
    finally:
        hook.remove()
    assert control.steps_done == 3  # the step in flight finished; none after it
    assert _hooks(eng) == 0
    off = eng.run(eng.validate(_job(OFF)))
    assert eng.run(eng.validate(_job(OFF))).image == off.image


def test_a_denoiser_that_cannot_cache_refuses_the_cached_levels(denoise_engine) -> None:
    eng = denoise_engine
    cannot = type(eng)(eng.pipe, eng.device, eng.settings)
    cannot.limits = dataclasses.replace(eng.limits, step_cache=False)
    with pytest.raises(InvalidArgument, match="^step_cache: this denoiser cannot cache steps"):
        cannot.validate(_job(BALANCED))
    assert cannot.validate(_job(OFF)).step_cache is OFF


# ---- over gRPC ---------------------------------------------------------------------------------------------------


@pytest.fixture
async def dn(denoiser_server):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{denoiser_server.port}") as channel:
        yield denoiser_service_pb2_grpc.DenoiserServiceStub(channel)


def _request(level: int, steps: int = STEPS) -> pb.DenoiseRequest:
    return pb.DenoiseRequest(prompt='a "cached" sign', prior_tokens=_target(64, 64), height=64, width=64,
                             num_inference_steps=steps, seed=9, step_cache=level)


async def test_the_denoiser_counts_full_and_cached_steps_and_says_so(dn) -> None:
    full, cached = _steps("full"), _steps("cached")
    off = await dn.Denoise(_request(common_pb2.STEP_CACHE_OFF))
    unspecified = await dn.Denoise(_request(common_pb2.STEP_CACHE_UNSPECIFIED))
    reply = await dn.Denoise(_request(common_pb2.STEP_CACHE_AGGRESSIVE))
    assert unspecified.image == off.image and off.steps_cached == 0
    want = DEFAULT_SCHEDULES[AGGRESSIVE].cached_steps(STEPS)
    assert reply.steps_cached == want and reply.steps_completed == STEPS
    assert _steps("cached") - cached == want
    assert _steps("full") - full == 3 * STEPS - want
    limits = (await dn.GetLimits(pb.DenoiserServiceGetLimitsRequest())).limits
    assert limits.HasField("step_cache") and limits.step_cache


async def test_an_unknown_level_is_invalid_argument_on_step_cache(dn) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await dn.Denoise(_request(99))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("step_cache: unknown level 99")


async def test_a_cached_job_holds_the_busy_slot_and_a_cancel_frees_it_clean(dn, denoiser_server) -> None:
    servicer = denoiser_server.servicer
    off = await dn.Denoise(_request(common_pb2.STEP_CACHE_OFF))
    call = dn.DenoiseStream(pb.DenoiseStreamRequest(job=_request(common_pb2.STEP_CACHE_AGGRESSIVE, steps=200)))
    async for _ in call:  # the first progress event: the cached job is running
        break
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await dn.Denoise(_request(common_pb2.STEP_CACHE_OFF))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    call.cancel()
    async with asyncio.timeout(60):  # the worker thread stops at its next step, then frees the slot
        while servicer.busy:
            await asyncio.sleep(0.01)
    assert (await dn.Denoise(_request(common_pb2.STEP_CACHE_OFF))).image == off.image
