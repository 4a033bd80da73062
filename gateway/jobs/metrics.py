"""Prometheus metrics of jobs. Store-wide figures (jobs by status, the oldest queued, live leases, pending webhooks)
are read from the store by the gateway's housekeeping loop every few seconds and published here: a scrape never
waits on the database. Counters are this gateway's own."""
from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge

from gateway.jobs.model import STATUSES

DELIVERY_OUTCOMES = ("delivered", "retry", "failed", "refused")


class JobMetrics:
    def __init__(self, registry: CollectorRegistry | None = REGISTRY) -> None:
        reg = registry if registry is not None else CollectorRegistry()
        self.jobs = Gauge("glmimage_jobs", "Jobs in the store by status (every gateway's and tenant's)", ["status"],
                          registry=reg)
        self.oldest_queued = Gauge("glmimage_jobs_oldest_queued_seconds",
                                   "Age in seconds of the oldest queued job in the store (0 when none waits)",
                                   registry=reg)
        self.leases = Gauge("glmimage_job_leases",
                            "Live job leases: scope=runner this gateway's runner holds, scope=store all runners'",
                            ["scope"], registry=reg)
        self.submitted = Counter("glmimage_jobs_submitted_total", "Jobs accepted by this gateway", ["tenant"],
                                 registry=reg)
        self.finished = Counter("glmimage_jobs_finished_total",
                                "Job ends recorded by this gateway (its runner, a cancel of a queued job, or reaping)",
                                ["status"], registry=reg)
        self.lease_lost = Counter("glmimage_job_lease_lost_total",
                                  "Jobs this runner stopped because another runner had taken them over (its lease ran "
                                  "out: the runner stalled)", registry=reg)
        self.takeovers = Counter("glmimage_job_takeovers_total",
                                 "Jobs this runner took whose previous runner died or stalled mid-run", registry=reg)
        self.webhooks = Counter("glmimage_webhook_deliveries_total",
                                "Webhook delivery tries by outcome: delivered, retry (a failed try to be tried "
                                "again), failed (given up), refused (the egress policy refused the target)",
                                ["outcome"], registry=reg)
        self.webhooks_pending = Gauge("glmimage_webhook_pending", "Webhook deliveries not yet delivered nor given up",
                                      registry=reg)
        for status in STATUSES:
            self.jobs.labels(status)
            self.finished.labels(status)
        for scope in ("runner", "store"):
            self.leases.labels(scope)
        for outcome in DELIVERY_OUTCOMES:
            self.webhooks.labels(outcome)

    def delivery(self, outcome: str) -> None:
        self.webhooks.labels(outcome).inc()

    def publish(self, counts: dict[str, int], oldest_age: float, store_leases: int, pending_webhooks: int) -> None:
        for status in STATUSES:
            self.jobs.labels(status).set(counts.get(status, 0))
        self.oldest_queued.set(max(0.0, oldest_age))
        self.leases.labels("store").set(store_leases)
        self.webhooks_pending.set(pending_webhooks)
