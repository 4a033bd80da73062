"""The simulated pool of bench/tenants_sim.py and what one run of it records: pool shapes, traffic sources, the
event loop that drives the real pure scheduler (gateway/scheduler/) in virtual time with simulated AR servers and
denoisers answering its dispatches after their service times (bench/sim_backends.py's costs), and the figures read
from a run's trace (shares per stage, Jain's index, latencies, cumulative jobs). The scenarios, their checks, the
plot and the command line stay in bench/tenants_sim.py.
"""
from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.sim_backends import DENOISE_SECONDS, ar_batch_seconds
from gateway.scheduler.core import Scheduler
from gateway.scheduler.types import (
    DEFAULT,
    PRIORITY_NAMES,
    ArBatchSucceeded,
    CompleteRequest,
    DenoiseSucceeded,
    DispatchArBatch,
    DispatchDenoise,
    FailRequest,
    RequestArrived,
    SchedulerConfig,
    Tick,
    WorkerAdded,
    WorkerHealthy,
    WorkerRole,
)

AR_BATCH_MAX_OUTPUTS = 28
SIZE = (1024, 1024)
INF = float("inf")


@dataclass(frozen=True)
class PoolShape:
    ar_servers: int
    denoisers: int

    @property
    def ar_capacity(self) -> float:
        return self.ar_servers * AR_BATCH_MAX_OUTPUTS / ar_batch_seconds(AR_BATCH_MAX_OUTPUTS)

    @property
    def denoise_capacity(self) -> float:
        return self.denoisers / DENOISE_SECONDS

    @property
    def bound(self) -> float:
        """Images per second the pool completes at most."""
        return min(self.ar_capacity, self.denoise_capacity)


POOLS = {"ar_bound": PoolShape(1, 14), "denoise_bound": PoolShape(2, 14)}


