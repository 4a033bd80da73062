"""Where the per-minute quota windows are counted (gateway.quotas): this process, or one Redis for every gateway.

``LocalStore`` counts in this process: without ``--quota-store`` each gateway counts on its own, so N gateways
behind one REST front admit up to N times a tenant's quota. ``RedisStore`` (``--quota-store redis://HOST:PORT/N``)
counts in Redis, global and exact across gateways: one Lua script per decision reads, checks and counts a tenant's
window atomically, and Redis's own key expiry ends the window, so no two gateways' clocks need agree.

Redis down or slow never stalls admission: every call is bounded by a short timeout (0.25 s), and on a failure the
store counts on its local counts instead, says so once in the log (a warning, and an info when Redis is back, never
one per request) and through ``up`` and ``on_state`` (the gateway's glmimage_gateway_quota_store_up). While it is
down no request touches Redis; a background probe PINGs it about once a second. What the gateway counted locally
meanwhile is not carried into Redis when it returns (the windows are a minute long); a call that timed out may still
have counted in Redis, so an outage errs towards counting a request twice, never towards admitting too many.
"""

from __future__ import annotations

import asyncio
import logging
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass

from gateway.quotas import WINDOW_S, Quota, Window, window_refusal

log = logging.getLogger(__name__)

KEY_PREFIX = "glmimage:quota:"
REDIS_TIMEOUT_S = 0.25
RETRY_EVERY_S = 1.0

# KEYS[1]: the tenant's window, a hash (r: requests, i: images) that expires when the window closes.
# ARGV: requests limit, images limit (-1: none), images asked, window length in ms.
# Returns {refused quota or "", requests, images, ms until the window closes (0: none open)}.
COUNT_LUA = """
local key = KEYS[1]
local rl, il, n, win = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local r = tonumber(redis.call('HGET', key, 'r') or 0)
local i = tonumber(redis.call('HGET', key, 'i') or 0)
local ttl = redis.call('PTTL', key)
local refused = ''
if rl >= 0 and r + 1 > rl then
  refused = 'requests_per_minute'
elseif il >= 0 and i + n > il then
  refused = 'images_per_minute'
end
if refused == '' then
  r = redis.call('HINCRBY', key, 'r', 1)
  i = redis.call('HINCRBY', key, 'i', n)
  if ttl < 0 then
    redis.call('PEXPIRE', key, win)
    ttl = win
  end
end
if ttl < 0 then ttl = 0 end
return {refused, r, i, ttl}
"""

PEEK_LUA = """
local ttl = redis.call('PTTL', KEYS[1])
if ttl < 0 then return {0, 0, 0} end
return {tonumber(redis.call('HGET', KEYS[1], 'r') or 0), tonumber(redis.call('HGET', KEYS[1], 'i') or 0), ttl}
"""


def window_key(tenant: str) -> str:
    """One key per tenant; tenant names (runtime.tenants) hold no ':', and the fixed suffix keeps keys
    apart anyway."""
    return f"{KEY_PREFIX}{tenant}:window"


@dataclass
class _Open:
    ends: float  # clock seconds
    requests: int = 0
    images: int = 0


class LocalStore:
    """This process's windows, on an injectable monotonic clock. Its steps never await: atomic on the event loop."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, window_s: float = WINDOW_S) -> None:
        self.clock = clock
        self.window_s = window_s
        self._open: dict[str, _Open] = {}

    @property
    def up(self) -> bool:
        return True

    def _current(self, tenant: str, now: float) -> _Open | None:
        w = self._open.get(tenant)
        if w is not None and now >= w.ends:
            del self._open[tenant]
            return None
        return w

    def count_now(self, tenant: str, quota: Quota, images: int) -> tuple[str, Window]:
        now = self.clock()
        w = self._current(tenant, now)
        before = Window() if w is None else Window(w.requests, w.images, w.ends - now)
        which = window_refusal(quota, before, images)
        if which:
            return which, before
        if w is None:
            w = self._open[tenant] = _Open(now + self.window_s)
        w.requests += 1
        w.images += images
        return "", Window(w.requests, w.images, w.ends - now)

    def peek_now(self, tenant: str) -> Window:
        now = self.clock()
        w = self._current(tenant, now)
        return Window() if w is None else Window(w.requests, w.images, w.ends - now)

    async def count(self, tenant: str, quota: Quota, images: int) -> tuple[str, Window]:
        return self.count_now(tenant, quota, images)

    async def peek(self, tenant: str) -> Window:
        return self.peek_now(tenant)

    def on_state(self, callback: Callable[[bool], None]) -> None:
        callback(True)

    async def close(self) -> None:
        pass


@dataclass(frozen=True)
class RedisAddress:
    host: str
    port: int
    db: int
    username: str | None = None
    password: str | None = None

    def __str__(self) -> str:  # for logs: never the password
        return f"redis://{self.host}:{self.port}/{self.db}"


def parse_redis_url(url: str) -> RedisAddress:
    """``redis://[[USER]:PASSWORD@]HOST[:PORT][/N]``; ValueError naming what is wrong (never echoing a password)."""
    form = "expected redis://HOST:PORT/N"
    try:
        u = urllib.parse.urlsplit(url)
        port = u.port
    except ValueError as e:  # a port that is not a number, or out of range
        raise ValueError(f"quota store URL: {form} ({e})") from None
    if u.scheme != "redis":
        raise ValueError(f"quota store URL: {form}, not scheme {u.scheme or '(none)'!r}")
    if not u.hostname:
        raise ValueError(f"quota store URL: {form}; it names no host")
    if u.query or u.fragment:
        raise ValueError(f"quota store URL: {form}; it takes no query or fragment")
    path = u.path.strip("/")
    if path and not (path.isdigit() and path.isascii()):
        raise ValueError(f"quota store URL: {form}; the database N is a number, not {path!r}")
    return RedisAddress(u.hostname, port or 6379, int(path or 0), u.username or None,
                        urllib.parse.unquote(u.password) if u.password else None)


