"""The simulated AR server (bench/sim_backends.py) merges concurrent calls like the real one: calls of one resolution
that wait when a batch starts, or arrive within its merge window, run as one batch of the merged size within the
cap; a caller alone sees exactly the cost of its own batch, as before merging existed.

Wall-clock bounds here are lower bounds (a loaded machine only adds time) or upper ones with at least 3x margin
over a loaded 2-core machine; what merged is read from the simulator's own record of its batches."""
from __future__ import annotations

import asyncio
import time

import pytest

from bench.sim_backends import SimAr, SimCosts
from glmimage.v1 import ar_service_pb2

pytestmark = pytest.mark.asyncio

COSTS = SimCosts(scale=0.004)  # batch of 1: ~82 ms, of 16: ~118 ms
SLOW = SimCosts(scale=5.0)  # batch of 1: ~100 s, far past anything a test waits for


def batch(outputs: int, height: int = 1024, **kw: object) -> ar_service_pb2.GenerateBatchRequest:
    return ar_service_pb2.GenerateBatchRequest(requests=[
        ar_service_pb2.GenerateRequest(prompt="a sign", n=outputs, height=height, width=1024, **kw)])


async def until(condition, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.001)


async def timed(sim: SimAr, outputs: int, **kw: object) -> float:
    t0 = time.monotonic()
    reply = await sim.GenerateBatch(batch(outputs, **kw), None)
    assert len(reply.responses[0].outputs) == outputs
    return time.monotonic() - t0


async def test_one_caller_runs_its_batches_one_by_one_at_their_own_cost() -> None:
    sim = SimAr(COSTS)
    for outputs in (1, 8, 28):
        took = await timed(sim, outputs)
        assert took >= COSTS.ar(outputs) * 0.99
    assert sim.batches == [1, 8, 28] and sim.merged_calls == 0


async def test_concurrent_calls_of_one_resolution_run_as_one_batch_of_the_merged_size() -> None:
    sim = SimAr(COSTS, cap=28)
    took = await asyncio.gather(*(timed(sim, 8) for _ in range(3)))
    # One batch, not three one after another (its wall time would say so only by a 2.5x margin or less).
    assert sim.batches == [24] and sim.calls == 3 and sim.merged_calls == 2
    assert min(took) >= COSTS.ar(24) * 0.99


async def test_a_call_arriving_within_the_window_joins_a_batch_already_started() -> None:
    sim = SimAr(COSTS, merge_window=0.3)  # wide: on a loaded machine the second call may come some ms late
    first = asyncio.ensure_future(timed(sim, 4))
    await asyncio.wait_for(sim.window_open.wait(), 10)  # the first call leads a batch, its window open
    await asyncio.gather(first, timed(sim, 4))
    assert sim.batches == [8] and sim.merged_calls == 1


async def test_calls_waiting_behind_a_batch_merge_when_it_ends_and_the_cap_holds() -> None:
    sim = SimAr(COSTS, cap=28, merge_window=0.0)
    running = asyncio.ensure_future(timed(sim, 28))
    await until(lambda: sim.batches == [28])  # it runs: the next calls wait behind it
    waiting = [asyncio.ensure_future(timed(sim, n)) for n in (20, 20, 8)]
    await asyncio.gather(running, *waiting)
    # 20 + 20 does not fit in 28: the first 20 leads and takes the 8; the second 20 runs next.
    assert sim.batches == [28, 28, 20] and sim.merged_calls == 1


async def test_other_resolutions_and_edits_never_merge() -> None:
    sim = SimAr(COSTS)
    await asyncio.gather(timed(sim, 2), timed(sim, 2, height=512),
                         timed(sim, 2, reference_images=[{"data": b"x"}]))
    assert sorted(sim.batches) == [2, 2, 2] and sim.merged_calls == 0


async def test_a_batch_every_caller_left_stops_at_once() -> None:
    sim = SimAr(SLOW)
    call = asyncio.ensure_future(timed(sim, 1))
    await until(lambda: sim.batches == [1])
    call.cancel()
    nxt = asyncio.ensure_future(timed(sim, 1))
    # The engine takes the next call at once, not after the abandoned batch's ~100 s.
    await until(lambda: sim.batches == [1, 1], timeout=10)
    nxt.cancel()
    await asyncio.gather(call, nxt, return_exceptions=True)


async def test_a_phase_holds_the_first_batch_only() -> None:
    phase = 1.0  # the second call alone takes ~82 ms, 0.17 s seen with both cores busy: well under it
    sim = SimAr(COSTS, phase=phase)
    first = await timed(sim, 1)
    second = await timed(sim, 1)
    assert first >= COSTS.ar(1) + phase * 0.99 and second < phase
