"""The quota policy over this process's counts (gateway.quotas over gateway.quota_store.LocalStore), on an injected
clock: exact one-minute windows that open at a tenant's first counted request, images counted with their request,
images in flight bounded and released on every path, OpenAI's headers and durations, and tenants apart."""
from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.quota_store import LocalStore, parse_redis_url, store_from_url, window_key
from gateway.quotas import (
    IMAGES_PER_MINUTE,
    MAX_INFLIGHT_IMAGES,
    REQUESTS_PER_MINUTE,
    Quota,
    QuotaDecision,
    Quotas,
    Window,
    format_reset,
    rate_headers,
    window_refusal,
)
from gateway.tenancy import TenantGate
from runtime.details import OWN_ERROR_KEY, rich_status
from runtime.errors import ResourceExhausted
from runtime.tenants import Tenant

T = TypeVar("T")


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def done(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine that must finish without ever suspending: LocalStore's steps are atomic on the event loop."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise AssertionError("suspended: a LocalStore step awaited something")


def quotas(clock: Clock) -> Quotas:
    return Quotas(LocalStore(clock))


def admit(q: Quotas, tenant: str, quota: Quota, images: int = 1) -> QuotaDecision:
    return done(q.admit(tenant, quota, images))


# ---- durations -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("seconds", "text"), [
    (0, "0s"), (-1, "0s"), (0.25, "250ms"), (0.007, "7ms"), (0.0001, "1ms"), (0.9994, "1s"),
    (1, "1s"), (12, "12s"), (11.2, "12s"), (59.001, "1m0s"), (60, "1m0s"), (61, "1m1s"), (90.5, "1m31s"),
    (3600, "1h0m0s"), (3725, "1h2m5s"),
])
def test_format_reset_is_openais_duration_form(seconds: float, text: str) -> None:
    assert format_reset(seconds) == text


@given(st.floats(min_value=0.001, max_value=100_000, allow_nan=False))
def test_format_reset_never_understates(seconds: float) -> None:
    text = format_reset(seconds)
    if text.endswith("ms"):
        assert seconds * 1000 - 1e-6 <= int(text[:-2]) < seconds * 1000 + 1.000001
        return
    total, rest = 0, text
    for unit, scale in (("h", 3600), ("m", 60), ("s", 1)):
        if unit in rest:
            n, rest = rest.split(unit, 1)
            total += int(n) * scale
    assert rest == "" and seconds - 1e-9 <= total < seconds + 1.001


# ---- windows -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("start", [0.0, 59.9, 60.0, 119.99, 1_000_000.5])
def test_twenty_a_minute_admits_exactly_twenty_of_forty_wherever_the_minute_falls(start: float) -> None:
    clock = Clock(start)
    q, quota = quotas(clock), Quota(requests_per_minute=20)
    admitted = 0
    for i in range(40):  # one every 1.5 s: all 40 within 58.5 s of the first
        clock.now = start + 1.5 * i
        d = admit(q, "alpha", quota)
        admitted += d.allowed
        q.release("alpha", 1)
    assert admitted == 20


def test_the_window_opens_at_the_first_counted_request_and_lasts_a_minute() -> None:
    clock = Clock(0.0)
    q, quota = quotas(clock), Quota(requests_per_minute=2)
    clock.now = 10.0
    assert admit(q, "a", quota).allowed  # opens the window: 10 .. 70
    clock.now = 69.0
    assert admit(q, "a", quota).allowed
    refused = admit(q, "a", quota)
    assert not refused.allowed and refused.quota == REQUESTS_PER_MINUTE
    assert refused.retry_after_s == pytest.approx(1.0)
    clock.now = 69.999
    assert not admit(q, "a", quota).allowed
    clock.now = 70.0  # closed: the next one opens a new window, 70 .. 130
    d = admit(q, "a", quota)
    assert d.allowed and dict(d.headers)["x-ratelimit-reset-requests"] == "1m0s"
    assert dict(d.headers)["x-ratelimit-remaining-requests"] == "1"


