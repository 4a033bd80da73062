"""The simulated AR server (bench/sim_backends.py) merges concurrent calls like the real one: calls of one resolution
that wait when a batch starts, or arrive within its merge window, run as one batch of the merged size within the
cap; a caller alone sees exactly the cost of its own batch, as before merging existed."""
from __future__ import annotations

import asyncio
import time

import pytest

from bench.sim_backends import SimAr, SimCosts, ar_batch_seconds
from glmimage.v1 import ar_service_pb2

pytestmark = pytest.mark.asyncio

COSTS = SimCosts(scale=0.004)  # batch of 1: ~82 ms, of 16: ~118 ms


def batch(outputs: int, height: int = 1024, **kw: object) -> ar_service_pb2.GenerateBatchRequest:
    return ar_service_pb2.GenerateBatchRequest(requests=[
        ar_service_pb2.GenerateRequest(prompt="a sign", n=outputs, height=height, width=1024, **kw)])


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
    assert sim.batches == [24] and sim.calls == 3 and sim.merged_calls == 2
    assert max(took) < COSTS.ar(24) + COSTS.ar(1)  # one batch, not three one after another


async def test_a_call_arriving_within_the_window_joins_a_batch_already_started() -> None:
    sim = SimAr(COSTS, merge_window=0.03)
    first = asyncio.ensure_future(timed(sim, 4))
    await asyncio.sleep(0.01)
    await asyncio.gather(first, timed(sim, 4))
    assert sim.batches == [8]


async def test_calls_waiting_behind_a_batch_merge_when_it_ends_and_the_cap_holds() -> None:
    sim = SimAr(COSTS, cap=28, merge_window=0.0)
    running = asyncio.ensure_future(timed(sim, 28))
    await asyncio.sleep(0.01)
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
    sim = SimAr(SimCosts(scale=0.05))  # ~1 s batch
    call = asyncio.ensure_future(timed(sim, 1))
    await asyncio.sleep(0.02)
    call.cancel()
    took = await timed(sim, 1)  # the engine is free again at once, not after the abandoned second
    assert took < ar_batch_seconds(1) * 0.05 * 1.5
    assert sim.batches == [1, 1]


async def test_a_phase_holds_the_first_batch_only() -> None:
    sim = SimAr(COSTS, phase=0.05)
    first = await timed(sim, 1)
    second = await timed(sim, 1)
    assert first >= COSTS.ar(1) + 0.05 * 0.99 and second < COSTS.ar(1) + 0.05
