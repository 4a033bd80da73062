"""DenoiserService.ListLoras / LoadLoras / UnloadLoras and DenoiseTimings.lora_load_seconds, over a real gRPC server on
the tiny model: the listing is read afresh at each call, a preload is counted as a job's load and makes the job a
hit, admin calls hold the slot like a job (waiting for the job in flight), every bad name or file is refused naming
names[i] with nothing half-loaded, and the denoiser keeps serving the base model byte for byte."""
from __future__ import annotations

import asyncio
import json
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import load_file, save_file

from glmimage.v1 import common_pb2, denoiser_service_pb2_grpc
from glmimage.v1 import denoiser_service_pb2 as pb
from runtime.auth import bearer_metadata, internal_token_interceptor
from runtime.details import error_info
from runtime.errors import DENOISER_BUSY
from runtime.server import start_server
from services.denoiser.engine import DenoiseEngine, DenoiseSettings
from services.denoiser.servicer import LOADING_LORAS, UNLOADING_LORAS
from services.model.tiny import TINY_LORA, tiny_lora_dir
from tests.support.servers import DENOISER_SERVICE, serve_denoiser
from tests.test_denoiser_lora import (
    _huge_rank,
    _request,
    _sample,
    _violations,
    _wrong_keys,
    _wrong_shapes,
)

STYLE, INK, THIRD = TINY_LORA, "tiny-ink", "tiny-third"
LOADS, HITS, MISSES = ("glmimage_denoiser_lora_loads_total", "glmimage_denoiser_lora_hits_total",
                       "glmimage_denoiser_lora_misses_total")


def _adapter(path: Path, like: Path, seed: int) -> None:
    """An adapter of ``like``'s shapes with other random weights."""
    g = torch.Generator().manual_seed(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: torch.randn(v.shape, generator=g) * 0.5 for k, v in load_file(str(like)).items()}, str(path))


