"""Issue 30's done-when on the launcher's stack with ``--tenants FILE`` (real processes, the tiny model): while one
tenant floods 48 concurrent requests, the other's finish within 3x their time alone (before fair share they waited
behind the whole flood); past its quota the light tenant gets OpenAI's 429 with Retry-After and the x-ratelimit-*
headers over REST, RESOURCE_EXHAUSTED with a RetryInfo over gRPC, and the flooding tenant, which has no quota, is
never refused meanwhile.

One denoiser per spare core (two at most, as `make run`): on a 2-core machine the AR and two denoisers would share
the cores and a flood would slow every stage's compute, whatever the order the scheduler serves them in; the bound
is about that order.
"""
from __future__ import annotations

import concurrent.futures as cf
import os
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from glmimage.v1 import gateway_service_pb2 as pb
from runtime.details import retry_delay
from tests.support.tenants_stack import (
    GENERATIONS,
    RATE_LIMIT_HEADERS,
    TenantStack,
    bearer,
    request,
    rest_body,
    seconds_of_reset,
    tenant_stack,
    write_tenants,
)
from tests.support.waiting import until

pytestmark = pytest.mark.e2e

HEAVY, LIGHT = "sk-heavy-1", "sk-light-1"
FLOOD = 48
ALONE_RUNS, FLOOD_RUNS = 5, 8  # light's requests: 13 in all, under its quota of 16
QUOTA = 16  # light's requests_per_minute and images_per_minute
QUICK = 2  # steps of the quota test's requests: what they are refused or admitted for is not their work
# Steps of the fairness test's requests: at 64x64 half a second's denoising each, as long as their AR's share, so the
# flood queues at both stages (the stack's STEPS, twice this, doubles the denoisers' work and shows nothing more).
FLOOD_STEPS = 48
# The figure is light under the flood within 3x its time alone (measured here at 1.5-2.8x on a loaded 2-core
# machine, printed by the test; the scheduler's own figure is bench/tenants_sim's). A timing bound in a test carries
# a 3x margin on such a machine, so the hard bound is 9x; FIFO, behind the whole flood, is some 40x. The order itself
# is checked exactly: light's first request is back while most of the flood still waits.
BOUND = 3.0 * 3
DENOISERS = max(1, min(2, (os.cpu_count() or 1) - 1))
TENANTS = {
    "heavy": {"keys": [HEAVY], "weight": 1},
    "light": {"keys": [LIGHT], "weight": 1, "requests_per_minute": QUOTA, "images_per_minute": QUOTA},
}


@pytest.fixture(scope="module")
def stack(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TenantStack]:
    run_dir = tmp_path_factory.mktemp("tenants-e2e")
    write_tenants(run_dir / "tenants.toml", TENANTS)
    with tenant_stack(run_dir, run_dir / "tenants.toml", denoisers=DENOISERS) as run:
        yield run


def _tenant(stub, key: str) -> pb.TenantStatus:
    (own,) = stub.GetStatus(pb.GetStatusRequest(), metadata=bearer(key), timeout=10).tenants  # a user sees its own
    return own


def test_light_tenant_beside_a_flood_finishes_within_3x_its_time_alone(stack: TenantStack) -> None:
    heavy, light = stack.stub(), stack.stub()

    def timed(i: int) -> float:
        t0 = time.monotonic()
        reply = light.GenerateImages(request("a light tenant's lamp", seed=i, steps=FLOOD_STEPS),
                                     metadata=bearer(LIGHT), timeout=120)
        assert len(reply.images) == 1
        return time.monotonic() - t0

    timed(0)  # the first call of a fresh stack pays for connections; not part of either figure
    alone = [timed(1 + i) for i in range(ALONE_RUNS - 1)]

    t0 = time.monotonic()
    flood = [heavy.GenerateImages.future(request("a heavy tenant's flood", seed=i, steps=FLOOD_STEPS),
                                         metadata=bearer(HEAVY), timeout=300) for i in range(FLOOD)]
    before = _tenant(heavy, HEAVY).requests_total
    # Every one of the flood admitted (running, queued or done) before light asks again.
    until(lambda: (s := _tenant(heavy, HEAVY)).active_requests + s.requests_total - before >= FLOOD, 60,
          "the flood to be admitted")
    under, behind = [], []
    while len(under) < FLOOD_RUNS and not all(f.done() for f in flood):
        under.append(timed(100 + len(under)))
        behind.append(sum(not f.done() for f in flood))  # heavy's requests still unanswered when light's came back
    failed = [f.exception() for f in flood if f.exception() is not None]
    assert not failed, f"{len(failed)} of heavy's {FLOOD} requests failed: {failed[:3]}"
    took = time.monotonic() - t0

    ratio = statistics.median(under) / statistics.median(alone)
    report = (f"light alone {[round(t, 3) for t in alone]} s, beside the flood {[round(t, 3) for t in under]} s "
              f"(heavy unanswered then: {behind}); ratio of medians {ratio:.2f}; the flood took {took:.1f} s")
    print(report)
    # Light's requests ran while heavy still had a backlog, else the comparison shows nothing.
    measured = [t for t, left in zip(under, behind, strict=True) if left > 0]
    assert len(measured) >= 3, report
    assert behind[0] > FLOOD // 2, report  # served beside the backlog, not behind it
    assert ratio <= BOUND, report


