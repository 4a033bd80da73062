"""One limits model, end to end: workers started with their own --max-* flags, a gateway and a REST front that
learn them. For every limited field a value one past the limit is refused with the field named (REST `param`,
gRPC google.rpc.BadRequest), and no AR or denoiser work happens for it; /openapi.json and GetLimits advertise
the limits in force."""
from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from glmimage import AsyncClient
from glmimage.v1 import (
    ar_service_pb2,
    ar_service_pb2_grpc,
    denoiser_service_pb2,
    denoiser_service_pb2_grpc,
    gateway_service_pb2_grpc,
)
from glmimage.v1 import gateway_service_pb2 as pb
from runtime.errors import InvalidArgument
from runtime.limits import (
    AR_FIELDS,
    BOUNDS,
    DENOISER_CAPABILITIES,
    DENOISER_FIELDS,
    FIELDS,
    LORA_FIELDS,
    MAX_ASPECT,
    REFERENCE_FIELDS,
    SEED_SPACE,
    Limits,
    add_limit_args,
    advertised,
    check_reference_images,
    float_text,
    from_proto,
    limits_from_args,
    limits_in_force,
    model_size,
)
from tests.support.cluster import Cluster
from tests.support.images import image_file

# Each worker tighter than the defaults, and than each other where both apply (prompt, pixels).
AR_FLAGS = ["--max-prompt-chars", "300", "--max-n", "4", "--max-pixels", str(512 * 512)]
DENOISER_FLAGS = ["--max-prompt-chars", "400", "--max-pixels", str(256 * 256), "--max-steps", "7",
                  "--max-guidance", "9", "--max-partial-images", "2", "--max-lora-rank", "64"]
EXPECTED = Limits(max_prompt_chars=300, max_n=4, max_pixels=256 * 256, max_steps=7, max_guidance=9.0,
                  max_batch_outputs=32, max_partial_images=2, step_cache=True, max_lora_rank=64)
PROMPT = "a red cube"
REFERENCE_DEFAULTS = {name: getattr(Limits, name) for name in REFERENCE_FIELDS}
# The tiny model's denoiser serves its demo adapter, so it advertises adapters.
LORA_DEFAULTS = {**{name: getattr(Limits, name) for name in LORA_FIELDS}, "max_lora_rank": 64}


# ---- the model itself ------------------------------------------------------------------------------------------

def test_in_force_is_each_roles_union_and_defaults_stand_in_for_an_unknown_role() -> None:
    # What some worker of each stage can do (each one's limits are kept apart: runtime.capability); a bound both
    # roles apply, the lesser of the two unions.
    ar = [{"max_prompt_chars": 300, "max_n": 4}, {"max_prompt_chars": 500, "max_n": 16}]
    den = [{"max_steps": 500, "step_cache": False, "max_prompt_chars": 400},
           {"max_steps": 20, "step_cache": True, "max_prompt_chars": 8000}]  # raised above the default: counts
    got = limits_in_force({}, ar, den)
    assert (got.max_prompt_chars, got.max_n, got.max_steps, got.step_cache) == (500, 16, 500, True)
    assert limits_in_force({}, [], den).max_prompt_chars == 8000
    assert limits_in_force({}, ar, [{"max_prompt_chars": 400}]).max_prompt_chars == 400
    assert got.max_pixels == Limits.max_pixels  # nobody advertised it: the default
    # The gateway's own flags only ever lower it.
    lowered = limits_in_force({"max_steps": 50, "max_n": 10}, ar, den)
    assert (lowered.max_steps, lowered.max_n) == (50, 10)
    # No denoiser known yet: the denoiser fields take the defaults, not the AR's silence.
    assert limits_in_force({}, ar, []).max_steps == Limits.max_steps
    # A batch cap below n bounds n too (one AR batch must hold a request's outputs).
    assert limits_in_force({}, [{"max_n": 10, "max_batch_outputs": 3}], []).max_request_outputs == 3


@pytest.mark.parametrize(("width", "height", "field", "why"), [
    (2048, 2080, "height", "2048x2080 (width x height) exceeds the limit of 4194304 pixels"),  # WxH, as asked
    (2048, 2049, "height", "2048x2049 (width x height) exceeds the limit of 4194304 pixels; 2048x2080 after"),
    (1, 8000, "height", "1x8000 (width x height) is more elongated than 4:1"),
    (9000, 10, "width", "9000x10 (width x height) is more elongated than 4:1"),
    (129, 32, "width", "129x32 (width x height) is more elongated"),
])
def test_a_target_past_the_pixels_or_the_aspect_is_refused_naming_its_longer_side(
        width: int, height: int, field: str, why: str) -> None:
    with pytest.raises(InvalidArgument) as exc:
        model_size(height, width, Limits())
    assert exc.value.field == field and exc.value.description.startswith(why), exc.value


@pytest.mark.parametrize(("value", "text"), [
    (30.010000228881836, "30.01"), (30.0, "30"), (0.699999988079071, "0.7"), (2.5, "2.5"), (3.4e38, "3.4e+38"),
    (float("nan"), "nan"), (1e39, "1e+39"),
])
def test_a_float_limit_is_shown_as_it_was_set(value: float, text: str) -> None:
    assert float_text(value) == text


