"""The denoiser as a real process: SERVING after warm-up, and SIGTERM drains the running job, then exits 0."""
from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from glmimage.v1 import common_pb2, denoiser_service_pb2_grpc
from glmimage.v1 import denoiser_service_pb2 as pb
from tests.support import forkserver

pytestmark = pytest.mark.e2e
log = logging.getLogger(__name__)

SERVICE = "glmimage.v1.DenoiserService"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
STEPS = 60  # at 64x64 about 0.4 s on an idle CPU: still running when SIGTERM lands, yet short when loaded


async def _wait_for(predicate, proc: subprocess.Popen, what: str, timeout: float = 120.0) -> None:
    """Poll a condition the child process brings about, failing at once if the child dies."""
    async with asyncio.timeout(timeout):
        while not predicate():
            assert proc.poll() is None, f"denoiser exited with {proc.returncode} while waiting for {what}"
            await asyncio.sleep(0.05)


async def _next_status(watch) -> int:
    return (await watch.read()).status


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return response.read().decode()


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} not exported"
    return float(match.group(1))


async def test_sigterm_finishes_the_running_job_then_exits_zero(tiny_checkpoint: Path, tmp_path: Path) -> None:
    port_file, log_file = tmp_path / "port", tmp_path / "denoiser.log"
    # GLMIMAGE_CACHE (set by tiny_checkpoint) leads the child to the same model.
    proc = forkserver.spawn([sys.executable, "-m", "services.denoiser", "--port", "0", "--port-file", str(port_file),
                             "--metrics-port", "0", "--png-compress-level", "0", "--drain-seconds", "120"],
                            log_file, dict(os.environ))
    try:
        await _wait_for(port_file.exists, proc, "the port file")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port_file.read_text()}") as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=SERVICE))
            status = await _next_status(watch)
            while status != SERVING:  # NOT_SERVING through the warm-up
                assert status == NOT_SERVING
                status = await _next_status(watch)
            # The metrics endpoint is announced before SERVING, so its log line is there by now.
            metrics_port = int(re.search(r"metrics on http://[\d.]+:(\d+)/metrics", log_file.read_text())[1])

            job = pb.DenoiseRequest(prompt='a "STOP" sign', height=64, width=64, num_inference_steps=STEPS, seed=3,
                                    prior_tokens=common_pb2.TokenRow(token_ids=list(range(16))))
            stream = denoiser_service_pb2_grpc.DenoiserServiceStub(channel).DenoiseStream(
                pb.DenoiseStreamRequest(job=job))
            assert (await stream.read()).progress.step == 1
            assert _metric(await asyncio.to_thread(_scrape, metrics_port), "glmimage_denoiser_busy") == 1

            proc.send_signal(signal.SIGTERM)
            assert await _next_status(watch) == NOT_SERVING  # draining: the gateway stops sending work
            watch.cancel()  # an open Watch would itself hold the drain for its whole grace period
            events = []
            while (event := await stream.read()) is not grpc.aio.EOF:  # read() once used, iteration is barred
                events.append(event)
        result = events[-1].result
        assert result.steps_completed == STEPS and len(events) == STEPS  # steps 2..STEPS, then the result
        assert result.image[result.image.index(b"IDAT") + 5] >> 6 == 0  # zlib FLEVEL 0: --png-compress-level 0
        assert await asyncio.to_thread(proc.wait, 60) == 0
        log_text = log_file.read_text()
        # The job really was in flight when the drain began: it finished after the signal was handled.
        assert log_text.index("shutdown requested") < log_text.index(f"denoised 64x64 in {STEPS} step(s)")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.info("denoiser output:\n%s", log_file.read_text())  # shown by pytest when the test fails