def _headers_ok(headers, remaining_requests: str | None = None) -> dict[str, str]:
    """The six x-ratelimit-* headers, with light's limits and well-formed figures."""
    figures = {name: headers.get(name) for name in RATE_LIMIT_HEADERS}
    assert None not in figures.values(), headers
    assert figures["x-ratelimit-limit-requests"] == figures["x-ratelimit-limit-images"] == str(QUOTA), figures
    assert 0 <= int(figures["x-ratelimit-remaining-requests"]) < QUOTA, figures
    assert 0 <= int(figures["x-ratelimit-remaining-images"]) < QUOTA, figures
    for reset in ("x-ratelimit-reset-requests", "x-ratelimit-reset-images"):
        assert 0 < seconds_of_reset(figures[reset]) <= 60, figures
    if remaining_requests is not None:
        assert figures["x-ratelimit-remaining-requests"] == remaining_requests, figures
    return figures


def _refused_over_grpc(stub, n: int, quota: str) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        stub.GenerateImages(request("one more", n=n, steps=QUICK), metadata=bearer(LIGHT), timeout=30)
    err = caught.value
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
    trailing = dict(err.trailing_metadata())
    assert trailing.get("x-glmimage-quota") == quota, trailing
    delay = retry_delay(err)  # the google.rpc.RetryInfo detail
    assert delay is not None and 0 < delay <= 60, err
    assert int(trailing["retry-after"]) >= 1
    assert {k for k in trailing if k.startswith("x-ratelimit-")} == set(RATE_LIMIT_HEADERS), trailing


def _refused_over_rest(http, n: int) -> dict[str, str]:
    resp = http.post(GENERATIONS, json=rest_body("one more", n=n, steps=QUICK),
                     headers={"Authorization": f"Bearer {LIGHT}"})
    assert resp.status_code == 429, resp.text
    error = resp.json()["error"]
    assert error["type"] == error["code"] == "rate_limit_exceeded", error
    assert int(resp.headers["retry-after"]) >= 1, resp.headers
    return _headers_ok(resp.headers)


def test_light_past_its_quota_gets_429_and_resource_exhausted_and_heavy_is_never_refused(stack: TenantStack) -> None:
    light = stack.stub()
    key = {"Authorization": f"Bearer {LIGHT}"}
    with stack.rest() as http, cf.ThreadPoolExecutor(4) as pool:
        def heavy_call(i: int) -> int:  # heavy keeps asking throughout, with no quota of its own
            resp = http.post(GENERATIONS, json=rest_body("heavy meanwhile", seed=i, steps=QUICK),
                             headers={"Authorization": f"Bearer {HEAVY}"})
            assert not any(h in resp.headers for h in RATE_LIMIT_HEADERS), resp.headers
            return resp.status_code

        def admitted() -> dict[str, str]:
            resp = http.post(GENERATIONS, json=rest_body("light", steps=QUICK), headers=key)
            assert resp.status_code == 200, resp.text
            return _headers_ok(resp.headers)

        heavy = [pool.submit(heavy_call, i) for i in range(4)]
        figures = admitted()
        # Light's window opened with its first request of this module. Too little of it left for the steps below:
        # let it close (GetStatus counts nothing), then a fresh one opens.
        if seconds_of_reset(figures["x-ratelimit-reset-requests"]) < 20:
            until(lambda: _tenant(light, LIGHT).remaining_requests == QUOTA, 30, "light's window to close", step=0.2)
            figures = admitted()
        # Down to one request and one image left (light asks one image at a time): each answer one fewer.
        left = int(figures["x-ratelimit-remaining-requests"])
        assert figures["x-ratelimit-remaining-images"] == str(left)
        while left > 1:
            figures = admitted()
            assert int(figures["x-ratelimit-remaining-requests"]) == left - 1, figures
            left -= 1
            heavy.append(pool.submit(heavy_call, len(heavy)))

        # Two images with one left: the images quota refuses (requests has room).
        _refused_over_grpc(light, 2, "images_per_minute")
        assert _refused_over_rest(http, 2)["x-ratelimit-remaining-requests"] == "1"
        # The last request of the window, then the requests quota refuses.
        last = admitted()
        assert (last["x-ratelimit-remaining-requests"], last["x-ratelimit-remaining-images"]) == ("0", "0")
        refused = _refused_over_rest(http, 1)
        assert refused["x-ratelimit-remaining-requests"] == "0"
        _refused_over_grpc(light, 1, "requests_per_minute")
        assert _tenant(light, LIGHT).remaining_requests == 0

        codes = [f.result() for f in heavy]
    assert codes == [200] * len(codes), codes