def test_a_refused_request_counts_nothing_and_opens_no_window() -> None:
    clock = Clock(0.0)
    store = LocalStore(clock)
    q, quota = Quotas(store), Quota(images_per_minute=4)
    d = admit(q, "a", quota, images=5)  # larger than the whole quota: refused in a fresh window
    assert not d.allowed and d.quota == IMAGES_PER_MINUTE
    assert done(store.peek("a")) == Window()
    assert d.retry_after_s == 60.0 and "at most 4" in d.message
    assert admit(q, "a", quota, images=4).allowed
    assert done(store.peek("a")) == Window(requests=1, images=4, reset_s=60.0)


def test_images_are_counted_with_their_request_and_refuse_when_they_would_pass() -> None:
    clock = Clock(0.0)
    q, quota = quotas(clock), Quota(requests_per_minute=10, images_per_minute=8)
    assert admit(q, "a", quota, images=3).allowed
    assert admit(q, "a", quota, images=4).allowed  # 7 of 8
    clock.now = 20.0
    d = admit(q, "a", quota, images=2)  # 9 would pass 8: refused, neither count moves
    assert not d.allowed and d.quota == IMAGES_PER_MINUTE
    assert d.retry_after_s == pytest.approx(40.0)
    assert "used 7" in d.message and "images_per_minute quota of 8" in d.message and "retry in 40s" in d.message
    h = dict(d.headers)
    assert h["x-ratelimit-remaining-requests"] == "8" and h["x-ratelimit-remaining-images"] == "1"
    assert admit(q, "a", quota, images=1).allowed  # exactly the 8th image
    assert not admit(q, "a", quota, images=1).allowed


def test_requests_are_checked_before_images() -> None:
    quota = Quota(requests_per_minute=1, images_per_minute=1)
    assert window_refusal(quota, Window(1, 1, 5.0), 1) == REQUESTS_PER_MINUTE
    assert window_refusal(quota, Window(0, 1, 5.0), 1) == IMAGES_PER_MINUTE
    assert window_refusal(quota, Window(0, 0, 0.0), 1) == ""
    assert window_refusal(Quota(max_inflight_images=1), Window(10**6, 10**6, 1.0), 10**6) == ""


# ---- in flight ---------------------------------------------------------------------------------------------------

def test_inflight_images_are_bounded_and_released() -> None:
    q, quota = quotas(Clock()), Quota(max_inflight_images=4)
    assert admit(q, "a", quota, images=3).allowed
    d = admit(q, "a", quota, images=2)
    assert not d.allowed and d.quota == MAX_INFLIGHT_IMAGES and d.retry_after_s == 1.0
    assert "3 images in flight" in d.message and "max_inflight_images quota is 4" in d.message
    assert d.headers == ()  # no per-minute quota: no x-ratelimit headers
    assert admit(q, "a", quota, images=1).allowed  # 4 of 4
    q.release("a", 3)
    assert q.inflight("a") == 1
    assert admit(q, "a", quota, images=3).allowed
    assert Quota(max_inflight_images=4).too_large(5) == MAX_INFLIGHT_IMAGES
    assert "at most 4" in admit(q, "b", quota, images=5).message


def test_release_never_goes_below_zero() -> None:
    q = quotas(Clock())
    q.release("a", 5)
    assert q.inflight("a") == 0
    assert admit(q, "a", Quota(max_inflight_images=2), images=2).allowed
    q.release("a", 2)
    q.release("a", 2)  # a second release on another exit path takes nothing from later requests
    assert q.inflight("a") == 0


def test_a_refusal_by_the_window_holds_no_inflight_images() -> None:
    q, quota = quotas(Clock()), Quota(requests_per_minute=1, max_inflight_images=10)
    assert admit(q, "a", quota, images=2).allowed
    assert not admit(q, "a", quota, images=2).allowed
    assert q.inflight("a") == 2