@pytest.fixture(scope="module")
def admin_dir(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-style with its sidecar, tiny-ink in a folder (diffusers' layout) with a sidecar of its own, tiny-third."""
    root = tmp_path_factory.mktemp("admin-loras")
    for name in (f"{STYLE}.safetensors", f"{STYLE}.json"):
        shutil.copy(tiny_lora_dir(tiny_checkpoint) / name, root / name)
    style = root / f"{STYLE}.safetensors"
    _adapter(root / INK / "pytorch_lora_weights.safetensors", style, 2)
    (root / f"{INK}.json").write_text(json.dumps({"scale": 0.75, "description": "inky lines"}))
    _adapter(root / f"{THIRD}.safetensors", style, 3)
    return root


@pytest.fixture(scope="module")
def admin_engine(tiny_checkpoint: Path, admin_dir: Path) -> DenoiseEngine:
    return DenoiseEngine.load(tiny_checkpoint, device="cpu",
                              settings=DenoiseSettings(lora_dir=admin_dir, max_loaded_loras=2))


@pytest.fixture(scope="module")
async def admin_server(admin_engine):
    from runtime.executor import SerialExecutor

    server = await serve_denoiser(admin_engine, SerialExecutor("test-denoiser-lora-admin"))
    yield server
    await server.stop(None)


@pytest.fixture
async def dn(admin_server, admin_engine):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{admin_server.port}") as channel:
        stub = denoiser_service_pb2_grpc.DenoiserServiceStub(channel)
        await stub.UnloadLoras(pb.DenoiserServiceUnloadLorasRequest(names=[STYLE, INK, THIRD]))  # each test from empty
        yield stub


@pytest.fixture(scope="module")
async def base_image(denoiser_server) -> bytes:
    """The plain request's image from the session's denoiser, which never had a LoRA layer."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{denoiser_server.port}") as channel:
        return (await denoiser_service_pb2_grpc.DenoiserServiceStub(channel).Denoise(_request())).image


async def _load(dn, *names: str) -> list[str]:
    return list((await dn.LoadLoras(pb.DenoiserServiceLoadLorasRequest(names=names), timeout=60)).loaded)


async def _unload(dn, *names: str) -> list[str]:
    return list((await dn.UnloadLoras(pb.DenoiserServiceUnloadLorasRequest(names=names), timeout=60)).loaded)


async def _refused(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    return err.value


def _deltas(before: dict[str, float]) -> dict[str, float]:
    return {name: _sample(name) - value for name, value in before.items()}


# ---- ListLoras ---------------------------------------------------------------------------------------------------


async def test_list_loras_reads_the_directory_at_each_call(dn, admin_dir: Path) -> None:
    reply = await dn.ListLoras(pb.DenoiserServiceListLorasRequest())
    assert [a.name for a in reply.available] == [INK, STYLE, THIRD] and list(reply.loaded) == []  # by name
    by_name = {a.name: a for a in reply.available}
    assert by_name[INK].description == "inky lines" and by_name[INK].default_scale == pytest.approx(0.75)
    assert by_name[THIRD].description == "" and by_name[THIRD].default_scale == 1.0
    assert by_name[STYLE].description  # the demo adapter's sidecar
    assert by_name[INK].size_bytes == (admin_dir / INK / "pytorch_lora_weights.safetensors").stat().st_size
    assert by_name[THIRD].size_bytes == (admin_dir / f"{THIRD}.safetensors").stat().st_size

    added, broken = admin_dir / "added-later.safetensors", admin_dir / "broken-sidecar.safetensors"
    _adapter(added, admin_dir / f"{STYLE}.safetensors", 4)
    (admin_dir / "added-later.json").write_text('{"description": "new", "scale": 2}')
    shutil.copy(added, broken)
    (admin_dir / "broken-sidecar.json").write_text("{")
    try:
        reply = await dn.ListLoras(pb.DenoiserServiceListLorasRequest())
    finally:
        for path in (added, broken, admin_dir / "added-later.json", admin_dir / "broken-sidecar.json"):
            path.unlink()
    # Added at run time: listed at once. A sidecar no job could pass: left out.
    assert [a.name for a in reply.available] == ["added-later", INK, STYLE, THIRD]
    assert (reply.available[0].description, reply.available[0].default_scale) == ("new", 2.0)


async def test_list_loras_never_reads_weights(dn, admin_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    read: list[Path] = []
    real = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda self: read.append(self) or real(self))
    await dn.ListLoras(pb.DenoiserServiceListLorasRequest())
    assert read and all(path.suffix == ".json" for path in read)


async def test_list_loras_shows_what_is_loaded_least_recently_used_first(dn) -> None:
    assert await _load(dn, INK, STYLE) == [INK, STYLE]
    await dn.Denoise(_request(common_pb2.LoraRef(name=INK)))
    assert list((await dn.ListLoras(pb.DenoiserServiceListLorasRequest())).loaded) == [STYLE, INK]


# ---- LoadLoras, UnloadLoras and the counts -------------------------------------------------------------------------


async def test_a_preload_makes_the_job_a_hit_and_lora_load_seconds_says_what_a_load_cost(dn) -> None:
    before = {name: _sample(name) for name in (LOADS, HITS, MISSES)}
    assert await _load(dn, STYLE) == [STYLE]
    assert _deltas(before) == {LOADS: 1, HITS: 0, MISSES: 1}  # counted as a job's load

    before = {name: _sample(name) for name in (LOADS, HITS, MISSES)}
    held = await dn.Denoise(_request(common_pb2.LoraRef(name=STYLE)))
    assert _deltas(before) == {LOADS: 0, HITS: 1, MISSES: 0} and held.timings.lora_load_seconds == 0.0

    loading = await dn.Denoise(_request(common_pb2.LoraRef(name=INK)))  # not loaded: the job loads it
    timings = loading.timings
    assert 0 < timings.lora_load_seconds <= timings.prepare_seconds <= timings.denoise_seconds
    again = await dn.Denoise(_request(common_pb2.LoraRef(name=INK)))
    assert again.timings.lora_load_seconds == 0.0 and again.image == loading.image


async def test_unload_then_a_job_loads_it_again(dn, base_image: bytes) -> None:
    assert await _load(dn, STYLE, INK) == [STYLE, INK]
    styled = (await dn.Denoise(_request(common_pb2.LoraRef(name=STYLE)))).image
    assert await _unload(dn, STYLE, THIRD) == [INK]  # THIRD is not loaded: not an error
    assert await _unload(dn, STYLE) == [INK]
    before = {name: _sample(name) for name in (LOADS, HITS, MISSES)}
    reloaded = await dn.Denoise(_request(common_pb2.LoraRef(name=STYLE)))
    assert _deltas(before) == {LOADS: 1, HITS: 0, MISSES: 1} and reloaded.timings.lora_load_seconds > 0
    assert reloaded.image == styled
    assert await _unload(dn, STYLE, INK) == []
    assert (await dn.Denoise(_request())).image == base_image  # every adapter gone: the base model


async def test_a_preload_past_the_capacity_evicts_the_least_recently_used(dn, admin_engine) -> None:
    assert await _load(dn, STYLE, INK) == [STYLE, INK]
    assert await _load(dn, THIRD) == [INK, THIRD]
    assert await _load(dn, INK) == [THIRD, INK]  # a hit: now the most recently used
    assert len(admin_engine.pipe.transformer.peft_config) == 2


async def test_occupancy_shows_the_loaded_set_after_load_and_unload(dn) -> None:
    call = dn.WatchOccupancy(pb.WatchOccupancyRequest())
    try:
        first = await call.read()
        await _load(dn, INK, THIRD)
        state = await call.read()
        while state.busy or list(state.loras_loaded) != [INK, THIRD]:
            state = await asyncio.wait_for(call.read(), 10)
        assert state.sequence > first.sequence
        await _unload(dn, INK)
        while state.busy or list(state.loras_loaded) != [THIRD]:
            state = await asyncio.wait_for(call.read(), 10)
    finally:
        call.cancel()


# ---- the slot ----------------------------------------------------------------------------------------------------


def _blocked(monkeypatch: pytest.MonkeyPatch, engine: DenoiseEngine, method: str) -> tuple[threading.Event,
                                                                                            threading.Event]:
    """Make ``engine.method`` wait on the worker thread until released: (started, release)."""
    started, release = threading.Event(), threading.Event()
    real: Callable = getattr(engine, method)

    def blocked(*args, **kwargs):
        started.set()
        assert release.wait(30), "never released"
        return real(*args, **kwargs)

    monkeypatch.setattr(engine, method, blocked)
    return started, release


async def _until_set(event: threading.Event) -> None:
    async with asyncio.timeout(10):
        while not event.is_set():
            await asyncio.sleep(0.01)


async def test_load_holds_the_slot_like_a_job(dn, admin_server, admin_engine, monkeypatch) -> None:
    servicer = admin_server.servicer
    started, release = _blocked(monkeypatch, admin_engine, "load_loras")
    load = asyncio.ensure_future(_load(dn, STYLE))
    try:
        await _until_set(started)
        held = servicer.occupancy.state
        assert servicer.busy and held.busy and (held.owner, held.request_id) == ("", LOADING_LORAS)
        # A job meanwhile is refused busy, as for another gateway's job, so the gateway sends it elsewhere.
        err = await _refused(dn.Denoise(_request(), timeout=30))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert error_info(err) == (DENOISER_BUSY, "glmimage.v1", {"owner": "", "sequence": str(held.sequence)})
    finally:
        release.set()
    assert await load == [STYLE]
    assert not servicer.busy and list(servicer.occupancy.state.loras_loaded) == [STYLE]


async def test_unload_holds_the_slot_too(dn, admin_server, admin_engine, monkeypatch) -> None:
    await _load(dn, STYLE)
    started, release = _blocked(monkeypatch, admin_engine, "unload_loras")
    unload = asyncio.ensure_future(_unload(dn, STYLE))
    try:
        await _until_set(started)
        held = admin_server.servicer.occupancy.state
        assert held.busy and (held.owner, held.request_id) == ("", UNLOADING_LORAS)
    finally:
        release.set()
    assert await unload == []


async def test_load_waits_for_the_job_in_flight(dn, admin_server, admin_engine, monkeypatch) -> None:
    servicer = admin_server.servicer
    started, release = _blocked(monkeypatch, admin_engine, "run")
    job = asyncio.ensure_future(dn.Denoise(_request(common_pb2.LoraRef(name=INK)), timeout=60))
    try:
        await _until_set(started)
        assert servicer.occupancy.state.busy and servicer.occupancy.state.request_id != LOADING_LORAS
        # Bounded by its deadline: it never took the slot.
        err = await _refused(dn.LoadLoras(pb.DenoiserServiceLoadLorasRequest(names=[THIRD]), timeout=0.3))
        assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        load = asyncio.ensure_future(_load(dn, STYLE))
        await asyncio.sleep(0.2)
        assert not load.done()  # waiting, not refused
    finally:
        release.set()
    await job
    assert await load == [INK, STYLE]  # the job's adapter first: the job ran before the load
    assert THIRD not in admin_engine.loras_loaded()


# ---- refusals ----------------------------------------------------------------------------------------------------


def _not_safetensors(path: Path) -> None:
    path.write_text("not a safetensors file at all")


def _truncated(path: Path) -> None:
    _adapter(path, path.parent / f"{STYLE}.safetensors", 5)
    path.write_bytes(path.read_bytes()[:-100])


@pytest.mark.parametrize("make", [_wrong_keys, _wrong_shapes, _huge_rank, _truncated, _not_safetensors],
                         ids=["wrong-keys", "wrong-shapes", "huge-rank", "truncated", "not-safetensors"])
async def test_a_bad_file_is_refused_naming_it_with_nothing_half_loaded(dn, admin_dir, admin_engine, base_image,
                                                                      make) -> None:
    await _load(dn, STYLE)
    peft_before = set(admin_engine.pipe.transformer.peft_config)
    make(admin_dir / "bad.safetensors")
    try:
        err = await _refused(dn.LoadLoras(pb.DenoiserServiceLoadLorasRequest(names=[THIRD, "bad"]), timeout=60))
    finally:
        (admin_dir / "bad.safetensors").unlink()
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and _violations(err) == ["names[1]"], err.details()
    assert "adapter 'bad'" in err.details()
    # THIRD was fine, yet not loaded: all or nothing.
    assert admin_engine.loras_loaded() == (STYLE,) and set(admin_engine.pipe.transformer.peft_config) == peft_before
    assert list((await dn.ListLoras(pb.DenoiserServiceListLorasRequest())).loaded) == [STYLE]
    assert not admin_engine.pipe.transformer.peft_config.keys() - peft_before
    assert (await dn.Denoise(_request())).image == base_image  # still serving, the base model byte for byte


async def test_a_job_naming_a_bad_file_loads_none_of_its_adapters(dn, admin_dir, admin_engine) -> None:
    _wrong_shapes(admin_dir / "bad.safetensors")
    try:
        err = await _refused(dn.Denoise(_request(common_pb2.LoraRef(name=THIRD), common_pb2.LoraRef(name="bad"))))
    finally:
        (admin_dir / "bad.safetensors").unlink()
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and _violations(err) == ["loras[1]"]
    assert admin_engine.loras_loaded() == () and not getattr(admin_engine.pipe.transformer, "peft_config", None)


async def test_unload_waits_for_the_job_in_flight(dn, admin_engine, monkeypatch) -> None:
    started, release = _blocked(monkeypatch, admin_engine, "run")
    job = asyncio.ensure_future(dn.Denoise(_request(common_pb2.LoraRef(name=INK)), timeout=60))
    try:
        await _until_set(started)
        unload = asyncio.ensure_future(_unload(dn, INK))  # not loaded yet: the job in flight loads it
        await asyncio.sleep(0.2)
        assert not unload.done()
    finally:
        release.set()
    await job
    assert await unload == [] and admin_engine.loras_loaded() == ()


@pytest.mark.parametrize(("names", "field"), [
    (["../tiny-style"], "names[0]"), ([STYLE, "a/b"], "names[1]"), ([".."], "names[0]"), ([""], "names[0]"),
    (["missing"], "names[0]"), ([STYLE, STYLE], "names[1]"), ([STYLE, INK, THIRD], "names"),
])
async def test_a_bad_name_or_too_many_are_refused_before_any_work(dn, admin_engine, names, field) -> None:
    before = _sample(MISSES)
    err = await _refused(dn.LoadLoras(pb.DenoiserServiceLoadLorasRequest(names=names), timeout=30))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and _violations(err) == [field], err.details()
    assert _sample(MISSES) == before and admin_engine.loras_loaded() == ()


async def test_unload_checks_the_names_form_only(dn) -> None:
    err = await _refused(dn.UnloadLoras(pb.DenoiserServiceUnloadLorasRequest(names=["ok", "../x"])))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and _violations(err) == ["names[1]"]
    assert await _unload(dn, "not-in-the-directory") == []


async def test_without_a_lora_dir_nothing_is_listed_and_nothing_loads(denoiser_server) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{denoiser_server.port}") as channel:
        plain = denoiser_service_pb2_grpc.DenoiserServiceStub(channel)
        reply = await plain.ListLoras(pb.DenoiserServiceListLorasRequest())
        assert list(reply.available) == [] and list(reply.loaded) == []
        err = await _refused(plain.LoadLoras(pb.DenoiserServiceLoadLorasRequest(names=[STYLE])))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and _violations(err) == ["names"]
        assert "no --lora-dir" in err.details()
        assert list((await plain.LoadLoras(pb.DenoiserServiceLoadLorasRequest())).loaded) == []
        assert list((await plain.UnloadLoras(pb.DenoiserServiceUnloadLorasRequest(names=[STYLE]))).loaded) == []


# ---- the internal token ------------------------------------------------------------------------------------------


async def test_the_internal_token_covers_the_adapter_rpcs(admin_engine, admin_server) -> None:
    """The token interceptor names the service, not its methods: the new RPCs need the token like Denoise."""
    from services.denoiser.servicer import DenoiserServicer

    token = "a-internal-token-of-some-length"
    servicer = DenoiserServicer(admin_engine, admin_server.servicer.executor)  # one engine, one worker thread
    server = await start_server(
        lambda s: denoiser_service_pb2_grpc.add_DenoiserServiceServicer_to_server(servicer, s), [DENOISER_SERVICE],
        "127.0.0.1:0", interceptors=[internal_token_interceptor(token, [DENOISER_SERVICE])])
    await server.set_serving(True)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = denoiser_service_pb2_grpc.DenoiserServiceStub(channel)
            calls = {"ListLoras": lambda md: stub.ListLoras(pb.DenoiserServiceListLorasRequest(), metadata=md),
                     "LoadLoras": lambda md: stub.LoadLoras(pb.DenoiserServiceLoadLorasRequest(), metadata=md),
                     "UnloadLoras": lambda md: stub.UnloadLoras(pb.DenoiserServiceUnloadLorasRequest(), metadata=md)}
            for name, call in calls.items():
                for md in ((), bearer_metadata("wrong-" + token)):
                    err = await _refused(call(md))
                    assert err.code() == grpc.StatusCode.UNAUTHENTICATED and "internal token" in err.details(), name
                await call(bearer_metadata(token))
    finally:
        await server.stop(None)