def test_targets_and_references_share_one_aspect_bound() -> None:
    assert model_size(32, 128, Limits()) == (32, 128)  # 4:1 exactly, both ways
    assert check_reference_images([image_file((128, 32))], Limits()) == [(128, 32)]
    elongated = f"more elongated than {MAX_ASPECT:g}:1"
    with pytest.raises(InvalidArgument, match=elongated):
        model_size(32, 129, Limits())
    with pytest.raises(InvalidArgument, match=elongated):
        check_reference_images([image_file((129, 32))], Limits())


def test_wire_form_round_trips_and_sends_only_the_fields_a_worker_applies() -> None:
    limits = Limits(max_steps=7, max_guidance=2.5)
    assert from_proto(limits.to_proto()) == limits
    assert set(advertised(limits.to_proto(AR_FIELDS))) == set(AR_FIELDS)
    assert set(advertised(limits.to_proto(DENOISER_FIELDS))) == set(DENOISER_FIELDS)
    assert set(AR_FIELDS) | set(DENOISER_FIELDS) == set(BOUNDS)  # every limit is applied by some worker
    assert set(BOUNDS) | set(DENOISER_CAPABILITIES) == set(FIELDS)


@pytest.mark.parametrize("flag, value", [("--max-steps", "0"), ("--max-n", "-1"), ("--max-guidance", "nan"),
                                         ("--max-guidance", "-1"), ("--max-guidance", "inf"),
                                         ("--max-steps", str(2**32)), ("--max-pixels", str(2**64))])
def test_a_limit_that_would_refuse_everything_is_refused_at_start(flag: str, value: str) -> None:
    p = argparse.ArgumentParser()
    add_limit_args(p, BOUNDS)
    with pytest.raises(SystemExit, match=flag):
        limits_from_args(p.parse_args([flag, value]), BOUNDS)


# ---- real processes --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("limits"))
    try:
        c.start("ar", "ar", AR_FLAGS, metrics=True)
        c.start("denoiser", "denoiser", DENOISER_FLAGS, metrics=True)
        ar, den = c.procs["ar"].address, c.procs["denoiser"].address
        c.start("gateway", "gateway", ["--ar", ar, "--denoiser", den, "--ar-batch-delay-ms", "0"])
        c.start("rest", "rest", ["--gateway-address", c.procs["gateway"].address])
        yield c
    finally:
        c.close()