class _Hanging:
    """A store whose count never answers: the admission is cancelled while waiting (the client went away)."""

    up = True

    def __init__(self) -> None:
        self.entered = asyncio.Event()

    async def count(self, tenant: str, quota: Quota, images: int) -> tuple[str, Window]:
        self.entered.set()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def peek(self, tenant: str) -> Window:
        return Window()

    def on_state(self, callback: Any) -> None:
        callback(True)

    async def close(self) -> None:
        pass


class _Broken(_Hanging):
    async def count(self, tenant: str, quota: Quota, images: int) -> tuple[str, Window]:
        raise RuntimeError("store bug")


async def test_a_cancelled_or_failed_admission_gives_its_reservation_back() -> None:
    store = _Hanging()
    q = Quotas(store)
    quota = Quota(requests_per_minute=5, max_inflight_images=4)
    task = asyncio.create_task(q.admit("a", quota, 3))
    await store.entered.wait()
    assert q.inflight("a") == 3  # reserved while the store decides: a concurrent admission sees it
    assert (await q.admit("a", quota, 2)).quota == MAX_INFLIGHT_IMAGES  # 3 + 2 > 4, while the first waits
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert q.inflight("a") == 0
    broken = Quotas(_Broken())
    with pytest.raises(RuntimeError):
        await broken.admit("a", quota, 3)
    assert broken.inflight("a") == 0


async def test_concurrent_admissions_cannot_both_pass_the_inflight_bound() -> None:
    class Slow(LocalStore):
        async def count(self, tenant: str, quota: Quota, images: int) -> tuple[str, Window]:
            await asyncio.sleep(0)  # a store that suspends, as Redis does
            return self.count_now(tenant, quota, images)

    q = Quotas(Slow())
    quota = Quota(requests_per_minute=100, max_inflight_images=4)
    decisions = await asyncio.gather(*(q.admit("a", quota, 1) for _ in range(10)))
    assert sum(d.allowed for d in decisions) == 4
    assert q.inflight("a") == 4


# ---- headers, messages, tenants -----------------------------------------------------------------------------------

def test_headers_are_the_six_of_the_quotas_the_tenant_has() -> None:
    clock = Clock(0.0)
    q = quotas(clock)
    both = admit(q, "a", Quota(requests_per_minute=30, images_per_minute=60), images=4)
    assert both.headers == (
        ("x-ratelimit-limit-requests", "30"), ("x-ratelimit-remaining-requests", "29"),
        ("x-ratelimit-reset-requests", "1m0s"),
        ("x-ratelimit-limit-images", "60"), ("x-ratelimit-remaining-images", "56"),
        ("x-ratelimit-reset-images", "1m0s"))
    clock.now = 47.75
    only_images = admit(q, "b", Quota(images_per_minute=6), images=2)
    assert [k for k, _ in only_images.headers] == [
        "x-ratelimit-limit-images", "x-ratelimit-remaining-images", "x-ratelimit-reset-images"]
    later = admit(q, "a", Quota(requests_per_minute=30, images_per_minute=60), images=1)
    assert dict(later.headers)["x-ratelimit-reset-requests"] == "13s"  # 60 - 47.75 = 12.25 s, rounded up
    assert dict(later.headers)["x-ratelimit-remaining-images"] == "55"
    assert admit(q, "c", Quota()).headers == ()
    assert admit(q, "c", Quota(max_inflight_images=3)).headers == ()


def test_remaining_never_shows_below_zero() -> None:
    headers = dict(rate_headers(Quota(requests_per_minute=5), Window(requests=9, images=0, reset_s=3.0)))
    assert headers == {"x-ratelimit-limit-requests": "5", "x-ratelimit-remaining-requests": "0",
                       "x-ratelimit-reset-requests": "3s"}


