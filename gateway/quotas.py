"""Per-tenant quotas: requests and images a minute, and images in flight at once, with OpenAI's rate-limit answers.

A window is one minute that opens at the tenant's first counted request after its previous window closed, and its
counts are exact: "20 requests a minute" admits exactly 20 of 40 sent within a minute, wherever a wall-clock minute
boundary falls, because no wall-clock minute is involved. A request and its images are checked and counted in one
atomic step of the store (gateway.quota_store): refused if either count would pass its limit, and a refused request
counts nothing. ``max_inflight_images`` bounds the images of the tenant's requests running on this gateway; it is
checked first, against this process's own count, and reserved across the store's step so that concurrent admissions
cannot both pass it.

The headers are OpenAI's (``x-ratelimit-{limit,remaining,reset}-{requests,images}``), only for the windowed quotas
the tenant has; its refusal message names the quota and when to retry and never an address. The policy here is pure
(``window_refusal``, ``rate_headers``, ``format_reset``, ``refusal``); ``Quotas`` is the thin stateful shell over a
store. No gRPC, no torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

WINDOW_S = 60.0

REQUESTS_PER_MINUTE = "requests_per_minute"
IMAGES_PER_MINUTE = "images_per_minute"
MAX_INFLIGHT_IMAGES = "max_inflight_images"
QUOTA_NAMES = (REQUESTS_PER_MINUTE, IMAGES_PER_MINUTE, MAX_INFLIGHT_IMAGES)

# A refusal the tenant can only wait out by one of its own requests ending: no window tells when, so a short hint.
INFLIGHT_RETRY_S = 1.0

Headers = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Quota:
    """A tenant's limits; None: no such quota."""

    requests_per_minute: int | None = None
    images_per_minute: int | None = None
    max_inflight_images: int | None = None

    @property
    def windowed(self) -> bool:
        """Whether the store counts this tenant (a per-minute quota); in-flight images are this gateway's own."""
        return self.requests_per_minute is not None or self.images_per_minute is not None

    @property
    def any(self) -> bool:
        return self.windowed or self.max_inflight_images is not None

    def too_large(self, images: int) -> str:
        """The quota a single request of ``images`` images can never pass, however long it waits ("" if none)."""
        if self.images_per_minute is not None and images > self.images_per_minute:
            return IMAGES_PER_MINUTE
        if self.max_inflight_images is not None and images > self.max_inflight_images:
            return MAX_INFLIGHT_IMAGES
        return ""


@dataclass(frozen=True)
class Window:
    """A tenant's counts in its current window, as a store answers them."""

    requests: int = 0
    images: int = 0
    reset_s: float = 0.0  # until the window closes; 0: none is open


@dataclass(frozen=True)
class QuotaDecision:
    allowed: bool
    quota: str  # "" when allowed, else the quota that refused (one of QUOTA_NAMES)
    retry_after_s: float
    message: str  # the client's text
    headers: Headers  # the x-ratelimit-* entries (empty for a tenant without per-minute quotas)


ADMITTED = QuotaDecision(True, "", 0.0, "", ())


def format_reset(seconds: float) -> str:
    """OpenAI's duration form: "250ms" under a second, else whole seconds rounded up ("12s", "1m0s", "1h0m0s")."""
    if seconds <= 0:
        return "0s"
    ms = math.ceil(round(seconds * 1000, 6))  # round first: 0.007 * 1000 is 7.000000000000001
    if ms < 1000:
        return f"{ms}ms"
    total = math.ceil(ms / 1000)
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


def window_refusal(quota: Quota, window: Window, images: int) -> str:
    """Which per-minute quota one more request of ``images`` images would pass ("" if none). Requests first.
    The Redis store's script mirrors this (gateway.quota_store.COUNT_LUA)."""
    if quota.requests_per_minute is not None and window.requests + 1 > quota.requests_per_minute:
        return REQUESTS_PER_MINUTE
    if quota.images_per_minute is not None and window.images + images > quota.images_per_minute:
        return IMAGES_PER_MINUTE
    return ""


def rate_headers(quota: Quota, window: Window) -> Headers:
    out: list[tuple[str, str]] = []
    reset = format_reset(window.reset_s)
    for kind, limit, used in (("requests", quota.requests_per_minute, window.requests),
                              ("images", quota.images_per_minute, window.images)):
        if limit is not None:
            out += [(f"x-ratelimit-limit-{kind}", str(limit)),
                    (f"x-ratelimit-remaining-{kind}", str(max(0, limit - used))),
                    (f"x-ratelimit-reset-{kind}", reset)]
    return tuple(out)