def _metrics(port: int | None) -> dict[str, float]:
    """Every sample of a /metrics page, by its full name with labels."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def _work(stack: Cluster) -> dict[str, float]:
    """What the workers did, as their metrics count it (requests of every outcome, batches, jobs)."""
    samples = {**_metrics(stack.procs["ar"].metrics_port), **_metrics(stack.procs["denoiser"].metrics_port)}
    return {k: v for k, v in samples.items()
            if k.startswith(("glmimage_ar_requests_total", "glmimage_ar_batch_size_count",
                             "glmimage_denoiser_jobs_total"))}


def _violations(err: grpc.aio.AioRpcError) -> list[str]:
    status = rpc_status.from_call(err)
    assert status is not None, "INVALID_ARGUMENT without rich status details"
    fields = []
    for detail in status.details:
        bad = error_details_pb2.BadRequest()
        assert detail.Unpack(bad)
        fields += [v.field for v in bad.field_violations]
    return fields


async def test_workers_and_gateway_advertise_their_limits(stack: Cluster) -> None:
    async with grpc.aio.insecure_channel(stack.procs["ar"].address) as ch:
        ar = await ar_service_pb2_grpc.ArServiceStub(ch).GetLimits(ar_service_pb2.ArServiceGetLimitsRequest())
    assert advertised(ar.limits) == {"max_prompt_chars": 300, "max_n": 4, "max_pixels": 512 * 512,
                                     "max_batch_outputs": 32, **REFERENCE_DEFAULTS}
    assert ar.device == "cpu"  # (Cluster starts workers with --device cpu)
    async with grpc.aio.insecure_channel(stack.procs["denoiser"].address) as ch:
        den = await denoiser_service_pb2_grpc.DenoiserServiceStub(ch).GetLimits(
            denoiser_service_pb2.DenoiserServiceGetLimitsRequest())
    assert advertised(den.limits) == {"max_prompt_chars": 400, "max_pixels": 256 * 256, "max_steps": 7,
                                      "max_guidance": 9.0, "max_partial_images": 2, "step_cache": True,
                                      **LORA_DEFAULTS,
                                      **REFERENCE_DEFAULTS}
    assert den.device == "cpu" and not den.compiled_sizes  # (no --compile)
    async with grpc.aio.insecure_channel(stack.procs["gateway"].address) as ch:
        stub = gateway_service_pb2_grpc.GatewayServiceStub(ch)
        gw = await stub.GetLimits(pb.GetLimitsRequest())
        status = await stub.GetStatus(pb.GetStatusRequest())  # (a keyless gateway shows everything to everyone)
    assert from_proto(gw.limits) == EXPECTED
    assert [(w.role, w.device) for w in status.workers] == [(pb.WORKER_ROLE_AR, "cpu"),
                                                            (pb.WORKER_ROLE_DENOISER, "cpu")]


async def test_openapi_advertises_the_limits_in_force(stack: Cluster) -> None:
    async with httpx.AsyncClient(base_url=f"http://{stack.procs['rest'].address}") as client:
        doc = (await client.get("/openapi.json")).json()

    def bound(name: str, keyword: str) -> Any:
        prop = doc["components"]["schemas"]["ImageGenerationRequest"]["properties"][name]
        return next(b[keyword] for b in prop.get("anyOf", [prop]) if keyword in b)

    assert bound("prompt", "maxLength") == 300
    assert bound("n", "maximum") == 4
    assert bound("num_inference_steps", "maximum") == 7
    assert bound("guidance_scale", "maximum") == 9.0
    assert bound("partial_images", "maximum") == 2
    assert bound("seed", "maximum") == SEED_SPACE - 1
    size = doc["components"]["schemas"]["ImageGenerationRequest"]["properties"]["size"]
    assert size["x-max-pixels"] == 256 * 256
    assert size["x-max-aspect"] == MAX_ASPECT


# (REST body, REST param, the same request over gRPC, the field its BadRequest names)
ONE_PAST = [
    ({"prompt": "x" * 301}, "prompt", pb.GenerateImagesRequest(prompt="x" * 301), "prompt"),
    ({"n": 5}, "n", pb.GenerateImagesRequest(n=5), "n"),
    ({"size": "288x256"}, "size", pb.GenerateImagesRequest(width=288, height=256), "width"),
    ({"size": "256x288"}, "size", pb.GenerateImagesRequest(width=256, height=288), "height"),
    ({"size": "64x320"}, "size", pb.GenerateImagesRequest(width=64, height=320), "height"),  # past 4:1
    ({"num_inference_steps": 8}, "num_inference_steps", pb.GenerateImagesRequest(num_inference_steps=8),
     "num_inference_steps"),
    ({"guidance_scale": 9.01}, "guidance_scale",
     pb.GenerateImagesRequest(guidance_scale=9.01), "guidance_scale"),
    ({"seed": SEED_SPACE - 1, "n": 2}, "seed", pb.GenerateImagesRequest(seed=SEED_SPACE - 1, n=2), "seed"),
    ({"seed": SEED_SPACE}, "seed", pb.GenerateImagesRequest(seed=SEED_SPACE - 1, n=2), "seed"),
    ({"output_compression": 101}, "output_compression", pb.GenerateImagesRequest(output_compression=101),
     "output_compression"),
    ({"stream": True, "partial_images": 3}, "partial_images",
     pb.GenerateImagesStreamRequest(partial_images=3), "partial_images"),
]


@pytest.mark.parametrize("body, param, grpc_request, field", ONE_PAST,
                         ids=[f"{p}={json.dumps(b)[:40]}" for b, p, _, _ in ONE_PAST])
async def test_one_past_each_limit_is_refused_naming_the_field_and_costs_no_work(
        stack: Cluster, body: dict, param: str, grpc_request: Any, field: str) -> None:
    before = _work(stack)
    async with httpx.AsyncClient(base_url=f"http://{stack.procs['rest'].address}", timeout=30) as client:
        resp = await client.post("/v1/images/generations", json={"prompt": PROMPT, "size": "64x64", **body})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param, resp.text

    async with grpc.aio.insecure_channel(stack.procs["gateway"].address) as ch:
        stub = gateway_service_pb2_grpc.GatewayServiceStub(ch)
        if isinstance(grpc_request, pb.GenerateImagesStreamRequest):
            grpc_request.request.CopyFrom(pb.GenerateImagesRequest(prompt=PROMPT, width=64, height=64))
            call: Any = stub.GenerateImagesStream(grpc_request, timeout=30).read()
        else:
            msg = pb.GenerateImagesRequest(prompt=PROMPT, width=64, height=64)
            msg.MergeFrom(grpc_request)
            call = stub.GenerateImages(msg, timeout=30)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert _violations(err.value) == [field]
    assert _work(stack) == before  # neither the AR nor the denoiser saw it


async def test_at_the_limits_the_request_is_served(stack: Cluster) -> None:
    async with httpx.AsyncClient(base_url=f"http://{stack.procs['rest'].address}", timeout=120) as client:
        resp = await client.post("/v1/images/generations", json={
            "prompt": "x" * 300, "size": "256x256", "num_inference_steps": 7, "guidance_scale": 9.0, "n": 1,
            "seed": SEED_SPACE - 1})
    assert resp.status_code == 200, resp.text
    assert len(resp.json()["data"]) == 1


async def test_the_sdk_and_the_cli_read_the_limits_in_force(stack: Cluster) -> None:
    address = stack.procs["gateway"].address
    async with AsyncClient(address) as client:
        limits = await client.limits()
    expected = dataclasses.asdict(EXPECTED)
    assert dataclasses.asdict(limits) == expected
    out = subprocess.run([sys.executable, "-m", "glmimage.cli", "--address", address, "limits", "--json"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert json.loads(out) == expected