# ---- traffic ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    """One tenant's traffic in one class: a closed loop (``outstanding`` requests always in the system, a new one at
    each end) or Poisson arrivals (``rate`` requests per second). ``cap``: an arrival that finds this many of the
    source's requests in the system is turned away before the scheduler (the flood's excess, see run_flood)."""

    tenant: str
    weight: float = 1.0
    priority: int = DEFAULT
    outstanding: int = 0
    rate: float = 0.0
    ns: tuple[int, ...] = (1,)
    cap: int = 0

    @property
    def label(self) -> str:
        return self.tenant if self.priority == DEFAULT else f"{self.tenant}/{PRIORITY_NAMES[self.priority]}"


def poisson(rate: float, until: float, rng: random.Random) -> list[float]:
    out, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= until:
            return out
        out.append(t)


@dataclass
class Trace:
    """What one run saw: per request its source, arrival and end; per stage the (time, source, outputs) done."""

    arrived: dict[str, tuple[str, float, int]] = field(default_factory=dict)  # rid -> (label, at, n)
    ended: dict[str, float] = field(default_factory=dict)  # completed requests: rid -> at
    ar_outputs: list[tuple[float, str, int]] = field(default_factory=list)
    denoise_jobs: list[tuple[float, str]] = field(default_factory=list)
    rejected: dict[str, int] = field(default_factory=dict)  # by the scheduler (its queue bound)
    refused: set[str] = field(default_factory=set)  # rids the scheduler rejected
    turned_away: dict[str, int] = field(default_factory=dict)  # by a source's cap, never sent
    failed: int = 0
    end: float = 0.0


def simulate(pool: PoolShape, sources: Sequence[Source], until: float, seed: int, fifo: bool = False,
             scheduler: Callable[[SchedulerConfig], Any] = Scheduler, max_queued_outputs: int = 1 << 30) -> Trace:
    """Run ``sources`` through the scheduler on ``pool`` until ``until`` (virtual seconds). ``fifo``: every request
    is sent as tenant "default", weight 1, class default (the trace keeps whose it really is)."""
    sched = scheduler(SchedulerConfig(max_queued_outputs=max_queued_outputs, ar_batch_max_outputs=AR_BATCH_MAX_OUTPUTS))
    for i in range(pool.ar_servers):
        sched.handle(WorkerAdded(0.0, f"ar{i}", WorkerRole.AR))
        sched.handle(WorkerHealthy(0.0, f"ar{i}"))
    for i in range(pool.denoisers):
        sched.handle(WorkerAdded(0.0, f"d{i}", WorkerRole.DENOISER))
        sched.handle(WorkerHealthy(0.0, f"d{i}"))
    rng = random.Random(seed)
    trace = Trace(end=until)
    source_of: dict[str, Source] = {}  # requests in the system
    in_system: dict[int, int] = {}  # id(source) -> how many of its requests are
    rids = itertools.count()
    heap: list[tuple[float, int, tuple]] = []
    order = itertools.count()

    def push(at: float, item: tuple) -> None:
        heapq.heappush(heap, (at, next(order), item))

    # The closed loops' first requests interleaved (a, b, c, a, ...), as concurrent clients would send them: in
    # blocks, FIFO would serve one tenant's whole block, then the next one's, in turn.
    loops = [s for s in sources if s.outstanding]
    for k in range(max((s.outstanding for s in loops), default=0)):
        for s in loops:
            if k < s.outstanding:
                push(0.0, ("arrive", s))
    for s in sources:
        if not s.outstanding:
            for at in poisson(s.rate, until, random.Random(rng.random())):
                push(at, ("arrive", s))
    push(until, ("end",))

    def perform(now: float, actions: list) -> None:
        for a in actions:
            if isinstance(a, DispatchArBatch):
                outputs = sum(trace.arrived[rid][2] for rid in a.request_ids)
                push(now + ar_batch_seconds(outputs), ("ar", a))
            elif isinstance(a, DispatchDenoise):
                push(now + DENOISE_SECONDS, ("denoised", a))
            elif isinstance(a, CompleteRequest):
                trace.ended[a.request_id] = now
                s = source_of.pop(a.request_id)
                in_system[id(s)] -= 1
                if s.outstanding:
                    push(now, ("arrive", s))
            elif isinstance(a, FailRequest):
                s = source_of.pop(a.request_id)
                in_system[id(s)] -= 1
                if a.error.kind.name == "RESOURCE_EXHAUSTED":
                    trace.refused.add(a.request_id)
                    trace.rejected[s.label] = trace.rejected.get(s.label, 0) + 1
                    if s.outstanding:
                        push(now + 1.0, ("arrive", s))  # a closed loop's client retries a second later
                else:
                    trace.failed += 1

    now, last_tick = 0.0, -1.0
    while True:
        wake = sched.next_wakeup()
        # A Tick only where the scheduler asks for one before the next event; never twice at one instant.
        if wake is not None and wake < heap[0][0] and wake > last_tick:
            now = last_tick = max(wake, now)
            perform(now, sched.handle(Tick(now)))
            continue
        now, _, item = heapq.heappop(heap)
        kind = item[0]
        if kind == "end":
            return trace
        if kind == "arrive":
            s: Source = item[1]
            if s.cap and in_system.get(id(s), 0) >= s.cap:
                trace.turned_away[s.label] = trace.turned_away.get(s.label, 0) + 1
                continue
            in_system[id(s)] = in_system.get(id(s), 0) + 1
            rid = f"r{next(rids)}"
            n = s.ns[0] if len(s.ns) == 1 else rng.choice(s.ns)
            source_of[rid] = s
            trace.arrived[rid] = (s.label, now, n)
            tenant, weight, priority = ("default", 1.0, DEFAULT) if fifo else (s.tenant, s.weight, s.priority)
            perform(now, sched.handle(RequestArrived(now, rid, n, *SIZE, tenant=tenant, weight=weight,
                                                     priority=priority)))
        elif kind == "ar":
            batch: DispatchArBatch = item[1]
            for rid in batch.request_ids:
                label, _, n = trace.arrived[rid]
                trace.ar_outputs.append((now, label, n))
            perform(now, sched.handle(ArBatchSucceeded(
                now, batch.batch_id, {rid: [rid] * trace.arrived[rid][2] for rid in batch.request_ids})))
        else:
            job: DispatchDenoise = item[1]
            trace.denoise_jobs.append((now, trace.arrived[job.job.request_id][0]))
            perform(now, sched.handle(DenoiseSucceeded(now, job.job, job.worker, None)))


# ---- figures ----------------------------------------------------------------------------------------------------


def stage_counts(trace: Trace, t0: float, t1: float) -> dict[str, dict[str, int]]:
    """Per stage, per source: outputs done in [t0, t1)."""
    ar: dict[str, int] = {}
    for at, label, n in trace.ar_outputs:
        if t0 <= at < t1:
            ar[label] = ar.get(label, 0) + n
    dn: dict[str, int] = {}
    for at, label in trace.denoise_jobs:
        if t0 <= at < t1:
            dn[label] = dn.get(label, 0) + 1
    return {"ar": ar, "denoise": dn}


def shares_of(counts: dict[str, int], labels: Sequence[str]) -> dict[str, float]:
    total = sum(counts.values())
    return {k: round(counts.get(k, 0) / total, 4) if total else 0.0 for k in labels}


def jain(xs: Sequence[float]) -> float:
    """Jain's fairness index: 1 when all are equal, 1/len when one has everything."""
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs)) if any(xs) else float("nan")


def latencies(trace: Trace, label: str, t0: float, t1: float) -> tuple[list[float], int]:
    """Latencies of ``label``'s requests that arrived in [t0, t1) and were admitted, and how many of those had not
    ended."""
    out, open_ = [], 0
    for rid, (lab, at, _) in trace.arrived.items():
        if lab == label and t0 <= at < t1 and rid not in trace.refused:
            if rid in trace.ended:
                out.append(trace.ended[rid] - at)
            else:
                open_ += 1
    return out, open_


def cumulative(trace: Trace, labels: Sequence[str], step: float) -> dict[str, list[int]]:
    """Per source, denoise jobs done by each multiple of ``step`` (for the plot)."""
    points = int(trace.end // step) + 1
    out = {k: [0] * points for k in labels}
    for at, label in trace.denoise_jobs:
        if label in out:
            for i in range(int(at // step) + 1, points):
                out[label][i] += 1
    return out
