"""Mixed pools (issue 32): capabilities per worker, not per pool, on real processes.

One AR and five real tiny denoisers: ``full`` (an adapter directory, step caching, the default pixel budget) and
three that each lack one thing: ``nolora`` (no --lora-dir), ``nocache`` (a diffusers without the step cache:
tests/support/no_step_cache_denoiser.py) and ``small`` (a lower --max-pixels). Three gateways pair ``full`` with
each of them. In every pair the requests that need what the weak one lacks all succeed and run only on ``full``
(each denoiser's own glmimage_denoiser_jobs_total says where the jobs ran), even sent all at once while ``full`` is
busy and the weak one idle; plain requests use both; GetLimits serves what the pool can do (the union). A fourth
gateway, behind a REST front, pairs two that each lack something (``nolora``, ``small``): each runs what only it
can, and a request that needs both at once is refused as before, the field named (REST: its OpenAI ``param``).

The AR stage too: a second AR, ``smallar`` (a lower --max-pixels), beside ``ar`` behind a fifth gateway with
``full``: the larger requests all succeed and run only on ``ar`` (each AR's own glmimage_ar_requests_total), even
sent at once while ``ar`` is busy and ``smallar`` idle; plain requests use both; GetLimits serves the larger budget.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from glmimage.v1 import common_pb2, gateway_service_pb2_grpc
from glmimage.v1 import gateway_service_pb2 as pb
from runtime.limits import Limits
from services.model.tiny import TINY_LORA, tiny_lora_dir
from tests.support.cluster import Cluster
from tests.support.waiting import until

pytestmark = pytest.mark.e2e

SMALL_PIXELS = 256 * 256
WEAK = ("nolora", "nocache", "small")
TIMEOUT = 180  # one call: a few tiny jobs queued behind one denoiser on a loaded 2-core machine


@pytest.fixture(scope="module")
def pools(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    procs = Cluster(tmp_path_factory.mktemp("mixed"))
    # --model-path: without it the tiny model's denoiser serves its demo adapter, --lora-dir or not.
    model = ["--model-path", str(tiny_checkpoint), "--default-steps", "2"]
    loras = ["--lora-dir", str(tiny_lora_dir(tiny_checkpoint))]
    channels: list[grpc.Channel] = []
    try:
        procs.start("ar", "ar", ["--model-path", str(tiny_checkpoint)], metrics=True, wait=False)
        procs.start("smallar", "ar", ["--model-path", str(tiny_checkpoint), "--max-pixels", str(SMALL_PIXELS)],
                    metrics=True, wait=False)
        procs.start("full", "denoiser", [*model, *loras], metrics=True, wait=False)
        procs.start("nolora", "denoiser", model, metrics=True, wait=False)
        procs.start("nocache", "denoiser", [*model, *loras], metrics=True, wait=False,
                    module="tests.support.no_step_cache_denoiser")
        procs.start("small", "denoiser", [*model, *loras, "--max-pixels", str(SMALL_PIXELS)], metrics=True,
                    wait=False)
        for name in ("ar", "smallar", "full", *WEAK):
            procs.wait_ready(name)
        stubs = {}
        pools = [(weak, ("ar", "full", weak)) for weak in WEAK]
        pools += [("combo", ("ar", "nolora", "small")), ("ar", ("ar", "smallar", "full"))]
        for weak, members in pools:
            flags = [f"--{procs.procs[m].role}={procs.procs[m].address}" for m in members]
            if weak == "ar":  # a batch per request: with one in flight per AR, requests sent at once need both
                flags += ["--ar-batch-max-outputs", "1"]
            gateway = procs.start(f"g-{weak}", "gateway", flags)
            channel = grpc.insecure_channel(gateway.address)
            channels.append(channel)
            stub = gateway_service_pb2_grpc.GatewayServiceStub(channel)
            until(lambda s=stub: [w.state for w in s.GetStatus(pb.GetStatusRequest()).workers]
                  == [pb.WORKER_STATE_AVAILABLE] * 3, 60, f"every worker of g-{weak} available")
            stubs[weak] = stub
        procs.start("rest", "rest", ["--gateway-address", procs.procs["g-combo"].address])
        yield procs, stubs
    finally:
        for channel in channels:
            channel.close()
        procs.close()


def _served(procs: Cluster, names: tuple[str, ...] = ("full", *WEAK),
            metric: str = "glmimage_denoiser_jobs_total") -> dict[str, float]:
    """What each worker of ``names`` finished (its own ``metric``{outcome="ok"}: a denoiser's jobs), by name."""
    counts = {}
    for name in names:
        text = httpx.get(f"http://127.0.0.1:{procs.procs[name].metrics_port}/metrics", timeout=10).text
        counts[name] = sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
                           if s.name == metric and s.labels.get("outcome") == "ok")
    return counts


def _ar_served(procs: Cluster) -> dict[str, float]:
    """Each AR's finished requests (every request of a batch counts), by name."""
    return _served(procs, ("ar", "smallar"), "glmimage_ar_requests_total")


def _request(weak: str, *, plain: bool = False, n: int = 2, seed: int = 1) -> pb.GenerateImagesRequest:
    """What only ``full`` can run in the pool with ``weak`` (or, ``plain``, what both can)."""
    request = pb.GenerateImagesRequest(prompt='a "mixed" pool', height=64, width=64, n=n, seed=seed)
    if plain:
        return request
    if weak == "nolora":
        request.loras.append(common_pb2.LoraRef(name=TINY_LORA))
    elif weak == "nocache":
        request.step_cache = common_pb2.STEP_CACHE_BALANCED
        request.num_inference_steps = 4
    else:
        request.height = request.width = 320  # 102400 pixels: past the small one's budget
    return request


