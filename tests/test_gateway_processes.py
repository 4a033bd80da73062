"""The gateway over real denoisers (tiny model): fan-out, a denoiser SIGKILLed mid-job, and its restart.

The AR and two denoisers are the in-process session servers; the third denoiser is a `python -m services.denoiser`
process, so it can really die. Jobs are made long (many steps) only so the test can see them running; nothing
sleeps a fixed time.
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from gateway.config import GatewayConfig
from gateway.driver import Driver
from gateway.scheduler.types import SchedulerConfig
from gateway.servicer import GatewayServicer
from glmimage.v1 import gateway_service_pb2 as pb
from glmimage.v1 import gateway_service_pb2_grpc
from runtime.server import start_server
from tests.support import forkserver

pytestmark = pytest.mark.e2e

# (150 steps: each job holds its denoiser for seconds, so the status polls see the three at once even on a loaded
# machine whose event loop a poll may wait on; at 60 a CI run saw the request end before any poll caught all three)
LONG = {"prompt": 'a "SLOW" sign', "height": 64, "width": 64, "num_inference_steps": 150}


class DenoiserProcess:
    def __init__(self, workdir: Path, name: str) -> None:
        self.port_file, self.log = workdir / f"{name}.port", workdir / f"{name}.log"
        self.port = 0
        self.proc: subprocess.Popen | forkserver.Forked | None = None

    def start(self) -> None:
        self.port_file.unlink(missing_ok=True)
        self.proc = forkserver.spawn(
            [sys.executable, "-m", "services.denoiser", "--port", str(self.port), "--port-file", str(self.port_file),
             "--torch-threads", "1", "--log-level", "WARNING"], self.log, dict(os.environ))

    async def bound(self) -> str:
        async with asyncio.timeout(120):
            while not self.port_file.exists():
                assert self.proc.poll() is None, "the denoiser exited during start-up"
                await asyncio.sleep(0.05)
        self.port = int(self.port_file.read_text())
        return self.address

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()


@pytest.fixture
async def pool(tiny_checkpoint: Path, ar_server, denoiser_server, second_denoiser_server,
               tmp_path: Path) -> AsyncIterator[tuple]:
    """Two in-process denoisers (session fixtures) and one denoiser process, the one that gets killed."""
    assert os.environ.get("GLMIMAGE_CACHE")  # set by tiny_checkpoint: the child loads the same checkpoint
    victim = DenoiserProcess(tmp_path, "victim")
    victim.start()
    try:
        addresses = [f"127.0.0.1:{denoiser_server.port}", f"127.0.0.1:{second_denoiser_server.port}",
                     await victim.bound()]
        config = GatewayConfig(ar_addresses=(f"127.0.0.1:{ar_server.port}",), denoiser_addresses=tuple(addresses),
                               scheduler=SchedulerConfig(ar_batch_delay=0.0), request_timeout=120)
        driver = Driver(config)
        servicer = GatewayServicer(driver, config)
        server = await start_server(
            lambda s: gateway_service_pb2_grpc.add_GatewayServiceServicer_to_server(servicer, s),
            ["glmimage.v1.GatewayService"], "127.0.0.1:0")
        await driver.start()
        await server.set_serving(True)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            yield gateway_service_pb2_grpc.GatewayServiceStub(channel), victim
        await server.stop(None)
        await driver.close()
    finally:
        victim.kill()


async def until(stub, predicate, timeout: float = 120.0) -> pb.GetStatusResponse:
    async with asyncio.timeout(timeout):
        while not predicate(status := await stub.GetStatus(pb.GetStatusRequest())):
            await asyncio.sleep(0.01)
    return status


def states(status: pb.GetStatusResponse) -> dict[str, int]:
    return {w.address: w.state for w in status.workers if w.role == pb.WORKER_ROLE_DENOISER}


async def test_fan_out_sigkill_mid_job_and_restart(pool) -> None:
    stub, victim = pool
    await until(stub, lambda s: list(states(s).values()).count(pb.WORKER_STATE_AVAILABLE) == 3)

    # n=3 runs on the three denoisers at once.
    call = asyncio.ensure_future(stub.GenerateImages(pb.GenerateImagesRequest(n=3, seed=1, **LONG)))
    status = await until(stub, lambda s: list(states(s).values()).count(pb.WORKER_STATE_BUSY) == 3 or call.done())
    jobs = {w.address: w.current_job for w in status.workers if w.current_job}
    assert sorted(j.split("/")[1] for j in jobs.values()) == ["0#1", "1#1", "2#1"]

    # SIGKILL the denoiser process mid-job: its output is requeued and the request still succeeds elsewhere.
    victim.kill()
    resp = await call
    assert [i.seed for i in resp.images] == [1, 2, 3]
    status = await until(stub, lambda s: states(s)[victim.address] == pb.WORKER_STATE_UNHEALTHY)

    # Restarted on the same address, it is picked up again and gets work.
    victim.start()
    await victim.bound()
    await until(stub, lambda s: states(s)[victim.address] == pb.WORKER_STATE_AVAILABLE)
    call = asyncio.ensure_future(stub.GenerateImages(pb.GenerateImagesRequest(n=3, seed=4, **LONG)))
    status = await until(stub, lambda s: states(s)[victim.address] == pb.WORKER_STATE_BUSY or call.done())
    assert {w.address: w.current_job for w in status.workers}[victim.address].endswith("#1")
    assert len((await call).images) == 3