def test_refusal_trailers_and_retry_after() -> None:
    """What a refused call carries, as the gateway sends it: TenantGate's error through rich_status (the one place
    the retry-after and RetryInfo are written)."""
    clock = Clock(0.0)
    q = quotas(clock)
    gate, tenant = TenantGate(q), Tenant("a", requests_per_minute=1)
    done(gate.admit(tenant, 1)).end("ok")
    clock.now = 59.6
    with pytest.raises(ResourceExhausted) as err:
        done(gate.admit(tenant, 1))
    assert err.value.retry_after == pytest.approx(0.4)
    status = rich_status(err.value)
    assert {k: v for k, v in status.trailing_metadata if k != "grpc-status-details-bin"} == {
        "x-ratelimit-limit-requests": "1", "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-reset-requests": "400ms", "retry-after": "1", "x-glmimage-quota": REQUESTS_PER_MINUTE,
        OWN_ERROR_KEY: "1"}


def test_messages_name_the_quota_and_when_never_an_address() -> None:
    clock = Clock(0.0)
    q, quota = quotas(clock), Quota(requests_per_minute=1, images_per_minute=1, max_inflight_images=1)
    assert admit(q, "beta", quota).allowed
    clock.now = 48.0
    for d in (admit(q, "beta", quota), admit(q, "beta", Quota(images_per_minute=1))):
        assert not d.allowed and d.quota in d.message and "beta" in d.message
        assert "retry" in d.message and "127.0.0.1" not in d.message and "redis" not in d.message
    assert "retry in 12s" in admit(q, "beta", Quota(requests_per_minute=1)).message


def test_one_tenants_quota_never_refuses_another() -> None:
    clock = Clock(0.0)
    q = quotas(clock)
    tight = Quota(requests_per_minute=1, images_per_minute=1, max_inflight_images=1)
    assert admit(q, "alpha", tight).allowed
    assert not admit(q, "alpha", tight).allowed
    for _ in range(50):
        assert admit(q, "beta", Quota(requests_per_minute=50, max_inflight_images=50)).allowed
        assert admit(q, "gamma", Quota()).allowed
    assert q.inflight("alpha") == 1
    assert done(q.snapshot("alpha", tight)) == (0, 0, 1)
    assert done(q.snapshot("beta", Quota(requests_per_minute=50))) == (0, None, 50)
    assert window_key("alpha") != window_key("beta") and window_key("alpha").startswith("glmimage:quota:alpha:")


def test_snapshot_of_a_tenant_without_quotas_or_window() -> None:
    q = quotas(Clock())
    assert done(q.snapshot("a", Quota())) == (None, None, 0)
    assert done(q.snapshot("a", Quota(requests_per_minute=3, images_per_minute=7))) == (3, 7, 0)


# ---- random sequences against a model --------------------------------------------------------------------------

@dataclass
class ModelTenant:
    """The specification spelled out again, plainly: when the open window ends, what it counted, what is in flight."""

    quota: Quota
    window_ends: float | None = None  # None: no window open
    requests: int = 0
    images: int = 0
    inflight: list[int] = field(default_factory=list)

    def admit(self, now: float, images: int) -> str:
        if self.window_ends is not None and now >= self.window_ends:
            self.window_ends, self.requests, self.images = None, 0, 0
        q = self.quota
        if q.max_inflight_images is not None and sum(self.inflight) + images > q.max_inflight_images:
            return MAX_INFLIGHT_IMAGES
        if q.requests_per_minute is not None and self.requests + 1 > q.requests_per_minute:
            return REQUESTS_PER_MINUTE
        if q.images_per_minute is not None and self.images + images > q.images_per_minute:
            return IMAGES_PER_MINUTE
        if self.window_ends is None:
            self.window_ends = now + 60.0
        self.requests += 1
        self.images += images
        self.inflight.append(images)
        return ""


QUOTA = st.builds(Quota, st.none() | st.integers(1, 6), st.none() | st.integers(1, 12), st.none() | st.integers(1, 6))
STEP = st.one_of(
    st.tuples(st.just("tick"), st.floats(0.0, 45.0) | st.sampled_from([0.001, 1.0, 30.0, 59.999, 60.0])),
    st.tuples(st.just("admit"), st.sampled_from(["a", "b", "c"]), st.integers(1, 4)),
    st.tuples(st.just("release"), st.sampled_from(["a", "b", "c"]), st.integers(0, 5)),
)


