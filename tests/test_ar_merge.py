"""Concurrent AR calls (several gateways) of one resolution share one model batch, each getting its own results."""
from __future__ import annotations

import asyncio

import grpc
import pytest
from prometheus_client import REGISTRY

from glmimage.v1 import ar_service_pb2 as pb
from glmimage.v1 import ar_service_pb2_grpc
from runtime.executor import SerialExecutor
from tests.support.servers import serve_ar
from tests.test_ar_queue import Blocker


@pytest.fixture(scope="module")
async def ar_stack(ar_engine):
    executor = SerialExecutor("test-ar-merge")
    server = await serve_ar(ar_engine, executor)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield server.servicer, ar_service_pb2_grpc.ArServiceStub(channel)
    await server.stop(None)
    executor.shutdown()


def sample(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


def counts() -> tuple[float, float]:
    return sample("glmimage_ar_batch_size_count"), sample("glmimage_ar_merged_calls_total")


def call(*reqs: tuple[str, int, int, int]) -> pb.GenerateBatchRequest:
    """(prompt, n, side, seed) per request."""
    return pb.GenerateBatchRequest(requests=[pb.GenerateRequest(prompt=p, n=n, height=side, width=side, seed=seed)
                                             for p, n, side, seed in reqs])


async def behind_a_busy_model(servicer, ar, calls: list[pb.GenerateBatchRequest], *, errors: bool = False) -> list:
    """Queue `calls` while the model is held, then let them all run; returns their responses."""
    blocker = Blocker()
    busy = asyncio.ensure_future(servicer.admission.run(blocker))
    await blocker.wait_started()
    futures = [asyncio.ensure_future(ar.GenerateBatch(c)) for c in calls]
    await servicer.admission.wait_for(lambda q: q.waiting == len(calls))
    blocker.release.set()
    await busy
    return await asyncio.gather(*futures, return_exceptions=errors)


async def test_calls_of_one_resolution_share_one_batch_and_match_their_alone_results(ar_stack) -> None:
    servicer, ar = ar_stack
    calls = [call(("a cat", 2, 64, 1), ("a dog", 1, 64, 7)), call(("a red sign", 1, 64, 3)),
             call(("a boat", 1, 128, 5))]  # another resolution: its own batch
    batches, merged = counts()
    responses = await behind_a_busy_model(servicer, ar, calls)
    assert counts() == (batches + 2, merged + 1)
    assert [[len(r.outputs) for r in resp.responses] for resp in responses] == [[2, 1], [1], [1]]
    assert responses[0].responses[1].outputs[0].seed == 7
    # Rows are independent (per-row seeded sampling): merged results are exactly those of each call alone.
    for c, resp in zip(calls, responses, strict=True):
        assert list((await ar.GenerateBatch(c)).responses) == list(resp.responses)
    assert all(r.queue_seconds > 0 for r in responses)  # each waited behind the busy model, and says so


async def test_the_cap_splits_calls_that_do_not_fit_together(ar_stack) -> None:
    servicer, ar = ar_stack
    cap = servicer.engine.limits.max_batch_outputs
    big = call(*[(f"big {i}", 10, 64, i) for i in range(3)])  # 30 rows
    assert 30 + 4 > cap >= 30 + 2
    calls = [big, call(("too many", 4, 64, 1)), call(("fits", 2, 64, 2))]
    batches, merged = counts()
    rows = sample("glmimage_ar_batch_size_sum")
    responses = await behind_a_busy_model(servicer, ar, calls)
    assert counts() == (batches + 2, merged + 1)  # big + fits, then too many alone
    assert sample("glmimage_ar_batch_size_sum") == rows + 36
    assert [sum(len(r.outputs) for r in resp.responses) for resp in responses] == [30, 4, 2]


async def test_a_call_cancelled_mid_batch_leaves_the_others_rows_intact(ar_stack) -> None:
    servicer, ar = ar_stack
    kept_call = call(("kept", 1, 256, 11))
    blocker = Blocker()
    busy = asyncio.ensure_future(servicer.admission.run(blocker))
    await blocker.wait_started()
    batches, merged = counts()
    cancelled = REGISTRY.get_sample_value("glmimage_ar_requests_total", {"outcome": "cancelled"}) or 0.0
    gone = ar.GenerateBatch(call(("gone", 1, 256, 10)))
    await servicer.admission.wait_for(lambda q: q.waiting == 1)
    kept = asyncio.ensure_future(ar.GenerateBatch(kept_call))
    await servicer.admission.wait_for(lambda q: q.waiting == 2)
    blocker.release.set()
    await busy
    await servicer.admission.wait_for(lambda q: q.busy and servicer.current is not None)
    control = servicer.current
    assert await asyncio.to_thread(control.stepped.wait, 30)
    gone.cancel()
    resp = await kept
    assert not control.cancel.is_set()  # the batch ran on for the call still waiting
    assert counts() == (batches + 1, merged + 1)
    assert REGISTRY.get_sample_value("glmimage_ar_requests_total", {"outcome": "cancelled"}) == cancelled + 1
    assert list(resp.responses) == list((await ar.GenerateBatch(kept_call)).responses)


class Failing:
    """The tiny engine's validation and limits, but a model batch that fails."""

    def __init__(self, engine) -> None:
        self.limits = engine.limits
        self.validate = engine.validate

    def generate(self, requests, control=None):
        raise RuntimeError("the model failed")


async def test_a_failed_merged_batch_fails_each_of_its_calls(ar_engine) -> None:
    executor = SerialExecutor("test-ar-merge-fail")
    server = await serve_ar(Failing(ar_engine), executor)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            ar = ar_service_pb2_grpc.ArServiceStub(channel)
            batches, merged = counts()
            results = await behind_a_busy_model(server.servicer, ar, [call(("x", 1, 64, 1)), call(("y", 1, 64, 2))],
                                                errors=True)
            assert all(isinstance(r, grpc.aio.AioRpcError) for r in results)
            assert [r.code() for r in results] == [grpc.StatusCode.INTERNAL] * 2
            assert counts() == (batches + 1, merged + 1)
    finally:
        await server.stop(None)
        executor.shutdown()
