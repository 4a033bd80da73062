"""A request's tenant at the gateway's edge: the priority it may ask for, its quotas, and what it used.

GatewayService asks here, once per generation, after the request's fields are checked and before the driver sees it:
``priority_of`` (INVALID_ARGUMENT on ``priority`` above the tenant's max_priority), then ``TenantGate.admit`` (a
quota refusal is RESOURCE_EXHAUSTED with a google.rpc.RetryInfo and the x-ratelimit-* figures; an admission is a
Ticket whose ``headers`` the call sends as its initial metadata), and the Ticket's ``end`` on every way out (it frees
the tenant's in-flight images and counts the outcome and the usage). No torch, no scheduler state.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from gateway.metrics import GatewayMetrics
from gateway.quotas import Quota, Quotas
from glmimage.v1 import gateway_service_pb2
from runtime.details import QUOTA_KEY
from runtime.errors import InvalidArgument, ResourceExhausted
from runtime.priority import DEFAULT, PRIORITY_NAMES
from runtime.tenants import Tenant

log = logging.getLogger(__name__)

# gRPC enum -> scheduler class (0 = interactive); unspecified is default.
_PRIORITY_FROM_PROTO = {
    gateway_service_pb2.PRIORITY_UNSPECIFIED: DEFAULT,
    gateway_service_pb2.PRIORITY_INTERACTIVE: 0,
    gateway_service_pb2.PRIORITY_DEFAULT: 1,
    gateway_service_pb2.PRIORITY_BATCH: 2,
}
PRIORITY_TO_PROTO = {cls: value for value, cls in _PRIORITY_FROM_PROTO.items() if value}


def priority_of(value: int, tenant: Tenant) -> int:
    """The scheduler class of GenerateImagesRequest.priority ``value``, if ``tenant`` may ask for it."""
    cls = _PRIORITY_FROM_PROTO.get(value)
    if cls is None:
        raise InvalidArgument("priority", f"unknown priority {value}; use PRIORITY_INTERACTIVE, PRIORITY_DEFAULT or "
                                          "PRIORITY_BATCH")
    if not tenant.allows(cls):
        raise InvalidArgument("priority", f"{PRIORITY_NAMES[cls]} is above what tenant {tenant.name!r} may ask for "
                                          f"(at most {PRIORITY_NAMES[tenant.max_priority]})")
    return cls


def quota_of(tenant: Tenant) -> Quota:
    return Quota(tenant.requests_per_minute, tenant.images_per_minute, tenant.max_inflight_images)


@dataclass
class Ticket:
    """One admitted request of ``tenant``: ``headers`` go out as the call's initial metadata; ``end`` runs once."""

    gate: TenantGate
    tenant: Tenant
    images: int
    headers: tuple[tuple[str, str], ...] = ()
    _ended: bool = field(default=False, repr=False)

    def end(self, outcome: str, usage: Usage | None = None) -> None:
        """The request ended with ``outcome`` ("ok" or an error kind's value); ``usage`` when it returned images."""
        if self._ended:
            return
        self._ended = True
        self.gate._ended(self, outcome, usage)


@dataclass(frozen=True)
class Usage:
    images: int
    pixel_steps: int  # width x height x denoising steps run, summed over the images
    prompt_tokens: int
    completion_tokens: int

    @classmethod
    def of(cls, width: int, height: int, steps: Sequence[int], prompt_tokens: int, completion_tokens: int) -> Usage:
        return cls(len(steps), sum(width * height * s for s in steps), prompt_tokens, completion_tokens)


class TenantGate:
    def __init__(self, quotas: Quotas, metrics: GatewayMetrics | None = None) -> None:
        self.quotas = quotas
        self.metrics = metrics
        # name -> requests and images ended ok, since this gateway started (GetStatus)
        self.requests_total: dict[str, int] = {}
        self.images_total: dict[str, int] = {}

    async def admit(self, tenant: Tenant, images: int) -> Ticket:
        """Count the request against its tenant's quotas, or refuse it (ResourceExhausted, counting nothing)."""
        if not tenant.has_quotas:
            return Ticket(self, tenant, images)
        quota = quota_of(tenant)
        if which := quota.too_large(images):  # never admitted however long it waits: not a 429 to retry
            raise InvalidArgument("n", f"n={images} is more images than tenant {tenant.name!r} may have at once "
                                       f"({which.replace('_', ' ')} = {getattr(quota, which)})")
        decision = await self.quotas.admit(tenant.name, quota, images)
        if not decision.allowed:
            if self.metrics is not None:
                self.metrics.tenant_quota_refusals.labels(tenant.name, decision.quota).inc()
                self.metrics.tenant_requests.labels(tenant.name, "rate_limited").inc()
            log.info("tenant %s refused by its %s quota (retry in %.1fs)", tenant.name, decision.quota,
                     decision.retry_after_s)
            raise ResourceExhausted(decision.message, retry_after=decision.retry_after_s,
                                    metadata=(*decision.headers, (QUOTA_KEY, decision.quota)))
        return Ticket(self, tenant, images, decision.headers)

    async def charge(self, tenant: Tenant, images: int) -> tuple[tuple[str, str], ...]:
        """A job's submission: counted against the tenant's rate quotas now, or refused (ResourceExhausted). The
        job runs later under its in-flight bound only (``admit_run``), so nothing is held here and nothing is
        charged twice."""
        if not tenant.has_quotas:
            return ()
        if which := quota_of(tenant).too_large(images):
            raise InvalidArgument("n", f"n={images} is more images than tenant {tenant.name!r} may have at once "
                                       f"({which.replace('_', ' ')} = {getattr(tenant, which)})")
        rated = replace(tenant, max_inflight_images=None)
        ticket = await self.admit(rated, images)
        if rated.has_quotas:
            self.quotas.release(tenant.name, images)
        ticket._ended = True  # counted as a request when it runs
        return ticket.headers

    async def admit_run(self, tenant: Tenant, images: int) -> Ticket:
        """A job about to run: its tenant's in-flight bound only (its rates were charged at submission)."""
        return await self.admit(replace(tenant, requests_per_minute=None, images_per_minute=None), images)

    def _ended(self, ticket: Ticket, outcome: str, usage: Usage | None) -> None:
        tenant = ticket.tenant
        if tenant.has_quotas:
            self.quotas.release(tenant.name, ticket.images)
        self.requests_total[tenant.name] = self.requests_total.get(tenant.name, 0) + 1
        if usage is not None:
            self.images_total[tenant.name] = self.images_total.get(tenant.name, 0) + usage.images
        m = self.metrics
        if m is None:
            return
        name = tenant.name
        m.tenant_requests.labels(name, outcome).inc()
        if usage is not None:
            m.tenant_images.labels(name).inc(usage.images)
            m.tenant_usage_images.labels(name).inc(usage.images)
            m.tenant_usage_pixel_steps.labels(name).inc(usage.pixel_steps)
            m.tenant_usage_tokens.labels(name, "prompt").inc(usage.prompt_tokens)
            m.tenant_usage_tokens.labels(name, "completion").inc(usage.completion_tokens)