def _run(stub, requests: list[pb.GenerateImagesRequest]) -> list[pb.GenerateImagesResponse]:
    """All at once: while ``full`` runs the first job the others queue, and the weak denoiser is free."""
    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(lambda r: stub.GenerateImages(r, timeout=TIMEOUT), requests))


@pytest.mark.parametrize("weak", WEAK)
def test_what_only_one_denoiser_can_run_runs_there_and_plain_requests_use_both(pools, weak: str) -> None:
    procs, stubs = pools
    stub = stubs[weak]
    before = _served(procs)
    replies = _run(stub, [_request(weak, seed=s) for s in range(3)])
    assert [len(r.images) for r in replies] == [2, 2, 2]  # every one succeeded
    after = _served(procs)
    moved = {name: after[name] - before[name] for name in after}
    assert moved == {"full": 6, **{name: 0 for name in WEAK}}, moved
    # Plain requests: four outputs fan out over both denoisers of the pool at once.
    before = after
    (plain,) = _run(stub, [_request(weak, plain=True, n=4)])
    assert len(plain.images) == 4
    after = _served(procs)
    moved = {name: after[name] - before[name] for name in after}
    assert moved["full"] >= 1 and moved[weak] >= 1 and moved["full"] + moved[weak] == 4, moved
    assert sum(moved[name] for name in WEAK if name != weak) == 0


def test_get_limits_serves_what_the_pool_can_do(pools) -> None:
    _, stubs = pools
    limits = {weak: stubs[weak].GetLimits(pb.GetLimitsRequest()).limits for weak in WEAK}
    assert limits["nolora"].max_loras_per_request == Limits.max_loras_per_request  # one of them serves adapters
    assert limits["nocache"].step_cache  # one of them caches
    assert limits["small"].max_pixels == Limits.max_pixels  # the larger budget
    names = [info.name for info in stubs["nolora"].ListLoras(pb.ListLorasRequest()).loras]
    assert names == [TINY_LORA]


def test_what_no_member_can_run_is_refused_as_before_with_the_field_named(pools) -> None:
    _, stubs = pools
    request = _request("nolora")
    request.loras[0].name = "no-such-adapter"
    with pytest.raises(grpc.RpcError) as caught:
        stubs["nolora"].GenerateImages(request, timeout=60)
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert (caught.value.details() or "").startswith("loras: loras[0]: no adapter named 'no-such-adapter'")
    request = _request("small")
    request.height = request.width = 4096  # past every denoiser's budget (and the AR's)
    with pytest.raises(grpc.RpcError) as caught:
        stubs["small"].GenerateImages(request, timeout=60)
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert (caught.value.details() or "").startswith("height: 4096x4096 (width x height) exceeds the limit")


def test_a_pool_of_two_partial_denoisers_runs_what_each_can_and_refuses_what_neither_can_alone(pools) -> None:
    procs, stubs = pools
    stub = stubs["combo"]
    adapter, big = _request("nolora", n=1), _request("small", n=1)
    before = _served(procs)
    _run(stub, [adapter, big, adapter, big])
    after = _served(procs)
    moved = {name: after[name] - before[name] for name in after}
    assert moved == {"full": 0, "nolora": 2, "nocache": 0, "small": 2}, moved  # each ran what only it can
    both = _request("nolora", n=1)
    both.height = both.width = 320
    with pytest.raises(grpc.RpcError) as caught:
        stub.GenerateImages(both, timeout=60)
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert (caught.value.details() or "").startswith("loras: ")
    assert "no denoiser here serves everything this request asks at once" in (caught.value.details() or "")
    # The REST front admits what the pool can do (the union it reads from GetLimits) and relays the refusal.
    body = {"prompt": 'a "mixed" pool', "size": "320x320", "response_format": "b64_json",
            "loras": [{"name": TINY_LORA}]}
    reply = httpx.post(f"http://{procs.procs['rest'].address}/v1/images/generations", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "loras", reply.json()
    body["size"] = "64x64"
    reply = httpx.post(f"http://{procs.procs['rest'].address}/v1/images/generations", json=body, timeout=TIMEOUT)
    assert reply.status_code == 200, reply.text
    assert _served(procs)["small"] == after["small"] + 1


def test_what_only_one_ar_can_run_runs_there_and_plain_requests_use_both(pools) -> None:
    procs, stubs = pools
    stub = stubs["ar"]
    assert stub.GetLimits(pb.GetLimitsRequest()).limits.max_pixels == Limits.max_pixels  # the larger AR's
    before = _ar_served(procs)
    replies = _run(stub, [_request("small", n=1, seed=s) for s in range(3)])  # 320x320: past smallar's budget
    assert [len(r.images) for r in replies] == [1, 1, 1]
    after = _ar_served(procs)
    assert {name: after[name] - before[name] for name in after} == {"ar": 3, "smallar": 0}
    before = after
    plain = _run(stub, [_request("small", plain=True, n=1, seed=s) for s in range(4)])
    assert [len(r.images) for r in plain] == [1] * 4
    after = _ar_served(procs)
    moved = {name: after[name] - before[name] for name in after}
    assert moved["ar"] >= 1 and moved["smallar"] >= 1 and sum(moved.values()) == 4, moved
