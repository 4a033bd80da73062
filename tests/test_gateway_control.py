"""GatewayService beyond unary generation: streaming, status, membership (admin RPCs and DNS), metrics, auth.

The gateway is the real one (driver, scheduler, servicer on a real gRPC server); the AR and denoisers are the
simulated servers of bench/sim_backends.py (real gRPC servers with health) so a test can hold a job at a known
step (the gate) and look at the gateway meanwhile (tests/support/sim_gateway.py). Nothing sleeps a fixed time:
tests wait on conditions.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client import CollectorRegistry, generate_latest

from bench.sim_backends import SimDenoiser, serve_sim_denoiser
from gateway.auth import api_keys_from
from gateway.config import GatewayConfig
from gateway.driver import Driver
from gateway.membership import DnsMembership, join_host_port, resolve, split_host_port
from gateway.metrics import GatewayMetrics
from gateway.scheduler.types import SchedulerConfig, WorkerRole
from gateway.workers import WorkerHealth
from glmimage.v1 import denoiser_service_pb2_grpc
from glmimage.v1 import gateway_service_pb2 as pb
from runtime.admission import Admitted
from runtime.logs import RequestIdFilter, request_id_var
from tests.support.sim_gateway import (
    ADMIN,
    AVAILABLE,
    BUSY,
    DRAINING,
    FAST,
    GATEWAY,
    Gateway,
    SimCluster,
    request,
    rpc_error,
    running_gateway,
    scrape,
    sim_cluster,
    wait_for,
)


@pytest.fixture
async def cluster() -> AsyncIterator[SimCluster]:
    async with sim_cluster() as c:
        yield c


@pytest.fixture
async def gateway(cluster: SimCluster) -> AsyncIterator[Gateway]:
    async with running_gateway([cluster.address(cluster.ar)], [cluster.address(d) for d in cluster.denoisers],
                               max_queued_outputs=8) as gw:
        yield gw


# ---- streaming -----------------------------------------------------------------------------------------------


async def test_stream_relays_progress_and_previews_per_image_then_completes(gateway: Gateway) -> None:
    call = gateway.stub.GenerateImagesStream(
        pb.GenerateImagesStreamRequest(request=request(n=2, num_inference_steps=4), partial_images=2))
    events = [e async for e in call]
    *streamed, last = events
    assert last.WhichOneof("event") == "completed"
    for index in (0, 1):
        steps = [e.progress.step for e in streamed
                 if e.WhichOneof("event") == "progress" and e.progress.image_index == index]
        assert steps == [1, 2, 3, 4]
        assert all(e.progress.total_steps == 4 for e in streamed if e.WhichOneof("event") == "progress")
        previews = [e.partial_image for e in streamed
                    if e.WhichOneof("event") == "partial_image" and e.partial_image.image_index == index]
        assert [p.partial_image_index for p in previews] == [0, 1]
        assert all(p.image.startswith(b"\x89PNG") for p in previews)
    done = last.completed
    assert [i.index for i in done.images] == [0, 1] and [i.seed for i in done.images] == [7, 8]
    assert done.usage.prompt_tokens == sum(i.usage.prompt_tokens for i in done.images) > 0
    # The AR's cached_tokens are carried as reported (summed); only the REST front hides them.
    assert done.usage.cached_tokens == 10 and all(i.usage.cached_tokens == 5 for i in done.images)


async def test_stream_progress_never_goes_back_when_a_job_is_retried_elsewhere(gateway: Gateway,
                                                                                cluster: SimCluster) -> None:
    cluster.gate.clear()
    call = gateway.stub.GenerateImagesStream(pb.GenerateImagesStreamRequest(
        request=request(num_inference_steps=4), partial_images=1))
    events = [await call.read()]
    assert events[0].progress.step == 1
    (victim,) = [d for d in cluster.denoisers if d.servicer.busy]
    await victim.stop(None)  # the job dies after step 1 and is retried on another denoiser, from its step 1
    await wait_for(lambda: any(d.servicer.busy for d in cluster.denoisers if d is not victim))
    cluster.gate.set()
    while (event := await call.read()) is not grpc.aio.EOF:
        events.append(event)
    steps = [e.progress.step for e in events if e.WhichOneof("event") == "progress"]
    assert steps == [1, 2, 3, 4]  # the retry's own step 1 is not shown again
    assert [e.partial_image.partial_image_index for e in events if e.WhichOneof("event") == "partial_image"] == [0]
    assert events[-1].WhichOneof("event") == "completed"


class UnaryOnlyDenoiser(SimDenoiser):
    """An older denoiser build, before DenoiseStream: the generated base class answers UNIMPLEMENTED."""

    DenoiseStream = denoiser_service_pb2_grpc.DenoiserServiceServicer.DenoiseStream


async def test_stream_falls_back_to_unary_on_a_denoiser_without_the_streaming_rpc(cluster: SimCluster) -> None:
    old = await serve_sim_denoiser(UnaryOnlyDenoiser(FAST))
    try:
        async with running_gateway([cluster.address(cluster.ar)], [cluster.address(old)]) as gw:
            call = gw.stub.GenerateImagesStream(pb.GenerateImagesStreamRequest(request=request(n=2),
                                                                               partial_images=1))
            events = [e async for e in call]
            assert [e.WhichOneof("event") for e in events] == ["completed"]  # no progress, but the images
            assert [i.seed for i in events[0].completed.images] == [7, 8]
            assert old.servicer.completed == 2
    finally:
        await old.stop(None)


async def test_request_ids_that_collide_with_renamed_duplicates_all_complete(gateway: Gateway,
                                                                              cluster: SimCluster) -> None:
    cluster.gate.clear()  # all three stay in flight together
    calls = []
    for k, (seed, rid) in enumerate(((1, "abc.1"), (2, "abc"), (3, "abc")), 1):  # the third must not be "abc.1"
        calls.append(asyncio.ensure_future(gateway.stub.GenerateImages(
            pb.GenerateImagesRequest(prompt="x", height=64, width=64, seed=seed),
            metadata=(("x-request-id", rid),), timeout=10)))
        await gateway.until(lambda s, k=k: s.active_requests == k)
    cluster.gate.set()
    replies = await asyncio.gather(*calls)
    assert [r.images[0].seed for r in replies] == [1, 2, 3]


async def test_stream_validates_partial_images(gateway: Gateway) -> None:
    err = await rpc_error(gateway.stub.GenerateImagesStream(
        pb.GenerateImagesStreamRequest(request=request(), partial_images=4)).read())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith("partial_images:")
    err = await rpc_error(gateway.stub.GenerateImagesStream(
        pb.GenerateImagesStreamRequest(request=pb.GenerateImagesRequest(prompt=" "))).read())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith("prompt:")


async def test_stream_client_going_away_cancels_the_job(gateway: Gateway, cluster: SimCluster) -> None:
    cluster.gate.clear()
    call = gateway.stub.GenerateImagesStream(pb.GenerateImagesStreamRequest(request=request(num_inference_steps=4)))
    first = await call.read()
    assert first.progress.step == 1
    (sim,) = [s for s in cluster.sims if s.busy]
    call.cancel()
    await wait_for(lambda: not sim.busy)
    assert sim.cancelled == 1 and sim.completed == 0
    status = await gateway.until(lambda s: s.active_requests == 0)
    assert all(w.state == AVAILABLE and not w.current_job for w in status.workers)


async def test_stream_of_a_failed_request_ends_with_its_status(gateway: Gateway) -> None:
    err = await rpc_error(gateway.stub.GenerateImagesStream(
        pb.GenerateImagesStreamRequest(request=request(n=9))).read())  # over --max-queued-outputs=8
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "at most 8" in err.details()


# ---- status and membership -----------------------------------------------------------------------------------


async def test_status_shows_each_worker_state_and_job_and_removal_drains(gateway: Gateway, cluster: SimCluster) -> None:
    cluster.gate.clear()
    d0, d1, d2 = (cluster.address(d) for d in cluster.denoisers)
    first = asyncio.ensure_future(gateway.stub.GenerateImages(request(n=2), metadata=(("x-request-id", "job-a"),)))
    status = await gateway.until(lambda s: sum(w.state == BUSY for w in s.workers) == 2)
    busy = {w.address: w.current_job for w in status.workers if w.state == BUSY}
    assert sorted(busy.values()) == ["job-a/0#1", "job-a/1#1"]
    (free,) = {d0, d1, d2} - set(busy)
    held = sorted(busy)[0]

    # NOT_SERVING (what a server says while it shuts down) takes the idle one out of rotation, as draining.
    await cluster.denoisers[[d0, d1, d2].index(free)].set_serving(False)
    await gateway.until(lambda s: {w.address: w.state for w in s.workers}[free] == DRAINING)

    await gateway.stub.RemoveWorker(pb.RemoveWorkerRequest(address=held), metadata=ADMIN)
    workers = await gateway.workers()
    assert workers[held].state == DRAINING and workers[held].current_job == busy[held]
    assert workers[cluster.address(cluster.ar)].state == AVAILABLE
    jobs_before = len(cluster.sims[[d0, d1, d2].index(held)].jobs)

    cluster.gate.set()  # the draining worker finishes its job; then it is gone
    assert len((await first).images) == 2
    await gateway.until(lambda s: held not in {w.address for w in s.workers})
    # No new job goes to the drained worker: n=2 now needs the other busy one and the free one once healthy.
    await cluster.denoisers[[d0, d1, d2].index(free)].set_serving(True)
    await gateway.until(lambda s: {w.address: w.state for w in s.workers}[free] == AVAILABLE)
    resp = await gateway.stub.GenerateImages(request(n=2))
    assert len(resp.images) == 2
    assert len(cluster.sims[[d0, d1, d2].index(held)].jobs) == jobs_before


async def test_admin_add_worker_gets_work(cluster: SimCluster) -> None:
    ar, (d0, d1, _) = cluster.address(cluster.ar), [cluster.address(d) for d in cluster.denoisers]
    async with running_gateway([ar], [d0]) as gw:
        await gw.stub.AddWorker(pb.AddWorkerRequest(address=d1, role=pb.WORKER_ROLE_DENOISER), metadata=ADMIN)
        await gw.stub.AddWorker(pb.AddWorkerRequest(address=d1, role=pb.WORKER_ROLE_DENOISER),  # idempotent
                                metadata=ADMIN)
        status = await gw.until(lambda s: [w.state for w in s.workers].count(AVAILABLE) == 3)
        assert {w.address: w.role for w in status.workers}[d1] == pb.WORKER_ROLE_DENOISER
        cluster.gate.clear()
        call = asyncio.ensure_future(gw.stub.GenerateImages(request(n=2)))
        status = await gw.until(lambda s: sum(w.state == BUSY for w in s.workers) == 2)
        assert {w.address for w in status.workers if w.state == BUSY} == {d0, d1}  # both outputs at once
        cluster.gate.set()
        assert len((await call).images) == 2


@pytest.mark.parametrize("rpc, message, code, field", [
    ("AddWorker", pb.AddWorkerRequest(address="", role=pb.WORKER_ROLE_DENOISER), "INVALID_ARGUMENT", "address"),
    ("AddWorker", pb.AddWorkerRequest(address="nohost", role=pb.WORKER_ROLE_DENOISER), "INVALID_ARGUMENT",
     "address"),
    ("AddWorker", pb.AddWorkerRequest(address="h:0", role=pb.WORKER_ROLE_AR), "INVALID_ARGUMENT", "address"),
    ("AddWorker", pb.AddWorkerRequest(address="::1:5", role=pb.WORKER_ROLE_AR), "INVALID_ARGUMENT", "address"),
    ("AddWorker", pb.AddWorkerRequest(address="h:50061"), "INVALID_ARGUMENT", "role"),
    ("RemoveWorker", pb.RemoveWorkerRequest(address=""), "INVALID_ARGUMENT", "address"),
    ("RemoveWorker", pb.RemoveWorkerRequest(address="10.0.0.9:1"), "NOT_FOUND", "address"),
])
async def test_admin_rpcs_validate(gateway: Gateway, rpc: str, message: object, code: str, field: str) -> None:
    err = await rpc_error(getattr(gateway.stub, rpc)(message, metadata=ADMIN))
    assert err.code() == getattr(grpc.StatusCode, code) and err.details().startswith(f"{field}:")


async def test_admin_add_refuses_a_second_role_for_an_address(gateway: Gateway, cluster: SimCluster) -> None:
    err = await rpc_error(gateway.stub.AddWorker(pb.AddWorkerRequest(address=cluster.address(cluster.denoisers[0]),
                                                                     role=pb.WORKER_ROLE_AR), metadata=ADMIN))
    assert err.code() == grpc.StatusCode.ALREADY_EXISTS


@pytest.mark.parametrize("target, expected", [
    ("denoiser.ns.svc:50061", ("denoiser.ns.svc", 50061)),
    ("[fd00::1]:7", ("fd00::1", 7)),
    (" 10.0.0.1:65535 ", ("10.0.0.1", 65535)),
])
def test_split_host_port(target: str, expected: tuple[str, int]) -> None:
    assert split_host_port(target) == expected
    assert join_host_port("fd00::1", 7) == "[fd00::1]:7"


@pytest.mark.parametrize("target", ["", "host", ":80", "host:", "host:0", "host:70000", "host:http", "a b:1",
                                    "fd00::1:7"])
def test_split_host_port_rejects(target: str) -> None:
    with pytest.raises(ValueError):
        split_host_port(target)


async def test_dns_membership_adds_drains_and_survives_lookup_failures(cluster: SimCluster) -> None:
    """A headless Service, with the resolver injected: records appear, vanish (drain), and lookups fail."""
    ar = cluster.address(cluster.ar)
    d0, d1, d2 = (cluster.address(d) for d in cluster.denoisers)
    records: set[str] | None = {d0, d1, d2}

    async def resolver(host: str, port: int) -> frozenset[str]:
        assert (host, port) == ("denoisers.glm.svc", 50061)
        if records is None:
            raise OSError("temporary failure in name resolution")
        return frozenset(records)

    async with running_gateway([ar], [d2]) as gw:
        dns = DnsMembership.from_target("denoisers.glm.svc:50061", WorkerRole.DENOISER, gw.driver.add_worker,
                                        gw.driver.remove_worker, resolver=resolver)
        await dns.refresh()
        await gw.until(lambda s: [w.state for w in s.workers].count(AVAILABLE) == 4)
        cluster.gate.clear()
        call = asyncio.ensure_future(gw.stub.GenerateImages(request(n=3)))
        await gw.until(lambda s: sum(w.state == BUSY for w in s.workers) == 3)
        records = None  # a failed lookup removes nobody
        await dns.refresh()
        assert {w.address for w in (await gw.status()).workers} == {ar, d0, d1, d2}
        records = {d1}  # d0 vanished while busy: it drains; d2 is static, so not the watcher's to remove
        await dns.refresh()
        assert (await gw.workers())[d0].state == DRAINING
        cluster.gate.set()
        assert len((await call).images) == 3
        status = await gw.until(lambda s: d0 not in {w.address for w in s.workers})
        assert {w.address for w in status.workers} == {ar, d1, d2}


async def test_dns_membership_resolves_localhost(cluster: SimCluster) -> None:
    port = cluster.denoisers[0].port
    assert f"127.0.0.1:{port}" in await resolve("localhost", port)
    async with running_gateway([cluster.address(cluster.ar)], []) as gw:
        dns = DnsMembership.from_target(f"localhost:{port}", WorkerRole.DENOISER, gw.driver.add_worker,
                                        gw.driver.remove_worker)
        await dns.refresh()
        # localhost may also resolve to ::1, where nothing listens: that one just stays unhealthy.
        await gw.until(lambda s: any(w.address == f"127.0.0.1:{port}" and w.state == AVAILABLE for w in s.workers))
        assert len((await gw.stub.GenerateImages(request())).images) == 1


# ---- metrics ---------------------------------------------------------------------------------------------------


async def scraped(registry: CollectorRegistry, ready: Callable[[dict], object]) -> dict:
    """The registry's samples once ``ready`` holds of them (within wait_for's bound)."""
    await wait_for(lambda: bool(ready(scrape(registry))))
    return scrape(registry)


async def test_metrics_follow_queues_workers_and_outcomes(cluster: SimCluster) -> None:
    registry = CollectorRegistry()
    ar, dns = cluster.address(cluster.ar), [cluster.address(d) for d in cluster.denoisers]
    async with running_gateway([ar], dns, metrics=GatewayMetrics(registry), max_queued_outputs=6) as gw:
        # The driver publishes the metrics once per turn of the loop, after the events of that turn: wait for it.
        # Each worker's health arrives as an event of its own, so wait for the snapshot that has them all.
        ar_available = ("glmimage_gateway_workers", (("role", "ar"), ("state", "available")))
        dn_available = ("glmimage_gateway_workers", (("role", "denoiser"), ("state", "available")))
        m = await scraped(registry, lambda m: m.get(ar_available) == 1 and m.get(dn_available) == 3)
        assert m["glmimage_gateway_workers", (("role", "denoiser"), ("state", "available"))] == 3
        assert m["glmimage_gateway_workers", (("role", "ar"), ("state", "available"))] == 1
        cluster.gate.clear()
        calls = [asyncio.ensure_future(gw.stub.GenerateImages(request(n=n))) for n in (2, 3)]
        # 5 outputs on 3 denoisers: 2 wait in the denoise queue, which is what the HPA scales on.
        await gw.until(lambda s: s.pending_denoise_outputs == 2)
        m = await scraped(registry, lambda m: m.get(("glmimage_gateway_queue_outputs", (("stage", "denoise"),))) == 2)
        assert m["glmimage_gateway_queue_outputs", (("stage", "denoise"),)] == 2
        assert m["glmimage_gateway_queue_requests", (("stage", "denoise"),)] == 1
        assert m["glmimage_gateway_queue_outputs", (("stage", "ar"),)] == 0
        assert m["glmimage_gateway_workers", (("role", "denoiser"), ("state", "busy"))] == 3
        assert (await rpc_error(gw.stub.GenerateImages(request(n=7)))).code() == grpc.StatusCode.INVALID_ARGUMENT
        cluster.gate.set()
        await asyncio.gather(*calls)
        m = await scraped(registry, lambda m: m.get(("glmimage_gateway_requests_total", (("outcome", "ok"),))) == 2)
    assert m["glmimage_gateway_requests_total", (("outcome", "ok"),)] == 2
    assert m["glmimage_gateway_requests_total", (("outcome", "invalid_argument"),)] == 1
    assert m["glmimage_gateway_admission_rejections_total", ()] == 1
    assert m["glmimage_gateway_images_total", ()] == 5
    assert m["glmimage_gateway_tokens_total", (("kind", "prompt"),)] == 5 * 12  # 4 words + 8, per output
    assert m["glmimage_gateway_tokens_total", (("kind", "completion"),)] == 5 * 17
    assert m["glmimage_gateway_ar_batch_size_count", ()] >= 1
    assert m["glmimage_gateway_ar_batch_size_sum", ()] == 5
    assert m["glmimage_gateway_denoise_seconds_count", ()] == 5
    assert m["glmimage_gateway_queue_seconds_count", (("stage", "denoise"),)] == 5
    assert m["glmimage_gateway_queue_seconds_count", (("stage", "ar"),)] == 2
    assert m["glmimage_gateway_request_seconds_count", ()] == 2
    assert m["glmimage_gateway_requeues_total", (("reason", "worker_unhealthy"),)] == 0
    assert m["glmimage_gateway_fenced_results_total", ()] == 0
    assert m["glmimage_gateway_queue_outputs", (("stage", "denoise"),)] == 0


def test_metrics_text_passes_promtool(tmp_path) -> None:
    import shutil
    import subprocess

    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool (apt: prometheus) is not installed")
    registry = CollectorRegistry()
    GatewayMetrics(registry)
    result = subprocess.run([promtool, "check", "metrics"], input=generate_latest(registry), capture_output=True)
    assert result.returncode == 0, result.stdout + result.stderr


# ---- auth ------------------------------------------------------------------------------------------------------


def test_api_keys_from_flags_and_env() -> None:
    assert api_keys_from(["a", "", "b"], {"GLMIMAGE_API_KEYS": " c, a ,,"}) == ("a", "b", "c")
    assert api_keys_from([], {}) == ()


async def test_api_keys_guard_gateway_service_but_not_health_or_reflection(cluster: SimCluster) -> None:
    ar, dns = cluster.address(cluster.ar), [cluster.address(cluster.denoisers[0])]
    async with running_gateway([ar], dns, api_keys=("k-one", "k-two")) as gw:
        calls = {
            "GenerateImages": lambda md: gw.stub.GenerateImages(request(), metadata=md),
            "GenerateImagesStream": lambda md: gw.stub.GenerateImagesStream(
                pb.GenerateImagesStreamRequest(request=request()), metadata=md).read(),
            "GetStatus": lambda md: gw.stub.GetStatus(pb.GetStatusRequest(), metadata=md),
        }  # the admin RPCs: tests/test_authz.py
        for name, call in calls.items():
            for md in [(), (("authorization", "Bearer nope"),), (("authorization", "k-one"),),
                       (("authorization", "Bearer "),), (("authorization", "Bearer k-one2"),)]:
                err = await rpc_error(call(md))
                assert err.code() == grpc.StatusCode.UNAUTHENTICATED, (name, md)
        assert len((await gw.stub.GenerateImages(request(), metadata=(("authorization", "Bearer k-two"),))).images)
        events = [e async for e in gw.stub.GenerateImagesStream(
            pb.GenerateImagesStreamRequest(request=request()), metadata=(("authorization", "bearer k-one"),))]
        assert events[-1].WhichOneof("event") == "completed"
        health = await health_pb2_grpc.HealthStub(gw.channel).Check(health_pb2.HealthCheckRequest(service=GATEWAY))
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(gw.channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        listed = [s.name async for r in reflection for s in r.list_services_response.service]
        assert GATEWAY in listed


async def test_a_denoise_task_cancelled_before_it_ran_frees_its_worker(cluster: SimCluster) -> None:
    """A CancelDenoise can land before the dispatched RPC task has run at all (cancel in the same loop turn)."""
    from gateway.scheduler import types as sch

    class CancelFirstDispatch(Driver):
        cancelled: list[sch.JobId] = []

        def _perform(self, action: sch.Action) -> None:
            super()._perform(action)
            if isinstance(action, sch.DispatchDenoise) and not self.cancelled:
                self.cancelled.append(action.job)
                self._denoise_calls[action.job].cancel()

    config = GatewayConfig(ar_addresses=(cluster.address(cluster.ar),),
                           denoiser_addresses=(cluster.address(cluster.denoisers[0]),),
                           scheduler=SchedulerConfig(ar_batch_delay=0.0), request_timeout=30)
    driver = CancelFirstDispatch(config)
    await driver.start()
    try:
        await wait_for(lambda: all(w.state.value == "AVAILABLE" for w in driver.snapshot().workers))
        outcome = await asyncio.wait_for(driver.generate("r1", Admitted(request(), n=1, height=64, width=64), 30), 10)
        assert len(outcome.images) == 1 and driver.cancelled[0].attempt == 1
        assert driver.scheduler.counters.requeues["denoise_failed"] == 1  # retried on attempt 2, same worker
        assert all(w.state.value == "AVAILABLE" for w in driver.snapshot().workers)
    finally:
        await driver.close()


async def test_background_work_never_logs_with_the_id_of_the_request_that_started_it(
        caplog: pytest.LogCaptureFixture) -> None:
    """A call that fails sidelines its worker from inside that call's context, and the worker's health watch starts
    over from there: none of the watch's lines may carry the request's id (a task copies its creator's context)."""
    caplog.set_level(logging.INFO)
    caplog.handler.addFilter(RequestIdFilter())
    async with sim_cluster() as sims:
        denoisers = [f"127.0.0.1:{d.port}" for d in sims.denoisers]
        async with running_gateway([f"127.0.0.1:{sims.ar.port}"], denoisers) as gw:
            worker = gw.driver.members.get(denoisers[0])
            done = len(caplog.records)
            token = request_id_var.set("rid-started-it")  # as inside that request's call
            try:
                gw.driver._sideline(worker, WorkerHealth.UNREACHABLE, grpc.StatusCode.UNAVAILABLE)
            finally:
                request_id_var.reset(token)
            # The restarted watch finds the worker serving again and says so.
            await wait_for(lambda: any(f"{denoisers[0]} is SERVING" in r.getMessage()
                                       for r in caplog.records[done:]), timeout=60)
    watch = [r for r in caplog.records[done:] if "is SERVING" in r.getMessage() or "applies" in r.getMessage()]
    assert watch and all(r.request_id == "-" for r in watch), [(r.request_id, r.getMessage()) for r in watch]
