"""--compile on the denoiser (services.denoiser.compiled) on the tiny real model, with torch.compile's "eager"
backend (dynamo traces and guards as with inductor, without generating code: seconds, not minutes, on 2 cores):
the warm-up compiles everything the configured sizes need, requests at those sizes compile nothing, and the image is
the uncompiled one."""
from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from services.denoiser.compiled import DEFAULT_SIZES, CompileSettings, parse_sizes
from services.denoiser.engine import DenoiseEngine, DenoiseJob, DenoiseSettings
from services.denoiser.step_cache import StepCacheLevel
from tests.test_denoiser_edit import SQUARE, WIDE, _edit, _target

SIZE = 64
OFF, BALANCED, AGGRESSIVE = StepCacheLevel.OFF, StepCacheLevel.BALANCED, StepCacheLevel.AGGRESSIVE


@pytest.fixture(scope="module")
def compiled(tiny_checkpoint: Path) -> DenoiseEngine:
    settings = DenoiseSettings(compile=CompileSettings(sizes=((SIZE, SIZE),), references=1, backend="eager"))
    engine = DenoiseEngine.load(tiny_checkpoint, device="cpu", settings=settings)
    assert engine.compilations.graphs == 0  # torch compiles at the first call, not at load
    engine.warm_up()
    assert engine.compilations.graphs > 0
    return engine


def _job(level: StepCacheLevel = OFF, prompt: str = 'a "compiled" sign', steps: int = 9, **fields) -> DenoiseJob:
    return DenoiseJob(prompt=prompt, token_ids=list(_target(SIZE, SIZE).token_ids), height=SIZE, width=SIZE,
                      steps=steps, seed=3, step_cache=level, **fields)


def _edit_job(references: list, level: StepCacheLevel) -> DenoiseJob:
    from services.denoiser.servicer import job_from_proto

    job = job_from_proto(_edit(SIZE, SIZE, references, num_inference_steps=7, seed=2))
    return dataclasses.replace(job, step_cache=level)


def test_requests_at_the_warmed_up_size_compile_nothing(compiled: DenoiseEngine) -> None:
    jobs = [_job(level, prompt) for level in StepCacheLevel
            for prompt in ("no glyphs", 'a "x" sign', 'say "hello there" and "a much longer glyph text"')]
    jobs += [_job(BALANCED, guidance_scale=1.0), _job(AGGRESSIVE, steps=20), _job(OFF, partial_images=2)]
    jobs += [_edit_job([spec], level) for spec in (SQUARE, WIDE) for level in StepCacheLevel]
    before = compiled.compilations.graphs
    for job in jobs:
        compiled.run(compiled.validate(job))
        assert compiled.compilations.graphs == before, job
    # Beyond the warm-up: two references, where it warmed up one, compile (and are counted), once.
    two = _edit_job([SQUARE, WIDE], OFF)
    compiled.run(compiled.validate(two))
    after = compiled.compilations.graphs
    assert after > before
    compiled.run(compiled.validate(two))
    assert compiled.compilations.graphs == after


@pytest.mark.parametrize("level", [OFF, AGGRESSIVE, BALANCED])
def test_the_compiled_image_is_the_uncompiled_one(compiled: DenoiseEngine, denoise_engine, level) -> None:
    """The eager backend runs the traced graphs through the same ATen kernels in the same order: equal bytes. (With
    inductor, fused kernels change float rounding: close images, not equal bytes.)"""
    job = _job(level)
    image = compiled.run(compiled.validate(job)).image
    assert image == denoise_engine.run(denoise_engine.validate(job)).image
    assert compiled.run(compiled.validate(job)).image == image  # a cached job is reproducible compiled too
    edit = _edit_job([WIDE], level)
    assert compiled.run(compiled.validate(edit)).image == denoise_engine.run(denoise_engine.validate(edit)).image


def test_the_servicer_exports_the_compilations_and_says_its_compiled_sizes(compiled: DenoiseEngine) -> None:
    from glmimage.v1 import denoiser_service_pb2
    from runtime.executor import SerialExecutor
    from services.denoiser.servicer import DenoiserServicer

    def exported() -> float:
        return REGISTRY.get_sample_value("glmimage_denoiser_compilations_total") or 0.0

    start = exported()
    executor = SerialExecutor("test-compile")
    try:
        servicer = DenoiserServicer(compiled, executor)
        assert exported() - start == compiled.compilations.graphs
        said = asyncio.run(servicer.GetLimits(denoiser_service_pb2.DenoiserServiceGetLimitsRequest(), None))
        assert said.device == "cpu" and [(s.width, s.height) for s in said.compiled_sizes] == [(SIZE, SIZE)]
        compiled.compilations.backend("eager")(*_tiny_graph())  # what torch does at a compilation
        assert exported() - start == compiled.compilations.graphs
    finally:
        executor.shutdown()
        compiled.compilations.on_compile = None


def _tiny_graph() -> tuple:
    import torch

    return torch.fx.symbolic_trace(torch.nn.ReLU()), [torch.zeros(1)]


def test_the_flags_parse_and_a_bad_size_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    from services.denoiser.__main__ import parse_args

    default = parse_args([])
    assert not default.compile and default.compile_sizes == DEFAULT_SIZES == ((64, 64), (256, 256))
    args = parse_args(["--compile", "--compile-sizes", "512x256, 64x64", "--compile-backend", "aot_eager"])
    assert args.compile and args.compile_sizes == ((256, 512), (64, 64)) and args.compile_backend == "aot_eager"
    assert parse_sizes("64X64,64x64") == ((64, 64),)
    for bad, says in (("256", "size must be WIDTHxHEIGHT"), ("256x", "size must be WIDTHxHEIGHT"),
                      ("0x64", "positive width and height"), ("", "at least one size"),
                      ("8192x8192", "exceeds the limit"), ("64x1024", "elongated")):
        with pytest.raises(SystemExit) as exc:
            parse_args(["--compile", "--compile-sizes", bad])
        assert exc.value.code == 2
        assert says in capsys.readouterr().err, bad
    with pytest.raises(SystemExit):
        parse_args(["--compile-references", "-1"])
