"""Several gateways over one denoiser pool, with no shared state but the denoisers' own (real gateways in-process,
simulated workers on real gRPC servers).

Each denoiser is the authority on its one slot and publishes who holds it (WatchOccupancy); each gateway mirrors that
in its view of the pool, and a busy refusal because another gateway's job got there first goes to another denoiser at
once without counting as a failed attempt.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools

import grpc
import pytest
from prometheus_client import CollectorRegistry

from bench.sim_backends import SimAr, SimCosts, SimDenoiser, serve_sim_ar, serve_sim_denoiser
from gateway import workers
from gateway.metrics import GatewayMetrics
from gateway.scheduler.pool import Pool
from gateway.scheduler.types import WorkerRole
from glmimage.v1 import denoiser_service_pb2, denoiser_service_pb2_grpc
from runtime.details import ERROR_DOMAIN, error_info
from runtime.errors import DENOISER_BUSY
from tests.support.sim_gateway import BUSY, request, running_gateway, scrape, wait_for

pytestmark = pytest.mark.asyncio

COSTS = SimCosts(scale=0.002)  # denoise ~24 ms: long enough for the gateways to collide


@contextlib.asynccontextmanager
async def pool(denoisers: int):
    ar = await serve_sim_ar(SimAr(COSTS))
    dns = [await serve_sim_denoiser(SimDenoiser(COSTS)) for _ in range(denoisers)]
    try:
        yield f"127.0.0.1:{ar.port}", [f"127.0.0.1:{d.port}" for d in dns], [d.servicer for d in dns]
    finally:
        for server in (ar, *dns):
            await server.stop(None)


async def test_the_occupancy_stream_names_the_holder_and_a_refusal_says_who_and_when() -> None:
    gate = asyncio.Event()
    sim = SimDenoiser(COSTS, gate=gate)
    server = await serve_sim_denoiser(sim)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = denoiser_service_pb2_grpc.DenoiserServiceStub(channel)
        watch = stub.WatchOccupancy(denoiser_service_pb2.WatchOccupancyRequest())
        free = await watch.read()
        assert not free.busy and free.owner == "" and free.sequence > 0
        job = denoiser_service_pb2.DenoiseRequest(prior_tokens={"token_ids": [1, 2]}, height=32, width=32,
                                                  num_inference_steps=4, request_id="r1/0#1", owner="gw-a")
        running = asyncio.ensure_future(stub.Denoise(job))
        held = await watch.read()
        assert (held.busy, held.owner, held.request_id) == (True, "gw-a", "r1/0#1")
        assert held.sequence > free.sequence
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Denoise(denoiser_service_pb2.DenoiseRequest(
                prior_tokens={"token_ids": [1]}, height=32, width=32, owner="gw-b"))
        assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        reason, domain, meta = error_info(refused.value)
        assert (reason, domain, meta["owner"], int(meta["sequence"])) == (DENOISER_BUSY, ERROR_DOMAIN, "gw-a",
                                                                          held.sequence)
        gate.set()
        await running
        after = await watch.read()
        assert not after.busy and after.sequence > held.sequence
        watch.cancel()
    await server.stop(None)


async def test_a_gateway_sees_a_denoiser_another_gateway_holds_as_busy_and_sends_it_nothing() -> None:
    gate = asyncio.Event()
    ar = await serve_sim_ar(SimAr(COSTS))
    held, free = SimDenoiser(COSTS, gate=gate), SimDenoiser(COSTS)
    servers = [await serve_sim_denoiser(held), await serve_sim_denoiser(free)]
    addresses = [f"127.0.0.1:{s.port}" for s in servers]
    try:
        async with running_gateway([f"127.0.0.1:{ar.port}"], addresses[:1]) as a, \
                running_gateway([f"127.0.0.1:{ar.port}"], addresses) as b:
            first = asyncio.ensure_future(a.stub.GenerateImages(request(num_inference_steps=4)))
            status = await b.until(lambda s: any(w.held_elsewhere for w in s.workers))
            (w,) = [w for w in status.workers if w.held_elsewhere]
            assert w.address == addresses[0] and w.state == BUSY and w.current_job == ""
            for _ in range(3):  # every job of b goes to the free denoiser: no collision at all
                await b.stub.GenerateImages(request())
            assert b.driver.scheduler.counters.collisions == 0 and held.refused_busy == 0
            assert len(free.jobs) == 3
            gate.set()
            await first
            await b.until(lambda s: not any(w.held_elsewhere for w in s.workers))
    finally:
        for server in (ar, *servers):
            await server.stop(None)


class _Unwatched(SimDenoiser):
    """A denoiser from before the occupancy stream: its jobs show to other gateways only as refusals."""

    async def WatchOccupancy(self, request, context):
        raise NotImplementedError
        yield  # an async generator, like the real one


def instance_preferring(first: str, addresses: list[str]) -> str:
    """A gateway id whose own pick order (its seed) puts denoiser ``first`` before the others of ``addresses``."""
    for i in itertools.count():
        seed = f"gateway-{i}"
        pool = Pool(1, pick_seed=seed)
        if min(addresses, key=lambda a: pool.add(a, WorkerRole.DENOISER).rank) == first:
            return seed
    raise AssertionError("unreachable")


async def test_a_collision_goes_elsewhere_at_once_and_is_counted_not_failed() -> None:
    gate = asyncio.Event()
    ar = await serve_sim_ar(SimAr(COSTS))
    taken, other = _Unwatched(COSTS, gate=gate), SimDenoiser(COSTS)
    servers = [await serve_sim_denoiser(taken), await serve_sim_denoiser(other)]
    addresses = [f"127.0.0.1:{s.port}" for s in servers]
    registry = CollectorRegistry()
    try:
        async with running_gateway([f"127.0.0.1:{ar.port}"], addresses[:1]) as a, \
                running_gateway([f"127.0.0.1:{ar.port}"], addresses, metrics=GatewayMetrics(registry),
                                config_fields={"instance_id": instance_preferring(addresses[0], addresses)},
                                max_attempts=1) as b:
            first = asyncio.ensure_future(a.stub.GenerateImages(request(num_inference_steps=4)))
            await wait_for(lambda: taken.busy)
            # b cannot see a's job and tries the denoiser first in its order, then the other at once.
            reply = await b.stub.GenerateImages(request(), timeout=30)
            assert len(reply.images) == 1 and taken.refused_busy == 1 and len(other.jobs) == 1
            metrics = scrape(registry)
            assert metrics[("glmimage_gateway_denoise_collisions_total", ())] == 1
            assert metrics[("glmimage_gateway_denoise_dispatches_total", ())] == 2
            assert metrics[("glmimage_gateway_requeues_total", (("reason", "denoise_failed"),))] == 0
            gate.set()
            await first
    finally:
        for server in (ar, *servers):
            await server.stop(None)


@pytest.mark.parametrize("gateways", [2, 3])
async def test_gateways_over_three_denoisers_all_succeed_and_no_denoiser_holds_two_jobs(gateways: int) -> None:
    async with pool(3) as (ar, denoisers, sims):
        registries = [CollectorRegistry() for _ in range(gateways)]
        async with contextlib.AsyncExitStack() as stack:
            gws = [await stack.enter_async_context(running_gateway([ar], denoisers, metrics=GatewayMetrics(r)))
                   for r in registries]
            calls = [gw.stub.GenerateImages(request(n=1 + i % 3), timeout=60)
                     for i in range(12) for gw in gws]
            replies = await asyncio.gather(*calls)
            assert [len(r.images) for r in replies] == [1 + i % 3 for i in range(12) for _ in gws]
            images = sum(len(r.images) for r in replies)
            # Every image was made exactly once, and no denoiser ever ran two jobs at once.
            assert sum(sim.completed for sim in sims) == images
            assert all(sim.max_holding == 1 for sim in sims)
            collisions = sum(scrape(r)[("glmimage_gateway_denoise_collisions_total", ())] for r in registries)
            refused = sum(sim.refused_busy for sim in sims)
            assert collisions == refused  # each refusal reached its gateway as a collision, none as a failure
            failures = sum(scrape(r)[("glmimage_gateway_requeues_total", (("reason", "denoise_failed"),))]
                           for r in registries)
            assert failures == 0
            await wait_for(lambda: all(not w.held_elsewhere and w.current_job is None
                                       for gw in gws for w in gw.driver.snapshot().workers))


async def test_a_gateway_with_a_trickle_is_not_starved_by_one_with_a_backlog() -> None:
    # The gateway that just finished a job on a denoiser learns it first (its own call returns) and has more work:
    # the other one must still win denoisers while that backlog lasts, not only after it.
    async with pool(2) as (ar, denoisers, sims):
        async with running_gateway([ar], denoisers) as busy, running_gateway([ar], denoisers) as light:
            backlog = [asyncio.ensure_future(busy.stub.GenerateImages(request(n=2), timeout=60)) for _ in range(30)]
            await busy.until(lambda s: s.pending_denoise_outputs > 10)
            for _ in range(3):
                reply = await light.stub.GenerateImages(request(), timeout=60)
                assert len(reply.images) == 1
            left = sum(not f.done() for f in backlog)
            assert left > 0, "the light gateway got a denoiser only once the backlog was gone"
            await asyncio.gather(*backlog)
            assert all(sim.max_holding == 1 for sim in sims)



async def test_the_occupancy_mirror_outlives_an_exception_in_its_follower(monkeypatch: pytest.MonkeyPatch) -> None:
    follow, raised = workers.Worker._follow_occupancy, []

    def broken_once(self, feed, closed):
        def feed_once_broken(event, quiet=False):
            if not raised:
                raised.append(event)
                raise RuntimeError("a bug in the follower")
            feed(event, quiet)
        return follow(self, feed_once_broken, closed)

    gate = asyncio.Event()
    ar = await serve_sim_ar(SimAr(COSTS))
    held = SimDenoiser(COSTS, gate=gate)
    server = await serve_sim_denoiser(held)
    address = f"127.0.0.1:{server.port}"
    try:
        async with running_gateway([f"127.0.0.1:{ar.port}"], [address]) as a:
            monkeypatch.setattr(workers.Worker, "_follow_occupancy", broken_once)  # b's follower only
            async with running_gateway([f"127.0.0.1:{ar.port}"], [address]) as b:
                await wait_for(lambda: bool(raised))
                first = asyncio.ensure_future(a.stub.GenerateImages(request(num_inference_steps=4)))
                await b.until(lambda s: any(w.held_elsewhere for w in s.workers))  # the follower started over
                gate.set()
                await first
    finally:
        for s in (ar, server):
            await s.stop(None)
