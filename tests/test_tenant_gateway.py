"""Tenants at the real gateway's edge (in-process GatewayService over simulated workers): priority up to the tenant's
max_priority, quotas with their rate-limit metadata and RetryInfo, the in-flight bound freed on every way a request
ends, the per-tenant metrics, and GetStatus per tenant."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from prometheus_client import CollectorRegistry

from gateway.auth import GatewayAuth
from gateway.metrics import GatewayMetrics
from glmimage.v1 import gateway_service_pb2 as pb
from runtime.details import field_violation
from runtime.tenants import TenantsFile, parse_tenants
from tests.support.authz import bearer
from tests.support.sim_gateway import ADMIN_KEY, SimCluster, request, rpc_error, running_gateway, scrape, wait_for

TENANTS = """
[tenants.alpha]
keys = ["sk-alpha"]
max_priority = "interactive"

[tenants.beta]
keys = ["sk-beta"]
weight = 2
requests_per_minute = 3
images_per_minute = 5

[tenants.gamma]
keys = ["sk-gamma"]
max_priority = "batch"
max_inflight_images = 2

[tenants.ops]
keys = ["{admin}"]
role = "admin"
""".replace("{admin}", ADMIN_KEY)  # the key the support's Gateway.status() presents
ALPHA, BETA, GAMMA, OPS = bearer("sk-alpha"), bearer("sk-beta"), bearer("sk-gamma"), bearer(ADMIN_KEY)
RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


def tenants() -> TenantsFile:
    return TenantsFile(None, parse_tenants(TENANTS))


def retry_info(err: grpc.aio.AioRpcError) -> float | None:
    status = rpc_status.from_call(err)
    for detail in status.details if status else ():
        info = error_details_pb2.RetryInfo()
        if detail.Unpack(info):
            return info.retry_delay.seconds + info.retry_delay.nanos / 1e9
    return None


async def test_priority_up_to_the_tenants_max(sims: SimCluster) -> None:
    ar, d0 = sims.address(sims.ar), sims.address(sims.denoisers[0])
    async with running_gateway([ar], [d0], tenants=tenants()) as gw:
        for value in (pb.PRIORITY_UNSPECIFIED, pb.PRIORITY_INTERACTIVE, pb.PRIORITY_DEFAULT, pb.PRIORITY_BATCH):
            assert len((await gw.stub.GenerateImages(request(priority=value), metadata=ALPHA)).images) == 1
        # gamma may ask for batch only; beta (max_priority absent) for default and batch.
        for md, value in ((GAMMA, pb.PRIORITY_DEFAULT), (GAMMA, pb.PRIORITY_INTERACTIVE),
                          (BETA, pb.PRIORITY_INTERACTIVE)):
            err = await rpc_error(gw.stub.GenerateImages(request(priority=value), metadata=md))
            assert err.code() is grpc.StatusCode.INVALID_ARGUMENT and field_violation(err)[0] == "priority"
            assert "above what tenant" in err.details()
        bad = await rpc_error(gw.stub.GenerateImages(request(priority=9), metadata=ALPHA))
        assert bad.code() is grpc.StatusCode.INVALID_ARGUMENT and field_violation(bad)[0] == "priority"
        assert len((await gw.stub.GenerateImages(request(priority=pb.PRIORITY_BATCH), metadata=GAMMA)).images) == 1
        # A refused priority counted against no quota: beta still has all three requests.
        (beta,) = (await gw.stub.GetStatus(pb.GetStatusRequest(), metadata=BETA)).tenants
        assert beta.remaining_requests == 3


async def test_quotas_answer_with_rate_limits_and_retry_info_and_never_refuse_another_tenant(sims: SimCluster) -> None:
    ar, d0 = sims.address(sims.ar), sims.address(sims.denoisers[0])
    registry = CollectorRegistry()
    async with running_gateway([ar], [d0], tenants=tenants(), metrics=GatewayMetrics(registry)) as gw:
        seen = []
        for n in (1, 2):  # 3 images of beta's 5, 2 requests of its 3
            call = gw.stub.GenerateImages(request(n=n), metadata=BETA)
            assert len((await call).images) == n
            seen.append(dict(await call.initial_metadata()))
        assert [m["x-ratelimit-remaining-requests"] for m in seen] == ["2", "1"]
        assert [m["x-ratelimit-remaining-images"] for m in seen] == ["4", "2"]
        assert seen[0]["x-ratelimit-limit-requests"] == "3" and seen[0]["x-ratelimit-limit-images"] == "5"
        assert seen[0]["x-ratelimit-reset-requests"].endswith("s")
        # 3 more images would pass 5: refused, with nothing counted.
        err = await rpc_error(gw.stub.GenerateImages(request(n=3), metadata=BETA))
        trailing = dict(err.trailing_metadata())
        assert err.code() is RESOURCE_EXHAUSTED and "beta" in err.details()
        assert trailing["x-glmimage-quota"] == "images_per_minute" and int(trailing["retry-after"]) >= 1
        assert trailing["x-ratelimit-remaining-images"] == "2" and 0 < retry_info(err) <= 60
        assert len((await gw.stub.GenerateImages(request(n=2), metadata=BETA)).images) == 2  # the 3rd request
        err = await rpc_error(gw.stub.GenerateImages(request(), metadata=BETA))
        assert dict(err.trailing_metadata())["x-glmimage-quota"] == "requests_per_minute"
        # The others were never refused, and a tenant without quotas gets no rate-limit metadata.
        for _ in range(5):
            call = gw.stub.GenerateImages(request(), metadata=ALPHA)
            await call
            assert not any(k.startswith("x-ratelimit") for k, _ in await call.initial_metadata())
        # n past the per-minute images at all: never admitted, so not a 429 to retry.
        err = await rpc_error(gw.stub.GenerateImages(request(n=6), metadata=BETA))
        assert err.code() is grpc.StatusCode.INVALID_ARGUMENT and field_violation(err)[0] == "n"
    samples = scrape(registry)
    assert samples[("glmimage_gateway_tenant_requests_total", (("outcome", "ok"), ("tenant", "beta")))] == 3
    assert samples[("glmimage_gateway_tenant_requests_total", (("outcome", "rate_limited"), ("tenant", "beta")))] == 2
    assert samples[("glmimage_gateway_tenant_quota_refusals_total",
                    (("quota", "images_per_minute"), ("tenant", "beta")))] == 1
    assert samples[("glmimage_gateway_tenant_images_total", (("tenant", "beta"),))] == 5
    assert samples[("glmimage_gateway_tenant_images_total", (("tenant", "alpha"),))] == 5
    assert samples[("glmimage_gateway_tenant_usage_pixel_steps_total", (("tenant", "beta"),))] > 0
    assert samples[("glmimage_gateway_tenant_usage_ar_tokens_total", (("kind", "prompt"), ("tenant", "beta")))] > 0
    assert samples[("glmimage_gateway_tenant_queue_wait_seconds_count", (("tenant", "alpha"),))] == 5
    assert ("glmimage_gateway_tenant_requests_total", (("outcome", "ok"), ("tenant", "ops"))) in samples


@pytest.mark.parametrize("ending", ["cancelled", "deadline", "failed"])
async def test_in_flight_images_are_freed_however_a_request_ends(sims: SimCluster, ending: str) -> None:
    ar, d0, d1 = (sims.address(s) for s in (sims.ar, *sims.denoisers[:2]))
    async with running_gateway([ar], [d0, d1], tenants=tenants(), fail_fast_without_workers=True) as gw:
        batch = pb.PRIORITY_BATCH
        sims.gate.clear()  # denoise jobs hold their denoisers
        timeout = 1.0 if ending == "deadline" else None
        held = asyncio.ensure_future(gw.stub.GenerateImages(request(n=2, priority=batch), metadata=GAMMA,
                                                            timeout=timeout))
        await gw.until(lambda st: any(w.current_job for w in st.workers))
        err = await rpc_error(gw.stub.GenerateImages(request(priority=batch), metadata=GAMMA))
        assert err.code() is RESOURCE_EXHAUSTED
        assert dict(err.trailing_metadata())["x-glmimage-quota"] == "max_inflight_images"
        (gamma,) = (await gw.stub.GetStatus(pb.GetStatusRequest(), metadata=GAMMA)).tenants
        assert gamma.inflight_images == 2 and gamma.max_inflight_images == 2
        if ending == "cancelled":
            held.cancel()
        elif ending == "failed":
            for server in sims.denoisers[:2]:
                await server.stop(None)  # both denoisers go away: the request fails (no denoiser is left)
        with pytest.raises((asyncio.CancelledError, grpc.aio.AioRpcError)):
            await held
        await wait_for(lambda: gw.driver.snapshot().active_requests == 0)
        sims.gate.set()
        if ending != "failed":
            call = gw.stub.GenerateImages(request(n=2, priority=batch), metadata=GAMMA)
            assert len((await call).images) == 2
        (gamma,) = (await gw.stub.GetStatus(pb.GetStatusRequest(), metadata=GAMMA)).tenants
        assert gamma.inflight_images == 0


async def test_get_status_lists_every_tenant_to_the_admin_and_its_own_to_a_user(sims: SimCluster) -> None:
    ar, d0 = sims.address(sims.ar), sims.address(sims.denoisers[0])
    async with running_gateway([ar], [d0], tenants=tenants()) as gw:
        await gw.stub.GenerateImages(request(n=2), metadata=BETA)
        whole = await gw.stub.GetStatus(pb.GetStatusRequest(), metadata=OPS)
        assert [t.name for t in whole.tenants] == ["alpha", "beta", "gamma", "ops"]
        beta = {t.name: t for t in whole.tenants}["beta"]
        assert (beta.weight, beta.requests_total, beta.images_total, beta.requests_per_minute,
                beta.images_per_minute, beta.remaining_requests, beta.remaining_images,
                beta.max_priority) == (2.0, 1, 2, 3, 5, 2, 3, pb.PRIORITY_DEFAULT)
        for md, name in ((ALPHA, "alpha"), (BETA, "beta"), (GAMMA, "gamma")):
            assert [t.name for t in (await gw.stub.GetStatus(pb.GetStatusRequest(), metadata=md)).tenants] == [name]
        assert (await rpc_error(gw.stub.GetStatus(pb.GetStatusRequest(), metadata=bearer("sk-nobody")))).code() \
            is grpc.StatusCode.UNAUTHENTICATED


async def test_a_reload_applies_to_the_next_call_and_an_admitted_request_keeps_its_tenant(sims: SimCluster,
                                                                                          tmp_path) -> None:
    ar, d0 = sims.address(sims.ar), sims.address(sims.denoisers[0])
    path = tmp_path / "tenants.toml"
    path.write_text(TENANTS)
    holder = TenantsFile(path, parse_tenants(TENANTS))
    async with running_gateway([ar], [d0], tenants=holder) as gw:
        sims.gate.clear()
        held = asyncio.ensure_future(gw.stub.GenerateImages(request(), metadata=ALPHA))
        await gw.until(lambda st: any(w.current_job for w in st.workers))
        path.write_text(TENANTS.replace('keys = ["sk-alpha"]', 'keys = ["sk-alpha-2"]'))
        assert holder.reload()
        sims.gate.set()
        assert len((await held).images) == 1  # admitted before the reload: served to the end
        err = await rpc_error(gw.stub.GenerateImages(request(), metadata=ALPHA))
        assert err.code() is grpc.StatusCode.UNAUTHENTICATED
        assert len((await gw.stub.GenerateImages(request(), metadata=bearer("sk-alpha-2"))).images) == 1


def test_a_status_key_calls_get_status_only_and_sees_no_tenant() -> None:
    auth = GatewayAuth(tenants(), status_keys=("probe-key",))
    probe = bearer("probe-key")
    assert auth.check("/glmimage.v1.GatewayService/GetStatus", probe) is None
    for method in ("GenerateImages", "GenerateImagesStream", "ListLoras", "AddWorker"):
        code, _ = auth.check(f"/glmimage.v1.GatewayService/{method}", probe)
        assert code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED), method
    assert auth.caller(probe) is None and not auth.is_probe(bearer("probe-kez")) and not auth.is_probe(None)
    assert GatewayAuth(tenants()).check("/glmimage.v1.GatewayService/GetStatus", probe)[0] \
        is grpc.StatusCode.UNAUTHENTICATED


async def test_a_waiting_tenants_oldest_wait_grows_between_events(sims: SimCluster) -> None:
    ar, d0 = sims.address(sims.ar), sims.address(sims.denoisers[0])
    registry = CollectorRegistry()
    key = ("glmimage_gateway_tenant_oldest_wait_seconds", (("tenant", "alpha"),))
    async with running_gateway([ar], [d0], tenants=tenants(), metrics=GatewayMetrics(registry)) as gw:
        sims.gate.clear()  # the one denoiser holds the first job: the second waits in the denoise queue
        calls = [asyncio.ensure_future(gw.stub.GenerateImages(request(), metadata=ALPHA)) for _ in range(2)]
        await gw.until(lambda st: st.pending_denoise_outputs == 1)
        first = scrape(registry)[key]
        # Nothing happens in the scheduler meanwhile; the figure is read at scrape time all the same.
        await wait_for(lambda: scrape(registry)[key] > first + 0.05)
        assert scrape(registry)[("glmimage_gateway_tenant_queue_depth", (("stage", "denoise"), ("tenant", "alpha")))] \
            == 1
        sims.gate.set()
        await asyncio.gather(*calls)
        await wait_for(lambda: scrape(registry)[key] == 0)