@settings(max_examples=300, deadline=None)
@given(st.fixed_dictionaries({"a": QUOTA, "b": QUOTA, "c": QUOTA}), st.lists(STEP, max_size=80))
def test_random_sequences_match_the_model(tenant_quotas: dict[str, Quota], steps: list[tuple]) -> None:
    clock = Clock(500.0)
    q = quotas(clock)
    model = {t: ModelTenant(quota) for t, quota in tenant_quotas.items()}
    for step in steps:
        if step[0] == "tick":
            clock.now += step[1]
            continue
        _, tenant, n = step
        m = model[tenant]
        if step[0] == "release":
            if m.inflight:  # the n-th oldest admitted request ends
                images = m.inflight.pop(n % len(m.inflight))
                q.release(tenant, images)
            continue
        expected = m.admit(clock.now, n)
        d = admit(q, tenant, tenant_quotas[tenant], n)
        assert (d.allowed, d.quota) == (expected == "", expected), (tenant, n, clock.now)
        assert q.inflight(tenant) == sum(m.inflight) >= 0
        headers = dict(d.headers)
        quota = tenant_quotas[tenant]
        if quota.requests_per_minute is not None and expected != MAX_INFLIGHT_IMAGES:
            assert int(headers["x-ratelimit-remaining-requests"]) == max(0, quota.requests_per_minute - m.requests)
        if quota.images_per_minute is not None and expected != MAX_INFLIGHT_IMAGES:
            assert int(headers["x-ratelimit-remaining-images"]) == max(0, quota.images_per_minute - m.images)
        if quota.windowed and expected != MAX_INFLIGHT_IMAGES:
            reset = format_reset(0.0 if m.window_ends is None else m.window_ends - clock.now)
            assert {v for k, v in d.headers if k.startswith("x-ratelimit-reset-")} == {reset}
        if not d.allowed:
            assert d.retry_after_s > 0  # (its whole seconds: rich_status, test_refusal_trailers_and_retry_after)
        if quota.requests_per_minute is not None:
            assert m.requests <= quota.requests_per_minute
        if quota.images_per_minute is not None:
            assert m.images <= quota.images_per_minute


# ---- the store's URL -----------------------------------------------------------------------------------------------

def test_store_from_url() -> None:
    assert isinstance(store_from_url(None), LocalStore) and isinstance(store_from_url(""), LocalStore)
    a = parse_redis_url("redis://10.0.0.7:6380/3")
    assert (a.host, a.port, a.db, a.password) == ("10.0.0.7", 6380, 3, None)
    assert str(parse_redis_url("redis://:s3cret@cache")) == "redis://cache:6379/0"
    assert parse_redis_url("redis://:s3cret@cache").password == "s3cret"


@pytest.mark.parametrize(("url", "why"), [
    ("http://cache:6379/0", "not scheme 'http'"),
    ("cache:6379", "expected redis://HOST:PORT/N"),
    ("redis://:6379/0", "names no host"),
    ("redis://cache:port/0", "expected redis://HOST:PORT/N"),
    ("redis://cache:99999/0", "expected redis://HOST:PORT/N"),
    ("redis://cache:6379/zero", "the database N is a number"),
    ("redis://cache:6379/0?timeout=1", "no query"),
])
def test_a_bad_store_url_is_a_clear_value_error(url: str, why: str) -> None:
    with pytest.raises(ValueError, match=why.replace("?", r"\?")):
        store_from_url(url)


def test_a_bad_store_url_never_echoes_its_password() -> None:
    with pytest.raises(ValueError) as e:
        store_from_url("redis://:hunter2@cache:6379/x")
    assert "hunter2" not in str(e.value)
