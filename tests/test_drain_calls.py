"""A draining worker's calls complete and count (issue 32): the gateway hears a drained worker go away (its health
stream ends as the process exits) a moment after its last reply went out, and that reply may still be on its way
through the gateway's loop. The call decides, not the health event: a finished AR batch used to be failed with
503 "it went away" 6 ms after the AR had logged it done. Driven here through the driver's own health feed, so the
order of the two (the race a real restart hits now and then) is the one that used to fail, every time."""
from __future__ import annotations

import asyncio
import time

from gateway.scheduler import types as sch
from gateway.scheduler.types import SchedulerConfig
from glmimage.v1 import gateway_service_pb2 as pb
from tests.test_gateway import running_gateway


async def test_an_ar_batch_finished_as_its_draining_ar_goes_away_is_answered(ar_server, denoiser_server) -> None:
    # Fail-fast as the gateway runs by default: the only AR gone would fail the request at once.
    scheduler = SchedulerConfig(fail_fast_without_workers=True)
    async with running_gateway(ar_server, (denoiser_server,), scheduler) as (stub, driver):
        call = asyncio.ensure_future(stub.GenerateImages(
            pb.GenerateImagesRequest(prompt="drain", n=2, height=64, width=64, seed=3), timeout=60))
        async with asyncio.timeout(30):
            while not driver._ar_calls:  # the batch is on the AR
                await asyncio.sleep(0.001)
        address = f"127.0.0.1:{ar_server.port}"
        # SIGTERM: NOT_SERVING; then the drained process exits and its health stream ends, before the gateway has
        # read the batch's reply.
        driver._from_watch(sch.WorkerNotServing(now=time.monotonic(), worker=address))
        driver._from_watch(sch.WorkerUnhealthy(now=time.monotonic(), worker=address, why=sch.WorkerDown.GONE))
        reply = await call
        assert [img.index for img in reply.images] == [0, 1]
        assert driver.scheduler.counters.failed == {} or not any(driver.scheduler.counters.failed.values())
