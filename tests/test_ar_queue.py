"""Admission to the AR model: FIFO, one at a time, and callers that leave are dropped before their batch starts."""
from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest
from prometheus_client import REGISTRY

from glmimage.v1 import ar_service_pb2 as pb
from glmimage.v1 import ar_service_pb2_grpc
from runtime.errors import DeadlineExceeded, ResourceExhausted
from runtime.executor import SerialExecutor
from services.ar.batcher import AdmissionQueue
from tests.support.servers import serve_ar


class Blocker:
    """A job for the worker thread that runs until released; `started` is set once it holds the thread."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        self.finished = False

    def __call__(self) -> str:
        self.started.set()
        assert self.release.wait(30), "test never released the blocker"
        self.finished = True
        return "blocker"

    async def wait_started(self) -> None:
        assert await asyncio.to_thread(self.started.wait, 30)


@pytest.fixture
def queue():
    executor = SerialExecutor("test-admission")
    yield AdmissionQueue(executor)
    executor.shutdown()


async def test_calls_run_one_at_a_time_in_arrival_order(queue) -> None:
    order: list[str] = []
    blocker = Blocker()
    first = asyncio.ensure_future(queue.run(blocker))
    await blocker.wait_started()
    later = [asyncio.ensure_future(queue.run(order.append, name)) for name in ("b", "c", "d")]
    await queue.wait_for(lambda q: q.waiting == 3)
    assert order == [] and queue.busy
    blocker.release.set()
    assert await first == "blocker"
    await asyncio.gather(*later)
    assert order == ["b", "c", "d"]
    await queue.wait_for(lambda q: not q.busy)


async def test_a_cancelled_waiter_leaves_the_queue_without_running(queue) -> None:
    ran: list[str] = []
    blocker = Blocker()
    first = asyncio.ensure_future(queue.run(blocker))
    await blocker.wait_started()
    waiter = asyncio.ensure_future(queue.run(ran.append, "cancelled"))
    behind = asyncio.ensure_future(queue.run(ran.append, "behind"))
    await queue.wait_for(lambda q: q.waiting == 2)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert queue.waiting == 1
    blocker.release.set()
    await first
    await behind
    assert ran == ["behind"]


async def test_a_waiter_past_its_deadline_leaves_the_queue_without_running(queue) -> None:
    ran: list[str] = []
    blocker = Blocker()
    first = asyncio.ensure_future(queue.run(blocker))
    await blocker.wait_started()
    with pytest.raises(DeadlineExceeded):
        await queue.run(ran.append, "late", deadline=time.monotonic() + 0.05)
    assert queue.waiting == 0 and queue.busy
    blocker.release.set()
    await first
    assert ran == []
    await queue.wait_for(lambda q: not q.busy)


async def test_the_slot_is_held_until_an_abandoned_run_really_returns(queue) -> None:
    blocker = Blocker()
    first = asyncio.ensure_future(queue.run(blocker))
    await blocker.wait_started()
    first.cancel()  # the caller leaves mid-run; the worker thread cannot be interrupted
    with pytest.raises(asyncio.CancelledError):
        await first
    assert queue.busy
    seen: list[bool] = []
    nxt = asyncio.ensure_future(queue.run(lambda: seen.append(blocker.finished)))
    await queue.wait_for(lambda q: q.waiting == 1)
    blocker.release.set()
    await nxt
    assert seen == [True]  # the next call started only after the abandoned one finished


async def test_a_full_queue_refuses_with_resource_exhausted() -> None:
    executor = SerialExecutor("test-admission-full")
    queue = AdmissionQueue(executor, max_waiting=1)
    blocker = Blocker()
    first = asyncio.ensure_future(queue.run(blocker))
    await blocker.wait_started()
    second = asyncio.ensure_future(queue.run(lambda: "second"))
    await queue.wait_for(lambda q: q.waiting == 1)
    with pytest.raises(ResourceExhausted, match="--max-queue"):
        await queue.run(lambda: "third")
    blocker.release.set()
    assert (await first, await second) == ("blocker", "second")
    executor.shutdown()


# --- the same through a real ArService on the tiny model ---

@pytest.fixture(scope="module")
async def ar_stack(ar_engine):
    executor = SerialExecutor("test-ar-queue")
    server = await serve_ar(ar_engine, executor)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield server.servicer, ar_service_pb2_grpc.ArServiceStub(channel)
    await server.stop(None)
    executor.shutdown()


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels or None) or 0.0


REQ = pb.GenerateRequest(prompt="queued", height=64, width=64, seed=1)


async def test_queued_call_past_its_deadline_is_dropped_before_its_batch(ar_stack) -> None:
    servicer, ar = ar_stack
    batches = sample("glmimage_ar_batch_size_count")
    expired = sample("glmimage_ar_requests_total", outcome="deadline_exceeded")
    blocker = Blocker()
    busy = asyncio.ensure_future(servicer.admission.run(blocker))
    await blocker.wait_started()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await ar.Generate(REQ, timeout=0.3)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await servicer.admission.wait_for(lambda q: q.waiting == 0)
    blocker.release.set()
    await busy
    await servicer.admission.wait_for(lambda q: not q.busy)
    assert sample("glmimage_ar_batch_size_count") == batches  # the model never saw it
    assert sample("glmimage_ar_requests_total", outcome="deadline_exceeded") == expired + 1


async def test_cancelled_queued_call_is_dropped_and_the_next_one_runs(ar_stack) -> None:
    servicer, ar = ar_stack
    batches = sample("glmimage_ar_batch_size_count")
    cancelled = sample("glmimage_ar_requests_total", outcome="cancelled")
    blocker = Blocker()
    busy = asyncio.ensure_future(servicer.admission.run(blocker))
    await blocker.wait_started()
    dropped = ar.Generate(REQ)
    await servicer.admission.wait_for(lambda q: q.waiting == 1)
    assert sample("glmimage_ar_queue_depth") == 1
    kept = asyncio.ensure_future(ar.Generate(REQ))
    await servicer.admission.wait_for(lambda q: q.waiting == 2)
    dropped.cancel()
    await servicer.admission.wait_for(lambda q: q.waiting == 1)
    blocker.release.set()
    await busy
    resp = await kept
    assert len(resp.outputs) == 1
    assert sample("glmimage_ar_batch_size_count") == batches + 1  # only the call still waited for ran
    assert sample("glmimage_ar_requests_total", outcome="cancelled") == cancelled + 1
    assert sample("glmimage_ar_queue_depth") == 0


async def test_cancelling_a_running_batch_stops_it_early(ar_stack) -> None:
    servicer, ar = ar_stack
    call = ar.Generate(pb.GenerateRequest(prompt="stop me", n=2, height=256, width=256, seed=1))
    await servicer.admission.wait_for(lambda q: q.busy)
    control = servicer.current
    assert control is not None
    assert await asyncio.to_thread(control.stepped.wait, 30)
    call.cancel()
    await servicer.admission.wait_for(lambda q: not q.busy)
    assert 0 < control.steps_done < 16 * 16 + 8 * 8 + 1  # stopped at a step boundary, not at the end
    # The model is left in a clean state: the next call is correct and deterministic.
    again = await ar.Generate(REQ)
    assert again == await ar.Generate(REQ)
