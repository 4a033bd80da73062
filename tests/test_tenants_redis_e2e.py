"""Issue 30's done-when across gateways: two gateways under the launcher (``--gateway-ports 0,0``) with
``--quota-store`` on a real redis-server (tests/support/redis_server.py) admit exactly 20 of 40 requests of a tenant
whose quota is 20 requests a minute, sent to both at once. Then Redis is killed: both gateways go on serving from
their own counts, say so once each in the log, and glmimage_gateway_quota_store_up is 0 on their /metrics."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from runtime.details import retry_delay
from tests.support.redis_server import RedisServer, pings, redis_server
from tests.support.tenants_stack import TenantStack, bearer, request, sample, tenant_stack, write_tenants
from tests.support.waiting import until

pytestmark = pytest.mark.e2e

KEY = "sk-counted-1"
QUOTA, SENT = 20, 40
UP = "glmimage_gateway_quota_store_up"
DOWN_LINE = "unreachable"  # gateway.quota_store's one warning when Redis goes away


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with redis_server(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture(scope="module")
def stack(tiny_checkpoint: Path, redis: RedisServer, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[TenantStack]:
    run_dir = tmp_path_factory.mktemp("tenants-redis")
    write_tenants(run_dir / "tenants.toml", {"counted": {"keys": [KEY], "requests_per_minute": QUOTA}})
    # (a store timeout for a loaded 2-core machine: the test is about what Redis counts; a dead Redis is killed)
    with tenant_stack(run_dir, run_dir / "tenants.toml", "--quota-store", redis.url, "--gateway-metrics-ports", "0,0",
                      "--gateway-arg=--quota-store-timeout=2",
                      denoisers=1, gateways=2) as run:
        assert len(run.gateways) == 2
        yield run


def _metrics(stack: TenantStack) -> list[str]:
    return [stack.addresses[f"gateway-{i}-metrics"] for i in (1, 2)]


def test_a_gateway_on_a_redis_that_answers_says_so_before_any_request(stack: TenantStack) -> None:
    # An idle gateway must not read as counting on its own (GlmImageQuotaStoreDown fires on 0).
    for url in _metrics(stack):
        until(lambda url=url: sample(url, UP) == 1, 10, f"{UP} to be 1 on {url}", step=0.2)


def test_two_gateways_admit_exactly_twenty_of_forty(stack: TenantStack) -> None:
    stubs = [stack.stub(address) for address in stack.gateways]
    calls = [stubs[i % 2].GenerateImages.future(request(f"counted {i}", seed=i, steps=2), metadata=bearer(KEY),
                                                timeout=120) for i in range(SENT)]
    errors = [c.exception(timeout=180) for c in calls]  # (waits for each)
    admitted = [(i, c) for i, (c, e) in enumerate(zip(calls, errors, strict=True)) if e is None]
    refused = [e for e in errors if e is not None]
    split = [sum(i % 2 == g for i, _ in admitted) for g in (0, 1)]
    print(f"admitted {len(admitted)} of {SENT}, by gateway: {split}")
    assert len(admitted) == QUOTA, [e.code() for e in refused]
    assert {e.code() for e in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}, refused[:3]
    for err in refused:
        trailing = dict(err.trailing_metadata())
        assert trailing["x-glmimage-quota"] == "requests_per_minute" and trailing["x-ratelimit-remaining-requests"] \
            == "0", trailing
        assert retry_delay(err) is not None
    # Each admission saw its own count, whichever gateway made it: 19 left down to 0, each once.
    remaining = sorted(int(dict(c.initial_metadata())["x-ratelimit-remaining-requests"]) for _, c in admitted)
    assert remaining == list(range(QUOTA))
    for url in _metrics(stack):
        assert sample(url, UP) == 1
        assert sample(url, "glmimage_gateway_tenant_quota_refusals_total", tenant="counted",
                      quota="requests_per_minute") is not None


def test_redis_gone_both_gateways_serve_from_their_own_counts(stack: TenantStack, redis: RedisServer) -> None:
    redis.stop()
    assert not pings(redis.port)
    stubs = [stack.stub(address) for address in stack.gateways]
    for round_ in range(3):  # several calls each: one warning per gateway, not one per call
        for g, stub in enumerate(stubs):
            # The window in Redis is full; each gateway's own count is not: admitted again.
            reply = stub.GenerateImages(request(f"after {g} {round_}", steps=2), metadata=bearer(KEY), timeout=60)
            assert len(reply.images) == 1
    for url in _metrics(stack):
        assert sample(url, UP) == 0, url
    warnings = [line for line in stack.log_text().splitlines() if "quota store" in line and DOWN_LINE in line]
    assert len(warnings) == 2, warnings