class RedisStore:
    """Windows in Redis, shared by every gateway pointed at it; this process's LocalStore while Redis is away."""

    def __init__(self, url: str, *, timeout_s: float = REDIS_TIMEOUT_S, retry_every_s: float = RETRY_EVERY_S,
                 window_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic) -> None:
        import redis.asyncio as aioredis  # the gateway extra; only a gateway given --quota-store needs it
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        self.address = parse_redis_url(url)
        self.timeout_s = timeout_s
        self.retry_every_s = retry_every_s
        self.window_ms = round(window_s * 1000)
        self.local = LocalStore(clock, window_s)
        a = self.address
        # One retry at once, no backoff, all within the one bounded wait of each call (asyncio.wait_for below): a
        # pooled connection that Redis or a proxy closed while idle (Redis's `timeout`, a load balancer's idle cut)
        # fails at once on its next use, and the retry on a new connection must count there, not fall back to the
        # local counts (nor log Redis as gone). Its default backs off and retries thrice, past any bound.
        self._redis = aioredis.Redis(host=a.host, port=a.port, db=a.db, username=a.username, password=a.password,
                                     socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                     retry=Retry(NoBackoff(), 1), decode_responses=True)
        # EVALSHA, loading the script again after a NOSCRIPT (a restarted Redis has an empty script cache).
        self._count = self._redis.register_script(COUNT_LUA)
        self._peek = self._redis.register_script(PEEK_LUA)
        self._up: bool | None = None  # None: not tried yet
        self._callbacks: list[Callable[[bool], None]] = []
        self._probe: asyncio.Task | None = None

    @property
    def up(self) -> bool:
        return self._up is True

    def on_state(self, callback: Callable[[bool], None]) -> None:
        """``callback(up)`` now and on every change."""
        self._callbacks.append(callback)
        callback(self.up)

    async def connect(self) -> bool:
        """Try Redis once (start-up): up or not, and the log says which. Admission works either way."""
        try:
            await asyncio.wait_for(self._redis.ping(), self.timeout_s)
        except Exception as e:  # any failure to reach it means the same: count locally
            self._went_down(e)
        else:
            self._came_up()
        return self.up

    async def count(self, tenant: str, quota: Quota, images: int) -> tuple[str, Window]:
        if self._up is False:
            return self.local.count_now(tenant, quota, images)
        rpm, ipm = quota.requests_per_minute, quota.images_per_minute
        args = [-1 if rpm is None else rpm, -1 if ipm is None else ipm, images, self.window_ms]
        try:
            which, requests, imgs, ttl = await asyncio.wait_for(
                self._count(keys=[window_key(tenant)], args=args), self.timeout_s)
        except Exception as e:  # timeouts, refused connections, a Redis error reply alike
            self._went_down(e)
            return self.local.count_now(tenant, quota, images)
        self._came_up()
        return which, Window(int(requests), int(imgs), int(ttl) / 1000)

    async def peek(self, tenant: str) -> Window:
        if self._up is False:
            return self.local.peek_now(tenant)
        try:
            requests, imgs, ttl = await asyncio.wait_for(self._peek(keys=[window_key(tenant)]), self.timeout_s)
        except Exception as e:
            self._went_down(e)
            return self.local.peek_now(tenant)
        self._came_up()
        return Window(int(requests), int(imgs), int(ttl) / 1000)

    async def close(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
            self._probe = None
        await self._redis.aclose()

    def _set(self, up: bool) -> None:
        before = self.up  # not tried yet reads as down: the first failure is no change to report
        self._up = up
        if self.up != before:
            for cb in self._callbacks:
                try:
                    cb(up)
                except Exception:
                    log.exception("quota store state callback failed")

    def _came_up(self) -> None:
        if self._up is True:
            return
        if self._up is None:
            log.info("quota store %s answers: quotas are counted there, across gateways", self.address)
        else:
            log.info("quota store %s is back: quotas are counted there again, across gateways", self.address)
        self._set(True)

    def _went_down(self, err: BaseException) -> None:
        if self._up is False:
            return
        log.warning("quota store %s unreachable (%s): each gateway counts quotas on its own until it is back",
                    self.address, _describe(err))
        self._set(False)
        if self._probe is None or self._probe.done():
            self._probe = asyncio.get_running_loop().create_task(self._reconnect(), name="quota-store-probe")

    async def _reconnect(self) -> None:
        while self._up is False:
            await asyncio.sleep(self.retry_every_s)
            try:
                await asyncio.wait_for(self._redis.ping(), self.timeout_s)
            except Exception:  # still down: the next probe a second on
                continue
            self._came_up()


def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__


def store_from_url(url: str | None, timeout_s: float = REDIS_TIMEOUT_S) -> LocalStore | RedisStore:
    """The store for ``--quota-store`` (None or "": this process's own counts), each call to it bounded by
    ``timeout_s``. ValueError for a bad URL."""
    if not url:
        return LocalStore()
    return RedisStore(url, timeout_s=timeout_s)
