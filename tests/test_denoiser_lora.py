"""LoRA adapters in the denoiser (services.denoiser.adapters) on the tiny real model and its demo adapter tiny-style:
an adapter changes the image and nothing of it outlives its job, the base image comes back byte for byte (no
adapters, or scale 0), several run at once, edits take them, the LRU loads and evicts as counted, and every bad
file or name is refused with the field named while the denoiser keeps serving."""
from __future__ import annotations

import dataclasses
import json
import shutil
import struct
from pathlib import Path

import grpc
import pytest
import torch
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from prometheus_client import REGISTRY
from safetensors.torch import load_file, save_file

from glmimage.v1 import common_pb2, denoiser_service_pb2_grpc
from glmimage.v1 import denoiser_service_pb2 as pb
from runtime.errors import InvalidArgument
from runtime.executor import SerialExecutor
from runtime.limits import Limits, advertised
from services.denoiser.adapters import AdapterDirectory, AdapterError, LoraRef, read_adapter
from services.denoiser.engine import DenoiseEngine, DenoiseJob, DenoiseSettings
from services.model.tiny import TINY_LORA, tiny_lora_dir
from tests.support.servers import serve_denoiser
from tests.test_denoiser_edit import SQUARE, _edit, _target

STYLE, INK, THIRD = TINY_LORA, "tiny-ink", "tiny-third"


def _random_adapter(path: Path, seed: int, *, prefixed: bool = False, metadata: dict | None = None) -> None:
    """An adapter of tiny-style's shapes with other random weights; ``prefixed``: diffusers' pipeline layout."""
    shapes = load_file(str(_STYLE_FILE[0]))
    g = torch.Generator().manual_seed(seed)
    tensors = {("transformer." if prefixed else "") + k: torch.randn(v.shape, generator=g) * 0.5
               for k, v in shapes.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=metadata)


_STYLE_FILE: list[Path] = []