def refusal(tenant: str, quota: Quota, which: str, window: Window, images: int, inflight: int = 0) -> QuotaDecision:
    """The answer to a request of ``images`` images that ``which`` refused, ``window`` and ``inflight`` as they were."""
    headers = rate_headers(quota, window)
    if which == MAX_INFLIGHT_IMAGES:
        limit = quota.max_inflight_images
        if images > limit:
            msg = (f"a request of {images} images is more than tenant {tenant}'s max_inflight_images quota of "
                   f"{limit} allows at once; ask for at most {limit}")
        else:
            msg = (f"tenant {tenant} has {inflight} images in flight and its max_inflight_images quota is {limit} "
                   f"(this request asks for {images}); retry when one of its requests ends")
        return QuotaDecision(False, which, INFLIGHT_RETRY_S, msg, headers)
    # A window that is not open (a request larger than the whole quota, in a fresh window) resets a minute on.
    retry = window.reset_s if window.reset_s > 0 else WINDOW_S
    if which == REQUESTS_PER_MINUTE:
        msg = (f"tenant {tenant} reached its requests_per_minute quota of {quota.requests_per_minute}; "
               f"retry in {format_reset(retry)}")
    elif images > quota.images_per_minute:
        msg = (f"a request of {images} images is more than tenant {tenant}'s images_per_minute quota of "
               f"{quota.images_per_minute} allows; ask for at most {quota.images_per_minute}")
    else:
        msg = (f"tenant {tenant} used {window.images} of its images_per_minute quota of {quota.images_per_minute} "
               f"and this request asks for {images}; retry in {format_reset(retry)}")
    return QuotaDecision(False, which, retry, msg, headers)


class QuotaStore(Protocol):
    """Where the per-minute windows are counted (gateway.quota_store: LocalStore, RedisStore)."""

    @property
    def up(self) -> bool: ...

    async def count(self, tenant: str, quota: Quota, images: int) -> tuple[str, Window]:
        """One atomic step: the refusing quota ("" when counted) and the window after it (as it was if refused)."""
        ...

    async def peek(self, tenant: str) -> Window: ...

    def on_state(self, callback: Callable[[bool], None]) -> None: ...

    async def close(self) -> None: ...


class Quotas:
    """Admission against a tenant's quotas: call ``admit`` for every request (it answers at once for a tenant
    without quotas) and ``release`` once for each admitted one when it ends, on whatever path it ends."""

    def __init__(self, store: QuotaStore) -> None:
        self.store = store
        self._inflight: dict[str, int] = {}

    def inflight(self, tenant: str) -> int:
        return self._inflight.get(tenant, 0)

    async def admit(self, tenant: str, quota: Quota, images: int) -> QuotaDecision:
        inflight = self.inflight(tenant)
        limit = quota.max_inflight_images
        if limit is not None and inflight + images > limit:
            window = await self.store.peek(tenant) if quota.windowed else Window()
            return refusal(tenant, quota, MAX_INFLIGHT_IMAGES, window, images, inflight)
        # Reserved before the store's await: a concurrent admission sees these images in flight.
        self._inflight[tenant] = inflight + images
        if not quota.windowed:
            return ADMITTED
        try:
            which, window = await self.store.count(tenant, quota, images)
        except BaseException:  # cancelled (the caller went away) or a store bug: the reservation goes
            self.release(tenant, images)
            raise
        if which:
            self.release(tenant, images)
            return refusal(tenant, quota, which, window, images)
        return QuotaDecision(True, "", 0.0, "", rate_headers(quota, window))

    def release(self, tenant: str, images: int) -> None:
        left = self._inflight.get(tenant, 0) - images
        if left > 0:
            self._inflight[tenant] = left
        else:
            self._inflight.pop(tenant, None)

    async def snapshot(self, tenant: str, quota: Quota) -> tuple[int | None, int | None, int]:
        """(remaining requests, remaining images, images in flight here) for GetStatus; None: no such quota."""
        window = await self.store.peek(tenant) if quota.windowed else Window()
        rpm, ipm = quota.requests_per_minute, quota.images_per_minute
        return (None if rpm is None else max(0, rpm - window.requests),
                None if ipm is None else max(0, ipm - window.images),
                self.inflight(tenant))
