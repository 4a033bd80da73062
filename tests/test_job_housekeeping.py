"""The store's upkeep (gateway/jobs/housekeeping.py) and the stored-bytes bound (gateway/jobs/keeper.py), on a real
SQLite store and a real disk image store.

What is checked: expired jobs go with their images (files and rows), unexpired ones stay; images no job recorded are
swept; a job past its deadline or whose runners died too often is ended, with its webhook owed; the store-wide
figures reach the metrics; a tenant at its stored-bytes bound is refused, another tenant is not, and the bound
clears as images expire."""
from __future__ import annotations

import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from gateway.jobs.housekeeping import Housekeeping, HousekeepingConfig
from gateway.jobs.images import DiskImageStore
from gateway.jobs.keeper import ImageKeeper
from gateway.jobs.metrics import JobMetrics
from gateway.jobs.model import COMPLETED, FAILED, QUEUED, NewJob, new_job_id
from gateway.jobs.outcomes import Finisher
from gateway.jobs.render import job_json
from gateway.jobs.store import open_store
from gateway.jobs.urls import UrlSigner
from glmimage.v1 import common_pb2, gateway_service_pb2
from runtime.errors import ResourceExhausted
from runtime.tenants import Tenant

TTL = 100.0


@pytest.fixture()
async def world(tmp_path: Path):
    store = open_store(f"sqlite:///{tmp_path / 'jobs.sqlite3'}")
    await store.connect()
    images = DiskImageStore(tmp_path / "images", UrlSigner(b"s" * 32, 3600.0))
    keeper = ImageKeeper(images, store, TTL, max_stored_bytes=1000)
    finisher = Finisher(keeper, job_json, TTL, 3600.0)
    metrics = JobMetrics(CollectorRegistry())
    yield store, images, keeper, finisher, metrics
    await store.close()


def response(n: int, size: int) -> gateway_service_pb2.GenerateImagesResponse:
    return gateway_service_pb2.GenerateImagesResponse(
        images=[gateway_service_pb2.GeneratedImage(index=i, image=bytes([i]) * size) for i in range(n)],
        width=64, height=64, output_format=common_pb2.IMAGE_FORMAT_PNG)


async def run_job(store, keeper, finisher, now: float, tenant: str = "alpha", n: int = 2, size: int = 100,
                  webhook: str = "") -> str:
    request = gateway_service_pb2.GenerateImagesRequest(prompt="p", n=n)
    record, _ = await store.insert(NewJob(id=new_job_id(), tenant=tenant, request=request.SerializeToString(), n=n,
                                          priority=1, created_at=now, deadline=now + 50, webhook_url=webhook))
    lease = await store.claim("r", now, 30.0, 10)
    assert lease is not None and lease.job.id == record.id
    stored, objects = await keeper.keep(tenant, response(n, size), now, record.id)
    assert await store.finish(lease, finisher.outcome(lease.job, COMPLETED, now, result=stored.SerializeToString(),
                                                      objects=objects))
    return record.id


async def test_expired_jobs_go_with_their_images(world) -> None:
    store, images, keeper, finisher, metrics = world
    t0 = time.time()
    old = await run_job(store, keeper, finisher, t0)
    new = await run_job(store, keeper, finisher, t0 + 60)
    old_keys = [i.url for i in gateway_service_pb2.GenerateImagesResponse.FromString(
        (await store.get(old, None)).result).images]
    upkeep = Housekeeping(store, images, finisher, HousekeepingConfig(job_ttl=TTL), metrics, clock=lambda: t0 + 130)
    assert await upkeep.expire(t0 + 130) == 1
    assert await store.get(old, None) is None and await store.get(new, None) is not None
    assert [await images.get(k) for k in old_keys] == [None, None]
    assert await store.stored_bytes("alpha", t0 + 130) == 200  # the newer job's two images


async def test_images_no_job_recorded_are_swept(world, tmp_path: Path) -> None:
    store, images, keeper, finisher, metrics = world
    t0 = time.time()
    orphan, _ = await keeper.keep("alpha", response(1, 10), t0)  # a run whose end was never recorded
    kept = await run_job(store, keeper, finisher, t0)
    assert await images.sweep(time.time() + 1) >= 1  # everything older than now: the orphan and the job's files
    assert await images.get(orphan.images[0].url) is None
    # (A real sweep only takes what is older than the job TTL: a recorded image is younger or already expired.)
    assert (await store.get(kept, None)).status == COMPLETED


async def test_jobs_no_runner_can_finish_are_ended_with_their_webhook(world) -> None:
    store, images, keeper, finisher, metrics = world
    t0 = time.time()
    request = gateway_service_pb2.GenerateImagesRequest(prompt="p").SerializeToString()
    dying, _ = await store.insert(NewJob(id=new_job_id(), tenant="alpha", request=request, n=1, priority=1,
                                         created_at=t0, deadline=t0 + 1000))
    for i in range(2):  # two runners took it and died (their leases ran out)
        assert (await store.claim(f"r{i}", t0 + 1 + 40 * i, 30.0, 2)).job.id == dying.id
    late, _ = await store.insert(NewJob(id=new_job_id(), tenant="alpha", request=request, n=1, priority=1,
                                        created_at=t0, deadline=t0 + 5, webhook_url="https://h.example.com/"))
    woke = []
    upkeep = Housekeeping(store, images, finisher, HousekeepingConfig(max_attempts=2, job_ttl=TTL), metrics,
                          on_ended=lambda: woke.append(1), clock=lambda: t0 + 200)
    await upkeep.once()
    ended = {job_id: await store.get(job_id, None) for job_id in (late.id, dying.id)}
    assert {r.status for r in ended.values()} == {FAILED}
    assert (ended[late.id].error_code, ended[dying.id].error_code) == ("DEADLINE_EXCEEDED", "ABORTED")
    assert (await store.delivery_counts()).get("pending") == 1 and woke  # the webhook of the one that named one
    assert metrics.jobs.labels(FAILED)._value.get() == 2
    assert metrics.jobs.labels(QUEUED)._value.get() == 0


async def test_the_stored_bytes_bound(world) -> None:
    store, images, keeper, finisher, metrics = world
    t0 = time.time()
    alpha, beta = Tenant("alpha"), Tenant("beta", max_stored_bytes=10_000)
    await keeper.check_room(alpha, t0)
    await run_job(store, keeper, finisher, t0, n=2, size=600)  # 1200 bytes: past alpha's 1000 by one job
    with pytest.raises(ResourceExhausted, match="holds 1200 bytes"):
        await keeper.check_room(alpha, t0 + 1)
    await keeper.check_room(beta, t0 + 1)  # another tenant's bound is its own
    await keeper.check_room(alpha, t0 + TTL + 1)  # once they expire (the sweep deletes them), room again