@pytest.fixture(scope="module")
def lora_dir(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-style as built with the checkpoint, tiny-ink in a folder in the pipeline layout with lora_alpha 8 (twice
    its rank), tiny-third a plain file."""
    root = tmp_path_factory.mktemp("loras")
    for name in (f"{STYLE}.safetensors", f"{STYLE}.json"):
        shutil.copy(tiny_lora_dir(tiny_checkpoint) / name, root / name)
    _STYLE_FILE[:] = [root / f"{STYLE}.safetensors"]
    _random_adapter(root / INK / "pytorch_lora_weights.safetensors", 2, prefixed=True,
                    metadata={"lora_adapter_metadata": json.dumps({"r": 4, "lora_alpha": 8})})
    _random_adapter(root / f"{THIRD}.safetensors", 3)
    return root


def _engine(tiny_checkpoint: Path, lora_dir: Path, capacity: int = 2) -> DenoiseEngine:
    return DenoiseEngine.load(tiny_checkpoint, device="cpu",
                              settings=DenoiseSettings(lora_dir=lora_dir, max_loaded_loras=capacity))


@pytest.fixture(scope="module")
def lora_engine(tiny_checkpoint: Path, lora_dir: Path) -> DenoiseEngine:
    return _engine(tiny_checkpoint, lora_dir)


def _job(*loras: LoraRef, **fields) -> DenoiseJob:
    tokens = list(_target(64, 64).token_ids)
    return DenoiseJob(prompt='a "lora" sign', token_ids=tokens, height=64, width=64, seed=7, loras=loras, **fields)


def _image(engine: DenoiseEngine, job: DenoiseJob) -> bytes:
    return engine.run(engine.validate(job)).image


@pytest.fixture(scope="module")
def base_image(denoise_engine) -> bytes:
    """From the session's engine, which never had a LoRA layer: the base model's image."""
    return _image(denoise_engine, _job())


def _sample(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


# ---- the image ---------------------------------------------------------------------------------------------------


def test_the_tiny_checkpoint_comes_with_its_demo_adapter(tiny_checkpoint: Path) -> None:
    directory = AdapterDirectory(tiny_lora_dir(tiny_checkpoint))
    assert directory.names() == [STYLE]
    info = directory.find(STYLE)
    assert info is not None and info.default_scale == 1.0 and info.description


def test_an_adapter_changes_the_image_and_nothing_of_it_outlives_its_job(lora_engine, base_image) -> None:
    eng = lora_engine
    styled = _image(eng, _job(LoraRef(STYLE)))
    assert styled != base_image
    assert _image(eng, _job(LoraRef(STYLE, 1.0))) == styled  # reproducible by seed; the sidecar's scale is 1
    assert _image(eng, _job()) == base_image  # the next plain job: the base model, byte for byte
    assert _image(eng, _job(LoraRef(STYLE, 0.0))) == base_image  # scale 0 is the base model too
    half = _image(eng, _job(LoraRef(STYLE, 0.5)))
    assert half not in (styled, base_image)
    assert STYLE in eng.adapters.loaded()


def test_two_adapters_at_once_differ_from_each_alone(lora_engine, base_image) -> None:
    eng = lora_engine
    style, ink = _image(eng, _job(LoraRef(STYLE))), _image(eng, _job(LoraRef(INK)))
    both = _image(eng, _job(LoraRef(STYLE), LoraRef(INK, 0.7)))
    assert len({style, ink, both, base_image}) == 4
    assert _image(eng, _job(LoraRef(STYLE), LoraRef(INK, 0.7))) == both
    assert _image(eng, _job(LoraRef(STYLE), LoraRef(INK, 0.0))) == style  # a zero scale leaves it out
    assert _image(eng, _job()) == base_image


def test_the_file_lora_alpha_is_honoured(lora_engine, lora_dir: Path) -> None:
    """tiny-ink says lora_alpha 8 at rank 4: its update is twice its matrices' product, as peft would run it."""
    targets = lora_engine.adapters.targets
    state, rank = read_adapter(lora_dir / INK / "pytorch_lora_weights.safetensors", targets, Limits())
    raw = load_file(str(lora_dir / INK / "pytorch_lora_weights.safetensors"))
    key = "transformer_blocks.0.attn1.to_q.lora_B.weight"
    assert rank == 4 and torch.equal(state[key], raw[f"transformer.{key}"] * 2)


def test_an_edit_runs_with_an_adapter(lora_engine, denoise_engine) -> None:
    from services.denoiser.servicer import job_from_proto

    edit = job_from_proto(_edit(64, 64, [SQUARE], num_inference_steps=2, seed=3))
    plain = _image(denoise_engine, edit)
    styled = _image(lora_engine, dataclasses.replace(edit, loras=[LoraRef(STYLE)]))
    assert styled != plain
    assert _image(lora_engine, edit) == plain


def test_a_cached_job_with_an_adapter_leaves_the_next_cached_job_the_base_one(lora_engine, denoise_engine) -> None:
    from services.denoiser.step_cache import StepCacheLevel

    cached = _job(steps=8, step_cache=StepCacheLevel.BALANCED)
    base = _image(denoise_engine, cached)
    styled = lora_engine.run(lora_engine.validate(dataclasses.replace(cached, loras=[LoraRef(STYLE)])))
    assert styled.steps_cached > 0 and styled.image != base
    assert _image(lora_engine, cached) == base


def test_the_lru_loads_on_a_miss_and_evicts_the_least_recently_used(tiny_checkpoint, lora_dir, base_image) -> None:
    eng = _engine(tiny_checkpoint, lora_dir, capacity=2)
    names = ("loads", "hits", "misses", "evictions")
    before = {n: _sample(f"glmimage_denoiser_lora_{n}_total") for n in names}
    first_ink = None
    for name in (STYLE, INK, STYLE, THIRD, INK):  # THIRD evicts INK; INK then evicts STYLE
        image = _image(eng, _job(LoraRef(name)))
        if name == INK:
            assert first_ink is None or image == first_ink  # reloaded, the same adapter
            first_ink = image
    delta = {n: _sample(f"glmimage_denoiser_lora_{n}_total") - before[n] for n in names}
    assert delta == {"loads": 4, "hits": 1, "misses": 4, "evictions": 2}
    assert eng.adapters.loaded() == (THIRD, INK)
    assert _sample("glmimage_denoiser_loras_loaded") == 2
    assert len(eng.pipe.transformer.peft_config) == 2  # evicted adapters' layers are gone
    assert _image(eng, _job()) == base_image


def test_a_replaced_file_is_loaded_again(tiny_checkpoint, lora_dir, tmp_path) -> None:
    for name in (f"{STYLE}.safetensors", f"{STYLE}.json"):
        shutil.copy(lora_dir / name, tmp_path / name)
    eng = _engine(tiny_checkpoint, tmp_path)
    first = _image(eng, _job(LoraRef(STYLE)))
    _random_adapter(tmp_path / f"{STYLE}.safetensors", 11)
    assert _image(eng, _job(LoraRef(STYLE))) != first
    assert eng.adapters.loaded() == (STYLE,) and len(eng.pipe.transformer.peft_config) == 1


# ---- refusals ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "field"), [
    ("../tiny-style", "loras[0].name"), ("a/b", "loras[0].name"), ("tiny\x00style", "loras[0].name"),
    ("..", "loras[0].name"), ("", "loras[0].name"), ("x" * 129, "loras[0].name"), (".hidden", "loras[0].name"),
    ("missing", "loras[0].name"),
])
def test_a_bad_or_unknown_name_is_refused_before_any_work(lora_engine, name: str, field: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        lora_engine.validate(_job(LoraRef(name)))
    assert err.value.field == field


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), 4.01, -5.0])
def test_a_scale_out_of_range_is_refused(lora_engine, scale: float) -> None:
    with pytest.raises(InvalidArgument) as err:
        lora_engine.validate(_job(LoraRef(STYLE, scale)))
    assert err.value.field == "loras[0].scale"


