"""The quota store on a real redis-server (tests/support/redis_server.py): two gateways' Quotas over one Redis count
exactly, a request and its images in one atomic step, tenants in their own keys; Redis killed or frozen mid-run:
admission goes on from the local counts without stalling, one warning says so, ``up`` follows, and a redis-server
started again on the same port brings the global counts back."""
from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from gateway.quota_store import REDIS_TIMEOUT_S, RedisStore, store_from_url, window_key
from gateway.quotas import IMAGES_PER_MINUTE, REQUESTS_PER_MINUTE, WINDOW_S, Quota, Quotas
from tests.support.net import free_port
from tests.support.redis_server import RedisServer, redis_server

LOGGER = "gateway.quota_store"
# A probe a second: 3x margin and more for the store to notice a Redis that is back.
BACK_WITHIN_S = 10.0
SHORT_WINDOW_S = 3.0
# The store's timeout where a test is about what Redis counts, not about a Redis that stalls: the default 0.25 s,
# under a loaded 2-core machine's cold connections and script loads, can run out and count locally instead.
COUNTING_TIMEOUT_S = 5.0
# "A dead Redis never stalls admission": without the store's own timeout a frozen Redis holds an admission forever,
# and 55 admissions that each waited for it would take 55 x 0.25 s. The bound is ten timeouts (one expected, with
# a timing test's 3x margin and more on a loaded 2-core machine), far below either failure.
STALL_S = 10 * REDIS_TIMEOUT_S


@pytest.fixture()
def server(tmp_path: Path) -> Iterator[RedisServer]:
    with redis_server(tmp_path) as srv:
        yield srv


