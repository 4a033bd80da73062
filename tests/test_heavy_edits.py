"""A legitimate heavy edit succeeds on default settings and burns nobody (issue: call timeouts learned from plain
jobs cut it short, and each overrun sidelined a healthy worker).

The real AR, two denoisers and a gateway, as processes with the default timeout flags, on the tiny model. Plain
requests first teach the gateway short timeouts; then edits of 16 and 2 large references (each a 4096x4096 PNG of
about 58 KB, every limit respected) must succeed at the first attempt, and no worker may be marked suspect.
"""
from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from gateway.timeouts import TimeoutPolicy
from glmimage.v1 import common_pb2
from glmimage.v1 import gateway_service_pb2 as pb
from glmimage.v1 import gateway_service_pb2_grpc as pb_grpc
from tests.support.cluster import Cluster
from tests.support.images import image_file
from tests.support.sim_gateway import request, running_gateway, sim_cluster, wait_for

LARGE = image_file((4096, 4096), color=(120, 80, 200))


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: Path) -> Iterator[Cluster]:
    procs = Cluster(tmp_path_factory.mktemp("heavy-edits"))
    try:
        ar = procs.start("ar", "ar")
        dens = [procs.start(f"d{i}", "denoiser", ["--default-steps", "2"]) for i in range(2)]
        flags = ["--ar", ar.address]
        for d in dens:
            flags += ["--denoiser", d.address]
        procs.start("gateway", "gateway", flags)
        yield procs
    finally:
        procs.close()


def _generate(stub: pb_grpc.GatewayServiceStub, references: int, size: int = 64) -> pb.GenerateImagesResponse:
    request = pb.GenerateImagesRequest(
        prompt="a cat", height=size, width=size, num_inference_steps=2, seed=references,
        reference_images=[common_pb2.ReferenceImage(data=LARGE) for _ in range(references)])
    return stub.GenerateImages(request, timeout=600)


@pytest.mark.e2e
def test_heavy_edits_among_plain_requests_succeed_at_once_and_sideline_nobody(pool: Cluster) -> None:
    assert len(LARGE) < 64 << 10 and 16 * len(LARGE) < 1 << 20
    with grpc.insecure_channel(pool.procs["gateway"].address) as channel:
        stub = pb_grpc.GatewayServiceStub(channel)
        for size in (256, 64, 64):  # the timeouts learn what plain jobs take
            assert len(_generate(stub, 0, size).images) == 1
        for references in (16, 0, 2):  # the soak in bench/edit_soak.py mixes more
            reply = _generate(stub, references)
            assert len(reply.images) == 1 and (reply.width, reply.height) == (64, 64), references
        status = stub.GetStatus(pb.GetStatusRequest(), timeout=30)
    assert {w.state for w in status.workers} == {pb.WORKER_STATE_AVAILABLE}, status
    log = (pool.dir / "gateway.log").read_text()
    assert "is suspect" not in log, pool.tail("gateway")
    assert "failed after" not in log, pool.tail("gateway")  # every call ended within its timeout


# ---- a slow job on a healthy worker, in-process -----------------------------------------------------------------


async def test_a_job_overrunning_on_a_denoiser_that_answers_its_probe_is_slow_not_sick(
        caplog: pytest.LogCaptureFixture) -> None:
    """Every simulated denoiser holds its job past a short learned timeout while answering health checks: no
    denoiser is sidelined for it, and the request succeeds once the jobs may finish."""
    caplog.set_level(logging.INFO, logger="gateway.driver")
    async with sim_cluster() as sims:
        denoisers = [f"127.0.0.1:{d.port}" for d in sims.denoisers]
        policy = TimeoutPolicy(margin=1.0, floor=0.3, cap=600.0)
        async with running_gateway([f"127.0.0.1:{sims.ar.port}"], denoisers,
                                   config_fields={"denoise_timeout": policy}) as gw:
            await gw.stub.GenerateImages(request(num_inference_steps=2))  # the timeout is now the 0.3 s floor
            sims.gate.clear()  # jobs of two steps stop after their first
            call = gw.stub.GenerateImages(request(num_inference_steps=2))
            await wait_for(lambda: "a slow job, not a sick worker" in caplog.text, timeout=60)
            sims.gate.set()
            reply = await call
            assert len(reply.images) == 1
            status = await gw.stub.GetStatus(pb.GetStatusRequest())
    assert "is suspect" not in caplog.text
    assert all(w.state == pb.WORKER_STATE_AVAILABLE for w in status.workers)