def test_too_many_or_repeated_adapters_are_refused(lora_engine, denoise_engine) -> None:
    with pytest.raises(InvalidArgument, match="^loras: 3 adapters; a request takes at most 2"):
        lora_engine.validate(_job(LoraRef(STYLE), LoraRef(INK), LoraRef(THIRD)))
    with pytest.raises(InvalidArgument, match=r"^loras\[1\].name: 'tiny-style' is already loras\[0\]"):
        lora_engine.validate(_job(LoraRef(STYLE), LoraRef(STYLE, 0.5)))
    with pytest.raises(InvalidArgument, match="^loras: this denoiser serves no LoRA adapters"):
        denoise_engine.validate(_job(LoraRef(STYLE)))


def _truncated(path: Path) -> None:
    _random_adapter(path, 5)
    path.write_bytes(path.read_bytes()[:-100])


def _wrong_keys(path: Path) -> None:
    save_file({"transformer_blocks.9.attn1.to_q.lora_A.weight": torch.zeros(4, 16),
               "transformer_blocks.9.attn1.to_q.lora_B.weight": torch.zeros(16, 4)}, str(path))


def _wrong_shapes(path: Path) -> None:
    save_file({"transformer_blocks.0.attn1.to_q.lora_A.weight": torch.zeros(4, 15),
               "transformer_blocks.0.attn1.to_q.lora_B.weight": torch.zeros(16, 4)}, str(path))


def _huge_rank(path: Path) -> None:
    save_file({"transformer_blocks.0.attn1.to_q.lora_A.weight": torch.zeros(300, 16),
               "transformer_blocks.0.attn1.to_q.lora_B.weight": torch.zeros(16, 300)}, str(path))


def _not_lora(path: Path) -> None:
    save_file({"transformer_blocks.0.attn1.to_q.weight": torch.zeros(16, 16)}, str(path))


def _half_lora(path: Path) -> None:
    save_file({"transformer_blocks.0.attn1.to_q.lora_A.weight": torch.zeros(4, 16)}, str(path))


def _header_past_the_end(path: Path) -> None:
    path.write_bytes(struct.pack("<Q", 10_000) + b"{}")