@pytest.fixture()
async def direct(server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    """A plain client, to look at what the stores wrote."""
    client = aioredis.Redis.from_url(server.url, decode_responses=True)
    try:
        yield client
    finally:
        await client.aclose()


class Watched:
    """A store's state changes, as the gateway's metric sees them, with an event per state to wait on."""

    def __init__(self, store: RedisStore) -> None:
        self.states: list[bool] = []
        self.events = {True: asyncio.Event(), False: asyncio.Event()}
        store.on_state(self._seen)

    def _seen(self, up: bool) -> None:
        self.states.append(up)
        self.events[up].set()
        self.events[not up].clear()

    async def wait(self, up: bool, timeout: float) -> None:
        await asyncio.wait_for(self.events[up].wait(), timeout)


def records(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == level]


async def test_two_gateways_admit_exactly_twenty_of_forty_concurrent(server: RedisServer,
                                                                     direct: aioredis.Redis) -> None:
    stores = [RedisStore(server.url, timeout_s=COUNTING_TIMEOUT_S) for _ in range(2)]
    gateways = [Quotas(s) for s in stores]
    quota = Quota(requests_per_minute=20)
    try:
        decisions = await asyncio.gather(*(gateways[i % 2].admit("alpha", quota, 1) for i in range(40)))
    finally:
        for s in stores:
            await s.close()
    admitted = [d for d in decisions if d.allowed]
    assert len(admitted) == 20
    # Each admitted request saw its own count: remaining 19 down to 0, each once, across both gateways.
    assert sorted(int(dict(d.headers)["x-ratelimit-remaining-requests"]) for d in admitted) == list(range(20))
    refused = [d for d in decisions if not d.allowed]
    assert {d.quota for d in refused} == {REQUESTS_PER_MINUTE}
    # (Redis's time left on the window's key: never more than the window, whatever the machine's load)
    assert all(0 < d.retry_after_s <= WINDOW_S for d in refused)
    assert all(dict(d.headers)["x-ratelimit-remaining-requests"] == "0" for d in refused)
    assert await direct.hget(window_key("alpha"), "r") == "20"
    assert 0 < await direct.pttl(window_key("alpha")) <= 60_000


GATEWAY_PROCESS = """
import asyncio, sys
import redis.asyncio as aioredis
from gateway.quota_store import RedisStore
from gateway.quotas import Quota, Quotas

async def main(url):
    store, barrier = RedisStore(url, timeout_s=5.0), aioredis.Redis.from_url(url)
    assert await store.connect()
    q = Quotas(store)
    print("ready", flush=True)
    await barrier.blpop(["test:go"], timeout=60)  # both processes wake on one RPUSH

    async def one(i):  # 20 requests over about 40 ms, overlapping the other process's
        await asyncio.sleep(0.002 * i)
        return await q.admit("alpha", Quota(requests_per_minute=20), 1)

    ds = await asyncio.gather(*(one(i) for i in range(20)))
    print(sum(d.allowed for d in ds), flush=True)
    await store.close()
    await barrier.aclose()

asyncio.run(main(sys.argv[1]))
"""


async def test_two_gateway_processes_admit_exactly_twenty_of_forty(server: RedisServer,
                                                                   direct: aioredis.Redis) -> None:
    """The same across two OS processes, each with its own connections, released together."""
    procs = [subprocess.Popen([sys.executable, "-c", GATEWAY_PROCESS, server.url], stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    loop = asyncio.get_running_loop()
    try:
        for p in procs:
            assert await loop.run_in_executor(None, p.stdout.readline) == "ready\n"
        await direct.rpush("test:go", "go", "go")
        counts = [int(await loop.run_in_executor(None, p.stdout.readline)) for p in procs]
        assert [await loop.run_in_executor(None, p.wait, 60) for p in procs] == [0, 0]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert sum(counts) == 20, counts


async def test_a_request_and_its_images_count_in_one_step(server: RedisServer, direct: aioredis.Redis) -> None:
    stores = [RedisStore(server.url, timeout_s=COUNTING_TIMEOUT_S) for _ in range(2)]
    gateways = [Quotas(s) for s in stores]
    quota = Quota(requests_per_minute=100, images_per_minute=10)
    try:
        decisions = await asyncio.gather(*(gateways[i % 2].admit("beta", quota, 3) for i in range(12)))
        assert sum(d.allowed for d in decisions) == 3  # 9 of 10 images; a fourth would make 12
        assert {d.quota for d in decisions if not d.allowed} == {IMAGES_PER_MINUTE}
        assert await direct.hmget(window_key("beta"), "r", "i") == ["3", "9"]  # refused ones counted nothing
        assert (await gateways[1].admit("beta", quota, 1)).allowed
        assert await gateways[0].snapshot("beta", quota) == (96, 0, 3 * sum(d.allowed for d in decisions[0::2]))
    finally:
        for s in stores:
            await s.close()


async def test_tenants_keep_to_their_own_keys(server: RedisServer, direct: aioredis.Redis) -> None:
    store = RedisStore(server.url, timeout_s=COUNTING_TIMEOUT_S)
    q = Quotas(store)
    try:
        tight = Quota(requests_per_minute=1)
        assert (await q.admit("alpha", tight, 1)).allowed
        assert not (await q.admit("alpha", tight, 1)).allowed
        for _ in range(5):
            assert (await q.admit("beta", Quota(requests_per_minute=5), 2)).allowed
        assert (await q.admit("gamma", Quota(max_inflight_images=9), 1)).allowed  # no window: Redis untouched
    finally:
        await store.close()
    assert sorted(await direct.keys("*")) == [window_key("alpha"), window_key("beta")]
    assert window_key("alpha").startswith("glmimage:quota:alpha:")


async def test_the_window_ends_with_its_key(server: RedisServer) -> None:
    # A window of 3 s: three admissions in a row take milliseconds, so even a loaded machine makes the third inside
    # it (with 0.3 s, one that stalled lets the window end first and the refusal never comes).
    store = RedisStore(server.url, window_s=SHORT_WINDOW_S, timeout_s=COUNTING_TIMEOUT_S)
    q, quota = Quotas(store), Quota(requests_per_minute=2)
    try:
        assert (await q.admit("a", quota, 1)).allowed and (await q.admit("a", quota, 1)).allowed
        refused = await q.admit("a", quota, 1)
        assert not refused.allowed and 0 < refused.retry_after_s <= SHORT_WINDOW_S
        deadline = time.monotonic() + 10
        while not (d := await q.admit("a", quota, 1)).allowed:  # Redis's expiry, on Redis's clock
            assert time.monotonic() < deadline, "the window never closed"
            await asyncio.sleep(0.02)
        assert dict(d.headers)["x-ratelimit-remaining-requests"] == "1"
    finally:
        await store.close()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
async def test_redis_gone_mid_run_admission_goes_on_from_local_counts(
        server: RedisServer, sig: signal.Signals, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    store = RedisStore(server.url)
    watched = Watched(store)
    q = Quotas(store)
    open_quota, tight = Quota(requests_per_minute=1000), Quota(requests_per_minute=3)
    try:
        assert await store.connect() and store.up
        for _ in range(5):
            assert (await q.admit("alpha", open_quota, 1)).allowed
        server.signal(sig)

        t0 = time.monotonic()
        first = await q.admit("alpha", open_quota, 1)  # notices: a refused connection, or its timeout
        first_s = time.monotonic() - t0
        assert first.allowed and not store.up
        assert first_s < STALL_S, f"the first admission without Redis took {first_s:.2f}s"

        t0 = time.monotonic()
        later = [await q.admit("alpha", open_quota, 1) for _ in range(50)]
        tight_ones = [await q.admit("beta", tight, 1) for _ in range(5)]
        later_s = time.monotonic() - t0
        assert all(d.allowed for d in later)
        assert [d.allowed for d in tight_ones] == [True, True, True, False, False]  # local counts still exact
        assert later_s < STALL_S, f"55 admissions while Redis is away took {later_s:.2f}s"
        assert await q.snapshot("beta", tight) == (0, None, 3)

        assert len(records(caplog, logging.WARNING)) == 1, records(caplog, logging.WARNING)
        assert "unreachable" in records(caplog, logging.WARNING)[0]
        assert watched.states == [False, True, False]  # registered while untried (down), then up, then down

        server.restart()  # a new redis-server on the same port (the frozen one killed first)
        await watched.wait(True, BACK_WITHIN_S)
        assert store.up and watched.states == [False, True, False, True]
        assert len([m for m in records(caplog, logging.INFO) if "is back" in m]) == 1
        assert len(records(caplog, logging.WARNING)) == 1

        after = await q.admit("alpha", open_quota, 1)  # a new Redis: a new window there, its script loaded again
        assert after.allowed and dict(after.headers)["x-ratelimit-remaining-requests"] == "999"
    finally:
        await store.close()


async def test_redis_down_at_start_then_started(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    port = free_port()
    store = store_from_url(f"redis://127.0.0.1:{port}/0")
    assert isinstance(store, RedisStore)
    watched = Watched(store)
    q = Quotas(store)
    try:
        assert not await store.connect()
        assert [(await q.admit("a", Quota(requests_per_minute=2), 1)).allowed for _ in range(3)] == [
            True, True, False]
        assert len(records(caplog, logging.WARNING)) == 1 and watched.states == [False]
        with redis_server(tmp_path, port):
            await watched.wait(True, BACK_WITHIN_S)
            assert watched.states == [False, True]
            assert [m for m in records(caplog, logging.INFO) if "is back" in m]
            d = await q.admit("a", Quota(requests_per_minute=2), 1)  # Redis's window, fresh
            assert d.allowed and dict(d.headers)["x-ratelimit-remaining-requests"] == "1"
    finally:
        await store.close()


def test_without_redis_server_the_test_fails_and_names_make_tools(monkeypatch: pytest.MonkeyPatch) -> None:
    import tests.support.redis_server as support

    monkeypatch.setattr(support.shutil, "which", lambda name: None)
    monkeypatch.setattr(support, "DEBIAN_PATH", Path("/nonexistent/redis-server"))
    with pytest.raises(pytest.fail.Exception, match="make tools"):
        support.redis_server_binary()


async def test_an_idle_gap_past_redis_own_idle_timeout_still_counts_there(
        server: RedisServer, direct: aioredis.Redis, caplog: pytest.LogCaptureFixture) -> None:
    """Redis (or a proxy) closes a connection idle past its `timeout`; the next admission must still count in Redis,
    not fall back to the local counts nor log Redis as gone."""
    caplog.set_level(logging.INFO, LOGGER)
    await direct.config_set("timeout", 1)
    store = RedisStore(server.url, timeout_s=COUNTING_TIMEOUT_S)
    q, quota = Quotas(store), Quota(requests_per_minute=5)
    try:
        assert await store.connect()
        assert dict((await q.admit("a", quota, 1)).headers)["x-ratelimit-remaining-requests"] == "4"
        deadline = time.monotonic() + 30
        while len(await direct.client_list()) > 1:  # until Redis has closed the store's idle connection
            assert time.monotonic() < deadline, "Redis never closed the idle connection"
            await direct.ping()  # (keeps this one busy, so it is not closed too)
            await asyncio.sleep(0.2)
        d = await q.admit("a", quota, 1)
        assert store.up and dict(d.headers)["x-ratelimit-remaining-requests"] == "3"
        assert await direct.hget(window_key("a"), "r") == "2"  # both counted in Redis
        assert not records(caplog, logging.WARNING)
    finally:
        await store.close()
