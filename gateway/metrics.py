"""Prometheus metrics of the gateway.

Histograms and outcome counters are observed by the driver (through gateway.observe) on the event-loop thread
(prometheus-client objects are thread-safe). Queue depths, worker states and the scheduler's own counters are read
at scrape time from a state the driver publishes after every turn of its event loop (counts kept by the scheduler,
never an entry per worker): the scrape runs on the HTTP server's thread and
must never walk the scheduler's live dicts. The HPA scales denoisers on
``glmimage_gateway_queue_outputs{stage="denoise"}``.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.scheduler import types as sch
from gateway.scheduler.core import Scheduler
from runtime.errors import ErrorKind

# Reference AR batches take 20-33 s and denoising 12 s; the buckets also cover the tiny model and 100x-faster
# simulations, which run in milliseconds.
SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 15, 20, 30, 45, 60, 90, 120, 180, 300,
                   600)
BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 20, 24, 28, 32, 48, 64)
STAGES = ("ar", "denoise")
ROLES = {sch.WorkerRole.AR: "ar", sch.WorkerRole.DENOISER: "denoiser"}
STATES = {s: s.value.lower() for s in sch.WorkerState}


@dataclass(frozen=True)
class _Published:
    gauges: sch.Gauges
    counters: sch.Counters  # a copy: the scheduler's own object keeps changing
    # By role: members connected but not answering (hung) or whose call timed out, and members that refuse the
    # gateway's credential (its internal token).
    stuck: dict[sch.WorkerRole, int] = dataclasses.field(default_factory=dict)
    refusing: dict[sch.WorkerRole, int] = dataclasses.field(default_factory=dict)
    # By role: members whose contract revisions this gateway does not speak (gateway.compat).
    incompatible: dict[sch.WorkerRole, int] = dataclasses.field(default_factory=dict)


_EMPTY = _Published(Scheduler().gauges(), sch.Counters())


class GatewayMetrics(Collector):
    def __init__(self, registry: CollectorRegistry | None = REGISTRY) -> None:
        # One instance per registry: tests and the benchmark give each gateway its own registry.
        reg = registry if registry is not None else CollectorRegistry()
        self.registry = reg
        self._state = _EMPTY
        self.ar_batch_size = Histogram("glmimage_gateway_ar_batch_size", "AR batch size in output slots",
                                       buckets=BATCH_BUCKETS, registry=reg)
        self.queue_seconds = Histogram(
            "glmimage_gateway_queue_seconds",
            "Seconds waited in a queue: stage=ar per request (admission to AR dispatch), stage=denoise per output "
            "(AR result to denoise dispatch)", ["stage"], buckets=SECONDS_BUCKETS, registry=reg)
        self.ar_seconds = Histogram("glmimage_gateway_ar_seconds", "Seconds per successful AR batch RPC",
                                    buckets=SECONDS_BUCKETS, registry=reg)
        self.denoise_seconds = Histogram("glmimage_gateway_denoise_seconds", "Seconds per successful denoise RPC",
                                         buckets=SECONDS_BUCKETS, registry=reg)
        self.request_seconds = Histogram("glmimage_gateway_request_seconds",
                                         "End-to-end seconds of successful requests, admission to last image",
                                         buckets=SECONDS_BUCKETS, registry=reg)
        self.requests = Counter("glmimage_gateway_requests", "Requests ended, by outcome (ok or the error kind)",
                                ["outcome"], registry=reg)
        self.images = Counter("glmimage_gateway_images", "Images returned to clients", registry=reg)
        self.tokens = Counter("glmimage_gateway_tokens", "AR tokens of successful requests", ["kind"],
                              registry=reg)
        for outcome in ("ok", *(k.value for k in ErrorKind)):
            self.requests.labels(outcome)  # every series exists from the start, so rate() sees the first one
        for kind in ("prompt", "completion"):
            self.tokens.labels(kind)
        for stage in STAGES:
            self.queue_seconds.labels(stage)
        # Per tenant: the label values are the tenants file's names only (never a caller's input), so the series are
        # as many as the tenants. The usage counters are what a billing job scrapes.
        self.tenant_requests = Counter("glmimage_gateway_tenant_requests",
                                       "Requests of each tenant ended, by outcome (ok, an error kind, or rate_limited "
                                       "for a quota refusal)", ["tenant", "outcome"], registry=reg)
        self.tenant_images = Counter("glmimage_gateway_tenant_images", "Images returned to each tenant", ["tenant"],
                                     registry=reg)
        self.tenant_quota_refusals = Counter("glmimage_gateway_tenant_quota_refusals",
                                             "Requests refused by a tenant's quota, by quota", ["tenant", "quota"],
                                             registry=reg)
        self.tenant_queue_wait = Histogram("glmimage_gateway_tenant_queue_wait_seconds",
                                           "Seconds from admission to a request's first denoise dispatch, per tenant",
                                           ["tenant"], buckets=SECONDS_BUCKETS, registry=reg)
        self.tenant_usage_images = Counter("glmimage_gateway_tenant_usage_images",
                                           "Billing: images generated for each tenant", ["tenant"], registry=reg)
        self.tenant_usage_pixel_steps = Counter("glmimage_gateway_tenant_usage_pixel_steps",
                                                "Billing: width x height x denoising steps of each tenant's images",
                                                ["tenant"], registry=reg)
        self.tenant_usage_tokens = Counter("glmimage_gateway_tenant_usage_ar_tokens",
                                           "Billing: AR tokens of each tenant's requests, by kind", ["tenant", "kind"],
                                           registry=reg)
        self.quota_store_up: Gauge | None = None
        self._tenant_names: tuple[str, ...] = ()
        reg.register(self)

    def tenants(self, names: Iterable[str]) -> None:
        """The tenants in force (at start and after a reload): their series exist from the start, so rate() sees the
        first request, and the queue gauges list each one."""
        self._tenant_names = tuple(names)
        for name in self._tenant_names:
            for outcome in ("ok", "rate_limited", *(k.value for k in ErrorKind)):
                self.tenant_requests.labels(name, outcome)
            self.tenant_images.labels(name)
            self.tenant_queue_wait.labels(name)
            self.tenant_usage_images.labels(name)
            self.tenant_usage_pixel_steps.labels(name)
            for kind in ("prompt", "completion"):
                self.tenant_usage_tokens.labels(name, kind)

    def quota_store(self, up: bool) -> None:
        """The quota store's state (with --quota-store only): 0 while the gateway counts on its own."""
        if self.quota_store_up is None:
            self.quota_store_up = Gauge("glmimage_gateway_quota_store_up",
                                        "1 while the shared quota store (--quota-store) answers; 0 while this gateway "
                                        "counts quotas on its own", registry=self.registry)
        self.quota_store_up.set(1 if up else 0)

    def publish(self, gauges: sch.Gauges, counters: sch.Counters, stuck: dict[sch.WorkerRole, int] | None = None,
                refusing: dict[sch.WorkerRole, int] | None = None,
                incompatible: dict[sch.WorkerRole, int] | None = None) -> None:
        """``stuck``, ``refusing`` and ``incompatible``: how many members of each role are stuck, refuse the
        credential, speak no contract revision this gateway does."""
        copy = dataclasses.replace(counters, failed=dict(counters.failed), requeues=dict(counters.requeues))
        # One reference swap: a scrape sees one consistent state.
        self._state = _Published(gauges, copy, stuck or {}, refusing or {}, incompatible or {})

    def collect(self) -> Iterator[Metric]:
        state = self._state
        snap, c = state.gauges, state.counters
        q_req = GaugeMetricFamily("glmimage_gateway_queue_requests", "Requests waiting, per stage", labels=["stage"])
        q_req.add_metric(["ar"], snap.pending_ar_requests)
        q_req.add_metric(["denoise"], snap.pending_denoise_requests)
        yield q_req
        q_out = GaugeMetricFamily("glmimage_gateway_queue_outputs", "Output slots (images) waiting, per stage",
                                  labels=["stage"])
        q_out.add_metric(["ar"], snap.pending_ar_outputs)
        q_out.add_metric(["denoise"], snap.pending_denoise_outputs)
        yield q_out
        yield GaugeMetricFamily("glmimage_gateway_active_requests", "Requests admitted and not ended",
                                value=snap.active_requests)
        workers = GaugeMetricFamily("glmimage_gateway_workers", "Workers by role and state",
                                    labels=["role", "state"])
        for role, name in ROLES.items():
            for st, label in STATES.items():
                workers.add_metric([name, label], snap.workers.get((role, st), 0))
        yield workers
        yield GaugeMetricFamily("glmimage_gateway_denoisers_held_elsewhere",
                                "Denoisers whose slot another gateway's job holds (counted as busy in "
                                "glmimage_gateway_workers)", value=snap.denoisers_held_elsewhere)
        stuck = GaugeMetricFamily("glmimage_gateway_workers_stuck",
                                  "Workers connected but not answering health checks (hung) or whose last call "
                                  "timed out, by role", labels=["role"])
        stuck_stage = GaugeMetricFamily("glmimage_gateway_stage_stuck",
                                        "1 when a stage has no ready worker and at least one of its workers is stuck "
                                        "(there but making no progress), as opposed to gone", labels=["stage"])
        for role, stage in ROLES.items():
            n_stuck = state.stuck.get(role, 0)
            ready = snap.workers.get((role, sch.WorkerState.AVAILABLE), 0) + snap.workers.get(
                (role, sch.WorkerState.BUSY), 0) > 0
            stuck.add_metric([stage], n_stuck)
            stuck_stage.add_metric(["ar" if role is sch.WorkerRole.AR else "denoise"], int(n_stuck > 0 and not ready))
        yield stuck
        yield stuck_stage
        refusing = GaugeMetricFamily("glmimage_gateway_workers_refusing_credential",
                                     "Workers that refuse the gateway's credential (its internal token), by role: "
                                     "they get no work until a check with it passes", labels=["role"])
        for role, name in ROLES.items():
            refusing.add_metric([name], state.refusing.get(role, 0))
        yield refusing
        incompatible = GaugeMetricFamily("glmimage_gateway_workers_incompatible",
                                         "Workers whose contract revisions this gateway does not speak (a release too "
                                         "old or too new), by role: they get no work", labels=["role"])
        for role, name in ROLES.items():
            incompatible.add_metric([name], state.incompatible.get(role, 0))
        yield incompatible
        requeues = CounterMetricFamily("glmimage_gateway_requeues", "Work put back in a queue, by reason",
                                       labels=["reason"])
        for reason, n in c.requeues.items():
            requeues.add_metric([reason], n)
        yield requeues
        yield CounterMetricFamily("glmimage_gateway_fenced_results",
                                  "Results dropped because their attempt was superseded or their request ended",
                                  value=c.fenced_results)
        yield CounterMetricFamily("glmimage_gateway_denoise_dispatches", "Denoise jobs sent to a denoiser",
                                  value=c.denoise_dispatches)
        yield CounterMetricFamily(
            "glmimage_gateway_denoise_collisions",
            "Denoise jobs a denoiser refused because another gateway's job held it (each sent elsewhere at once, "
            "not counted as a failed attempt)", value=c.collisions)
        depth = GaugeMetricFamily("glmimage_gateway_tenant_queue_depth",
                                  "Output slots (images) of each tenant waiting, per stage", labels=["tenant", "stage"])
        oldest = GaugeMetricFamily("glmimage_gateway_tenant_oldest_wait_seconds",
                                   "Seconds the oldest queued non-batch work of each tenant has waited (0: none waits)",
                                   labels=["tenant"])
        seen = {t.name: t for t in getattr(snap, "tenants", ())}
        for name in dict.fromkeys((*self._tenant_names, *seen)):
            t = seen.get(name)
            depth.add_metric([name, "ar"], t.pending_ar_outputs if t else 0)
            depth.add_metric([name, "denoise"], t.pending_denoise_outputs if t else 0)
            # (at scrape time: the published state is as of the last event, and a starved tenant's wait keeps growing)
            since = t.oldest_since if t else None
            oldest.add_metric([name], 0.0 if since is None else max(time.monotonic() - since, 0.0))
        yield depth
        yield oldest
        yield CounterMetricFamily("glmimage_gateway_admission_rejections",
                                  "Requests refused at admission (queue full, or they could never fit)",
                                  value=c.rejected)