@pytest.mark.parametrize(("make", "why"), [
    (_truncated, "is truncated"),
    (lambda p: p.write_text("not a safetensors file at all"), "is truncated or not a safetensors file"),
    (lambda p: p.write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00nope!"), "its header is not JSON"),
    (_header_past_the_end, "its header runs past the end"),
    (_wrong_keys, "names 'transformer_blocks.9.attn1.to_q', which is not a linear layer of this DiT"),
    (_wrong_shapes, "this DiT needs [r, 16] and [16, r]"),
    (_huge_rank, "has rank 300 at transformer_blocks.0.attn1.to_q; the limit is 256"),
    (_not_lora, "expected only <module>.lora_A.weight"),
    (_half_lora, "a LoRA needs lora_A and lora_B"),
], ids=["truncated", "text", "header-not-json", "header-too-long", "wrong-keys", "wrong-shapes", "huge-rank",
        "not-lora", "half-lora"])
def test_a_bad_file_is_refused_and_the_denoiser_keeps_serving(lora_engine, lora_dir, base_image, make,
                                                             why: str) -> None:
    eng = lora_engine
    make(lora_dir / "bad.safetensors")
    adapters_before = set(eng.pipe.transformer.peft_config)
    try:
        job = eng.validate(_job(LoraRef("bad")))  # the name exists: the file is checked when it is loaded
        with pytest.raises(InvalidArgument) as err:
            eng.run(job)
    finally:
        (lora_dir / "bad.safetensors").unlink()
    assert err.value.field == "loras[0]" and why in err.value.description, err.value
    assert "bad" not in eng.adapters.loaded() and set(eng.pipe.transformer.peft_config) == adapters_before
    assert _image(eng, _job()) == base_image
    assert _image(eng, _job(LoraRef(STYLE))) != base_image


def test_a_file_over_the_byte_limit_is_refused_before_it_is_read(lora_engine, lora_dir) -> None:
    with pytest.raises(AdapterError, match="bytes; the limit is 1000"):
        read_adapter(lora_dir / f"{STYLE}.safetensors", lora_engine.adapters.targets, Limits(max_lora_bytes=1000))


def test_a_sidecar_sets_the_default_scale_and_a_bad_one_is_refused(lora_engine, lora_dir, base_image) -> None:
    shutil.copy(lora_dir / f"{STYLE}.safetensors", lora_dir / "muted.safetensors")
    (lora_dir / "muted.json").write_text('{"scale": 0, "description": "off unless asked"}')
    try:
        assert lora_engine.validate(_job(LoraRef("muted"))).loras == (LoraRef("muted", 0.0),)
        assert _image(lora_engine, _job(LoraRef("muted"))) == base_image
        assert _image(lora_engine, _job(LoraRef("muted", 1.0))) == _image(lora_engine, _job(LoraRef(STYLE)))
        for bad in ('{"scale": "loud"}', '{"scale": 9}', "[1]", "{"):
            (lora_dir / "muted.json").write_text(bad)
            with pytest.raises(InvalidArgument, match=r"^loras\[0\]: adapter 'muted' has a sidecar muted.json"):
                lora_engine.validate(_job(LoraRef("muted")))
    finally:
        (lora_dir / "muted.safetensors").unlink()
        (lora_dir / "muted.json").unlink()


def test_the_flags() -> None:
    from services.denoiser.__main__ import parse_args

    args = parse_args(["--lora-dir", "/", "--max-loaded-loras", "3", "--max-loras-per-request", "0"])
    assert args.lora_dir == Path("/") and args.max_loaded_loras == 3 and args.limits.max_loras_per_request == 0
    for bad in (["--lora-dir", "/no/such/dir"], ["--max-loaded-loras", "0"], ["--max-lora-rank", "0"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


# ---- over gRPC ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
async def lora_server(lora_engine):
    server = await serve_denoiser(lora_engine, SerialExecutor("test-denoiser-lora"))
    yield server
    await server.stop(None)


@pytest.fixture
async def dn(lora_server):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{lora_server.port}") as channel:
        yield denoiser_service_pb2_grpc.DenoiserServiceStub(channel)


def _request(*loras: common_pb2.LoraRef) -> pb.DenoiseRequest:
    return pb.DenoiseRequest(prompt='a "lora" sign', prior_tokens=_target(64, 64), height=64, width=64, seed=7,
                             num_inference_steps=2, loras=loras)


def _violations(err: grpc.aio.AioRpcError) -> list[str]:
    fields = []
    for detail in rpc_status.from_call(err).details:
        bad = error_details_pb2.BadRequest()
        assert detail.Unpack(bad)
        fields += [v.field for v in bad.field_violations]
    return fields


async def test_grpc_runs_adapters_and_refuses_with_the_field_named(dn, lora_dir, base_image) -> None:
    unset = await dn.Denoise(_request(common_pb2.LoraRef(name=STYLE)))  # unset scale: the sidecar's 1
    assert unset.image == (await dn.Denoise(_request(common_pb2.LoraRef(name=STYLE, scale=1.0)))).image
    assert (await dn.Denoise(_request(common_pb2.LoraRef(name=STYLE, scale=0.0)))).image == base_image
    for ref, field in ((common_pb2.LoraRef(name="../x"), "loras[0].name"),
                       (common_pb2.LoraRef(name=STYLE, scale=float("nan")), "loras[0].scale")):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await dn.Denoise(_request(ref))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and _violations(err.value) == [field]
    _wrong_keys(lora_dir / "bad.safetensors")
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await dn.Denoise(_request(common_pb2.LoraRef(name="bad")))
    finally:
        (lora_dir / "bad.safetensors").unlink()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and _violations(err.value) == ["loras[0]"]
    assert (await dn.Denoise(_request())).image == base_image  # still serving, the base model


async def test_get_limits_advertises_the_adapter_bounds(dn, denoiser_server) -> None:
    limits = advertised((await dn.GetLimits(pb.DenoiserServiceGetLimitsRequest())).limits)
    assert (limits["max_loras_per_request"], limits["max_lora_rank"], limits["max_lora_bytes"]) == (
        2, Limits.max_lora_rank, Limits.max_lora_bytes)  # clamped to --max-loaded-loras 2
    async with grpc.aio.insecure_channel(f"127.0.0.1:{denoiser_server.port}") as channel:
        plain = denoiser_service_pb2_grpc.DenoiserServiceStub(channel)
        assert (await plain.GetLimits(pb.DenoiserServiceGetLimitsRequest())).limits.max_loras_per_request == 0
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await plain.Denoise(_request(common_pb2.LoraRef(name=STYLE)))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and _violations(err.value) == ["loras"]


async def test_watch_occupancy_lists_the_loaded_adapters(dn, lora_engine) -> None:
    await dn.Denoise(_request(common_pb2.LoraRef(name=INK, scale=0.5), common_pb2.LoraRef(name=STYLE)))
    call = dn.WatchOccupancy(pb.WatchOccupancyRequest())
    state = await call.read()
    call.cancel()
    assert not state.busy and tuple(state.loras_loaded) == lora_engine.adapters.loaded() == (INK, STYLE)
