"""LoRA adapters through GatewayService over a real pool (issue 23): one AR and two denoisers with an adapter directory
holding the tiny model's demo adapter and bad files, a gateway with user and admin keys, all real processes.

- a request naming an adapter is admitted only with names the pool serves (INVALID_ARGUMENT on ``loras`` before any
  work otherwise), runs with it (another image at the same seed, the same image twice), and leaves the next plain
  request the base image; scale 0 is the base image;
- two sequential requests with the same adapter load it once over the pool (the scheduler's affinity);
- a bad adapter file is refused with the field named, the denoisers keep serving, and no attempt is retried;
- ListLoras for users (no placement), LoadLoras / UnloadLoras for the admin role only, the placement as each
  denoiser says it; a hung (SIGSTOPped) denoiser holds up neither.
"""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import grpc
import httpx
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from prometheus_client.parser import text_string_to_metric_families

from gateway.auth import ENV_ADMIN_KEYS, ENV_KEYS
from glmimage.v1 import common_pb2, gateway_service_pb2_grpc
from glmimage.v1 import gateway_service_pb2 as pb
from services.model.tiny import TINY_LORA, tiny_lora_dir
from tests.support.cluster import Cluster
from tests.support.waiting import until
from tests.test_denoiser_lora import _huge_rank, _not_lora, _wrong_keys, _wrong_shapes

pytestmark = pytest.mark.e2e

USER_KEY, ADMIN_KEY = "user-key-lora", "admin-key-lora"
USER = (("authorization", f"Bearer {USER_KEY}"),)
ADMIN = (("authorization", f"Bearer {ADMIN_KEY}"),)
BAD = ("bad-truncated", "bad-text", "bad-keys", "bad-shapes", "bad-rank", "bad-not-lora")


def _bad_files(root: Path) -> None:
    style = (root / f"{TINY_LORA}.safetensors").read_bytes()
    (root / "bad-truncated.safetensors").write_bytes(style[:-100])
    (root / "bad-text.safetensors").write_text("not a safetensors file at all")
    for name, make in (("bad-keys", _wrong_keys), ("bad-shapes", _wrong_shapes), ("bad-rank", _huge_rank),
                       ("bad-not-lora", _not_lora)):
        make(root / f"{name}.safetensors")


@pytest.fixture(scope="module")
def pool(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("loras")
    for name in (f"{TINY_LORA}.safetensors", f"{TINY_LORA}.json"):
        shutil.copy(tiny_lora_dir(tiny_checkpoint) / name, root / name)
    _bad_files(root)
    procs = Cluster(tmp_path_factory.mktemp("procs"))
    try:
        procs.start("ar", "ar", wait=False)
        for name in ("d0", "d1"):
            procs.start(name, "denoiser", ["--default-steps", "2", "--lora-dir", str(root)], metrics=True,
                        wait=False)
        for name in ("ar", "d0", "d1"):
            procs.wait_ready(name)
        addr = {name: procs.procs[name].address for name in ("ar", "d0", "d1")}
        procs.start("gateway", "gateway", ["--ar", addr["ar"], "--denoiser", addr["d0"], "--denoiser", addr["d1"]],
                    env={ENV_KEYS: USER_KEY, ENV_ADMIN_KEYS: ADMIN_KEY})
        # The REST front in front of it, forwarding each client's key.
        procs.start("rest", "rest", ["--gateway-address", procs.procs["gateway"].address, "--api-key", USER_KEY,
                                     "--gateway-api-key", USER_KEY])
        channel = grpc.insecure_channel(procs.procs["gateway"].address)
        stub = gateway_service_pb2_grpc.GatewayServiceStub(channel)
        until(lambda: [w.state for w in stub.GetStatus(pb.GetStatusRequest(), metadata=USER).workers]
              == [pb.WORKER_STATE_AVAILABLE] * 3, 60, "every worker available")
        yield {"stub": stub, "procs": procs, "addr": addr, "root": root, "rest": procs.procs["rest"].address}
        channel.close()
    finally:
        procs.close()


def _generate(stub, *loras: common_pb2.LoraRef, seed: int = 11) -> bytes:
    reply = stub.GenerateImages(pb.GenerateImagesRequest(prompt='a "lora" sign', height=64, width=64, seed=seed,
                                                         num_inference_steps=2, loras=loras),
                                metadata=USER, timeout=120)
    return reply.images[0].image


def _violations(err: grpc.RpcError) -> list[str]:
    fields = []
    status = rpc_status.from_call(err)
    assert status is not None, err
    for detail in status.details:
        bad = error_details_pb2.BadRequest()
        assert detail.Unpack(bad)
        fields += [v.field for v in bad.field_violations]
    return fields


def _refused(call, *args, **kwargs) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call(*args, **kwargs)
    return caught.value


def _loads(pool) -> float:
    """glmimage_denoiser_lora_loads_total summed over the pool."""
    total = 0.0
    for name in ("d0", "d1"):
        text = httpx.get(f"http://127.0.0.1:{pool['procs'].procs[name].metrics_port}/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            total += sum(s.value for s in family.samples if s.name == "glmimage_denoiser_lora_loads_total")
    return total


def _style(scale: float | None = None) -> common_pb2.LoraRef:
    return common_pb2.LoraRef(name=TINY_LORA, scale=scale)


def test_list_loras_shows_the_served_adapters_and_the_placement_to_the_admin_only(pool) -> None:
    stub = pool["stub"]
    listed = stub.ListLoras(pb.ListLorasRequest(), metadata=USER)
    assert TINY_LORA in [info.name for info in listed.loras]
    style = next(info for info in listed.loras if info.name == TINY_LORA)
    assert style.size_bytes == (pool["root"] / f"{TINY_LORA}.safetensors").stat().st_size
    assert listed.placement == []  # where they are loaded, and the denoisers' addresses, are the admin's
    admin = stub.ListLoras(pb.ListLorasRequest(), metadata=ADMIN)
    assert sorted(p.worker for p in admin.placement) == sorted([pool["addr"]["d0"], pool["addr"]["d1"]])
    assert _refused(stub.ListLoras, pb.ListLorasRequest()).code() is grpc.StatusCode.UNAUTHENTICATED


def test_an_adapter_changes_the_image_reproducibly_and_the_next_plain_request_is_the_base(pool) -> None:
    stub = pool["stub"]
    base = _generate(stub)
    styled = _generate(stub, _style(1.0))
    assert styled != base
    assert _generate(stub, _style(1.0)) == styled
    assert _generate(stub) == base  # nothing of it outlives its job, on whichever denoiser ran it
    assert _generate(stub, _style(0.0)) == base


def test_two_sequential_requests_with_the_same_adapter_load_it_once(pool) -> None:
    stub = pool["stub"]
    # Neither denoiser holds it (an unload on the whole pool), so the first request loads it somewhere.
    stub.UnloadLoras(pb.UnloadLorasRequest(names=[TINY_LORA]), metadata=ADMIN)
    until(lambda: not any(w.loras_loaded for w in stub.GetStatus(pb.GetStatusRequest(), metadata=ADMIN).workers),
          30, "the occupancy streams to say that no denoiser holds it")
    before = _loads(pool)
    _generate(stub, _style(), seed=3)
    _generate(stub, _style(), seed=4)
    assert _loads(pool) == before + 1


def test_unknown_too_many_and_malformed_adapters_are_refused_before_any_work(pool) -> None:
    stub = pool["stub"]
    cases = [
        ((common_pb2.LoraRef(name="no-such-adapter"),), "loras"),
        ((common_pb2.LoraRef(name="../etc/passwd"),), "loras[0].name"),
        ((common_pb2.LoraRef(name="a/b"),), "loras[0].name"),
        ((_style(9.0),), "loras[0].scale"),
        ((_style(float("nan")),), "loras[0].scale"),
        ((_style(), _style()), "loras[1].name"),
        (tuple(common_pb2.LoraRef(name=f"x{i}") for i in range(40)), "loras"),
    ]
    for loras, field in cases:
        err = _refused(_generate, stub, *loras)
        assert err.code() is grpc.StatusCode.INVALID_ARGUMENT, (loras, err)
        assert _violations(err) == [field], (loras, err.details())


@pytest.mark.parametrize("name", BAD)
def test_a_bad_adapter_file_is_refused_with_the_field_named_and_the_pool_keeps_serving(pool, name: str) -> None:
    stub = pool["stub"]
    base = _generate(stub, seed=5)
    err = _refused(_generate, stub, common_pb2.LoraRef(name=name), seed=5)
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert _violations(err) == ["loras[0]"], err.details()
    assert name in err.details()
    # And through the admin's preload: refused, nothing loaded anywhere.
    err = _refused(stub.LoadLoras, pb.LoadLorasRequest(names=[name]), metadata=ADMIN)
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT and _violations(err) == ["names[0]"], err.details()
    # And through the REST front: a 400 naming the adapter's place in the body, never a 5xx.
    answer = httpx.post(f"http://{pool['rest']}/v1/images/generations", timeout=120,
                        headers={"Authorization": f"Bearer {USER_KEY}"},
                        json={"prompt": "x", "size": "64x64", "num_inference_steps": 2, "loras": [{"name": name}]})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "loras[0]", answer.text
    assert name in answer.json()["error"]["message"]
    assert _generate(stub, seed=5) == base
    status = stub.GetStatus(pb.GetStatusRequest(), metadata=ADMIN)
    assert all(w.state == pb.WORKER_STATE_AVAILABLE for w in status.workers)
    assert not any(name in w.loras_loaded for w in status.workers)


def test_the_admin_preloads_and_unloads_and_a_user_key_cannot(pool) -> None:
    stub, addr = pool["stub"], pool["addr"]
    request = pb.LoadLorasRequest(names=[TINY_LORA], workers=[addr["d1"]])
    assert _refused(stub.LoadLoras, request, metadata=USER).code() is grpc.StatusCode.PERMISSION_DENIED
    assert _refused(stub.UnloadLoras, pb.UnloadLorasRequest(names=[TINY_LORA]),
                    metadata=USER).code() is grpc.StatusCode.PERMISSION_DENIED
    reply = stub.LoadLoras(request, metadata=ADMIN)
    assert [(p.worker, list(p.loaded), p.error) for p in reply.placement] == [(addr["d1"], [TINY_LORA], "")]
    # Where it is loaded is where its next job goes: the load counter does not move.
    until(lambda: any(TINY_LORA in w.loras_loaded and w.address == addr["d1"]
                      for w in stub.GetStatus(pb.GetStatusRequest(), metadata=ADMIN).workers), 30, "d1 to hold it")
    before = _loads(pool)
    _generate(stub, _style(), seed=8)
    assert _loads(pool) == before
    reply = stub.UnloadLoras(pb.UnloadLorasRequest(names=[TINY_LORA]), metadata=ADMIN)
    assert sorted(p.worker for p in reply.placement) == sorted([addr["d0"], addr["d1"]])
    assert all(TINY_LORA not in p.loaded and not p.error for p in reply.placement)
    for bad, field in ((pb.LoadLorasRequest(names=["no-such"]), "names[0]"),
                       (pb.LoadLorasRequest(names=[]), "names"),
                       (pb.LoadLorasRequest(names=[".."]), "names[0]"),
                       (pb.LoadLorasRequest(names=[TINY_LORA], workers=["10.0.0.1:1"]), "workers[0]"),
                       (pb.LoadLorasRequest(names=[TINY_LORA], workers=[addr["ar"]]), "workers[0]")):
        err = _refused(stub.LoadLoras, bad, metadata=ADMIN)
        assert err.code() is grpc.StatusCode.INVALID_ARGUMENT and _violations(err) == [field], err.details()


def test_a_hung_denoiser_does_not_hold_up_the_admin_or_the_listing(pool) -> None:
    stub, addr, procs = pool["stub"], pool["addr"], pool["procs"]

    def health() -> dict[str, pb.WorkerStatus]:
        return {w.address: w for w in stub.GetStatus(pb.GetStatusRequest(), metadata=ADMIN).workers}

    os.kill(procs.procs["d1"].pid, signal.SIGSTOP)
    try:
        until(lambda: health()[addr["d1"]].stuck, 60, "the gateway to see d1 hung")
        # Neither call waits on it (the calls carry no deadline of their own: the gateway's would be minutes).
        listed = stub.ListLoras(pb.ListLorasRequest(), metadata=ADMIN, timeout=60)
        assert TINY_LORA in [info.name for info in listed.loras]
        shown = {p.worker: p.error for p in listed.placement}
        assert shown[addr["d0"]] == "" and shown[addr["d1"]].startswith("UNAVAILABLE: not called: it is not answering")
        reply = stub.LoadLoras(pb.LoadLorasRequest(names=[TINY_LORA]), metadata=ADMIN, timeout=60)
        placement = {p.worker: p for p in reply.placement}
        assert TINY_LORA in placement[addr["d0"]].loaded and not placement[addr["d0"]].error
        assert placement[addr["d1"]].error.startswith("UNAVAILABLE: not called")
    finally:
        os.kill(procs.procs["d1"].pid, signal.SIGCONT)
    until(lambda: health()[addr["d1"]].state == pb.WORKER_STATE_AVAILABLE, 60, "d1 to be back")
