"""Fair share between tenants: a start-time fair queue in each stage (its parts in fair_queue.py), and the per-tenant
figures the gauges publish.

Start-time fair queueing (SFQ): a tenant's queued work in a stage is a flow with a tag, the start tag of its next job;
the flow with the smallest tag is served next, and serving a job moves its tag on by the job's cost over the tenant's
weight. The stage's virtual time is the start tag of the job last put in service. A flow that was idle starts at the
virtual time (or at its own tag, if that is later): idle time banks no credit, and a newcomer beside a backlog is
served within about one job. A denoise job costs 1; a request taken into an AR batch costs its n outputs.

Each stage has two levels, each a fair queue of its own: non-batch work (INTERACTIVE and DEFAULT) and BATCH work,
which a stage serves only while no non-batch work of that stage is queued. Within a tenant's flow: class, then
requeued first, then arrival. No running job is pre-empted: this only orders what is queued.

With a single backlogged flow (one tenant's plain traffic) a denoise pop is the flow's own pop plus a tag update,
and the AR stage takes the core's plain path (Shares.ar_pairs <= 1): one tenant's actions are those of the
scheduler before fair share (tests/test_scheduler_replay.py pins them).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable
from typing import Any

from .containers import ArQueue
from .fair_queue import DenoiseQueue, Flow, Level, Tenant
from .records import Request
from .speed import DENOISING, NEVER, PENDING_AR, QUEUED
from .types import BATCH, RequestArrived, SchedulerConfig, TenantSnapshot


class Shares:
    """The tenants, the denoise stage's fair queue, and the AR stage's fair share (tags in Flow.ar_tag)."""

    __slots__ = ("tenants", "denoise", "ar_levels", "ar_flows", "ar_interactive", "_order")

    def __init__(self) -> None:
        self.tenants: dict[str, Tenant] = {}
        self.denoise = DenoiseQueue()
        self.ar_levels = (Level(), Level())  # the AR stage's virtual times: non-batch, batch
        # Flows with a request waiting for an AR batch, and INTERACTIVE requests waiting: with one flow and no
        # INTERACTIVE request, the plain AR path gives what the fair choice would (one flow, one class: queue order).
        self.ar_flows = 0
        self.ar_interactive = 0
        self._order = 0

    # ------------------------------------------------------------------------------------------------- requests

    def admit(self, ev: RequestArrived, req: Request) -> None:
        """An admitted request joins its tenant, and the AR queue (the core queues it: _enqueue_ar). It has an
        entry among the tenant's waiting requests (``req.listed``, True for BATCH ones, which never need one)."""
        t = self.tenants.get(ev.tenant)
        if t is None or t.weight != ev.weight:
            t = self._tenant(ev.tenant, ev.weight)
        n = req.n
        seq = req.seq
        t.requests[seq] = req
        t.active_outputs += n
        cls = ev.priority
        f = req.flow = t.by_class[cls]
        if cls != BATCH:
            t.waiting.append(seq)  # (bounded in ar_taken)
            if not cls:  # INTERACTIVE
                self.ar_interactive += 1
        # ar_added, inlined (this runs for every request)
        if not f.ar_requests:  # its flow was idle: it starts at the virtual time, banking no credit
            self.ar_flows += 1
            if f.ar_tag < f.ar_level.vtime:
                f.ar_tag = f.ar_level.vtime
        f.ar_requests += 1
        f.ar_outputs += n

    def within_share(self, name: str, weight: float, n: int, bound: int) -> bool:
        """Whether ``n`` more outputs keep tenant ``name`` within its share of the admission bound: ``bound`` times
        its weight over the weights of the tenants with queued work (itself included). Asked only once the bound is
        reached: a tenant under its share is admitted all the same, so a flood fills the queue with its own work,
        never against the others (the core caps the total at twice the bound)."""
        t = self.tenants.get(name)
        mine = 0 if t is None else sum(f.ar_outputs + len(f) for f in t.flows)
        weights = weight + sum(o.weight for other, o in self.tenants.items()
                               if other != name and any(f.ar_outputs or f.first is not None for f in o.flows))
        return mine + n <= bound * weight / weights

    def _tenant(self, name: str, weight: float) -> Tenant:
        """A new tenant, or one whose weight changed: the latest arrival's weight is the tenant's."""
        t = self.tenants.get(name)
        if t is None:
            self._order += 1
            nb, b = self.denoise.levels
            t = self.tenants[name] = Tenant(name, weight, self._order, (nb, b, *self.ar_levels))
        t.weight = weight
        for flow in t.flows:
            flow.inc = 1.0 / weight
        return t

    def idle(self, t: Tenant) -> None:
        """``t``'s last active request ended (the core counts them down: Scheduler._end)."""
        t.waiting.clear()  # nothing of it can be queued
        t.late.clear()
        # Forget a tenant whose return would start at the virtual times anyway: nothing it did is kept.
        if all(f.tag <= f.level.vtime and f.ar_tag <= f.ar_level.vtime for f in t.flows):
            del self.tenants[t.name]

    def relist(self, req: Request) -> None:
        """``req`` (not BATCH) has queued work again after the gauges dropped its entry."""
        req.listed = True
        heapq.heappush(req.flow.tenant.late, req.seq)

    def _compact(self, t: Tenant) -> None:
        """Drop the entries of ended requests."""
        t.waiting = deque(e for e in t.waiting if e in t.requests)
        t.late = [e for e in t.late if e in t.requests]
        heapq.heapify(t.late)
        t.waiting_cap = max(64, 2 * (len(t.waiting) + len(t.late)))

    def _has_queued(self, t: Tenant, seq: int) -> Request | None:
        """The request of an entry, if it is active and has work queued in either stage; else None, and the entry
        is dropped (the request is listed again when it next has queued work: relist)."""
        req = t.requests.get(seq)  # (a BATCH one has no entry)
        if req is not None and (req.stage is PENDING_AR or (
                req.stage is DENOISING and any(o.state is QUEUED for o in req.outputs))):
            return req
        if req is not None:
            req.listed = False
        return None

    def oldest_since(self, t: Tenant) -> float | None:
        """The earliest arrival of ``t``'s non-batch requests with queued work (None: none)."""
        waiting, late = t.waiting, t.late
        first: list[float] = []
        while waiting:
            if (req := self._has_queued(t, waiting[0])) is not None:
                first.append(req.arrived_at)
                break
            waiting.popleft()
        while late:
            if (req := self._has_queued(t, late[0])) is not None:
                first.append(req.arrived_at)
                break
            heapq.heappop(late)
        return min(first) if first else None

    def snapshots(self, now: float) -> tuple[TenantSnapshot, ...]:
        """Every tenant with active requests, by name."""
        rows = []
        for _, t in sorted(self.tenants.items()):
            if t.requests:
                since = self.oldest_since(t)
                rows.append(TenantSnapshot(
                    t.name, t.weight, sum(f.ar_requests for f in t.flows), sum(f.ar_outputs for f in t.flows),
                    sum(len(f) for f in t.flows), len(t.requests), t.active_outputs,
                    0.0 if since is None else max(now - since, 0.0), since))
        return tuple(rows)

    # ------------------------------------------------------------------------------------------------- AR stage

    def ar_added(self, req: Request) -> None:
        """``req`` is back in an AR queue after a failure."""
        if not req.listed:
            self.relist(req)
        f: Flow = req.flow
        if not f.ar_requests:  # its flow was idle: it starts at the virtual time, banking no credit
            self.ar_flows += 1
            if f.ar_tag < f.ar_level.vtime:
                f.ar_tag = f.ar_level.vtime
        f.ar_requests += 1
        f.ar_outputs += req.n
        if not req.priority:  # INTERACTIVE
            self.ar_interactive += 1

    def ar_removed(self, req: Request) -> None:
        """``req`` left its AR queue as it ended."""
        f: Flow = req.flow
        f.ar_requests -= 1
        if not f.ar_requests:
            self.ar_flows -= 1
        f.ar_outputs -= req.n
        if not req.priority:
            self.ar_interactive -= 1

    def ar_taken(self, taken: list[Request]) -> None:
        """``taken`` left their AR queues in a batch, in this order: each flow is charged as its requests go."""
        f = taken[0].flow
        if self.ar_flows == 1 and not self.ar_interactive:  # all of one flow and class: charged at once
            t = f.tenant
            if len(t.waiting) > t.waiting_cap:  # (once a batch, not on every arrival)
                self._compact(t)
            outputs = 0
            for req in taken:
                outputs += req.n
            f.ar_requests -= len(taken)
            if not f.ar_requests:
                self.ar_flows = 0
            f.ar_outputs -= outputs
            f.ar_level.vtime = f.ar_tag + (outputs - taken[-1].n) * f.inc  # the last one's start tag
            f.ar_tag += outputs * f.inc
            return
        for req in taken:
            f: Flow = req.flow
            n = req.n
            f.ar_requests -= 1
            if not f.ar_requests:
                self.ar_flows -= 1
            f.ar_outputs -= n
            if not req.priority:
                self.ar_interactive -= 1
            f.ar_level.vtime = start = f.ar_tag
            f.ar_tag = start + n * f.inc

    def ar_group(self, groups: dict[tuple[int, int, int], ArQueue], cfg: SchedulerConfig,
                 now: float) -> tuple[tuple[int, int, int] | None, float]:
        """The group whose batch leaves next, among those that may leave now (None if none may), and the earliest
        time at which a group that may not leave yet will by age (inf if there is none).

        With one flow and no INTERACTIVE request waiting: the group whose oldest request is oldest. Else the fair
        choice (_fair_group), which gives the same in that case."""
        if self.ar_flows > 1 or self.ar_interactive:
            return self._fair_group(groups, cfg.ar_batch_max_outputs, cfg.ar_batch_delay, now)
        best: tuple[tuple[float, int], tuple[int, int, int]] | None = None
        wait_until = NEVER
        for key, q in groups.items():
            oldest = q.oldest()
            due = oldest[0] + cfg.ar_batch_delay
            if now >= due or q.requests[0].solo or q.outputs >= cfg.ar_batch_max_outputs:  # full, or waited
                # (a solo one counts as full: nothing may join it)
                if best is None or oldest < best[0]:
                    best = (oldest, key)
            elif due < wait_until:
                wait_until = due
        return (None if best is None else best[1]), wait_until

    def ar_batch(self, q: deque[Request], cap: int) -> list[Request]:
        """The requests of a group's batch. With one flow and no INTERACTIVE request waiting: in queue order,
        skipping what does not fit and scanning on; an oversized or solo head goes alone. Else in fair order
        (_fair_batch), which gives the same in that case."""
        if self.ar_flows > 1 or self.ar_interactive:
            return self._fair_batch(q, cap)
        if q[0].n > cap or q[0].solo:
            return [q[0]]
        taken: list[Request] = []
        room = cap
        for r in q:
            if r.n <= room and not r.solo:
                taken.append(r)
                room -= r.n
                if room == 0:
                    break
        return taken

    def _batch_level(self, groups: Iterable[ArQueue]) -> bool:
        """Whether the AR stage serves BATCH work now: no other waits."""
        return all(r.priority == BATCH for q in groups for r in q.requests)

    def _fair_group(self, groups: dict[tuple[int, int, int], ArQueue], cap: int, delay: float,
                    now: float) -> tuple[tuple[int, int, int] | None, float]:
        """ar_group with several flows or classes waiting: the group holding the fair-next request (the smallest
        tag, then within the tenant by class, then arrival) among the groups whose batch may leave now. Whether one
        may is judged on its requests of the level served: a group holding only BATCH requests while other work
        waits may not; else it may when they fill a batch, the oldest of them has waited, or it is a solo one."""
        batch_level = self._batch_level(groups.values())
        best: tuple[Any, ...] | None = None
        wait_until = NEVER
        for key, q in groups.items():
            members = [r for r in q.requests if (r.priority == BATCH) == batch_level]
            if not members:
                continue
            due = min(r.arrived_at for r in members) + delay
            if now >= due or members[0].solo or sum(r.n for r in members) >= cap:
                for r in members:
                    f = r.flow
                    rank = (f.ar_tag, f.order, r.priority, r.seq)
                    if best is None or rank < best[0]:
                        best = (rank, key)
            elif due < wait_until:
                wait_until = due
        return (None if best is None else best[1]), wait_until

    def _fair_batch(self, requests: deque[Request], cap: int) -> list[Request]:
        """ar_batch with several flows or classes waiting: in fair order, the fair-next flow's next request (by
        class, then queue order), each flow's tag moved on as its requests are taken (as ar_taken charges them);
        what does not fit is skipped. Non-batch requests first; BATCH ones may fill the room left. An oversized or
        solo head goes alone."""
        taken: list[Request] = []
        room = cap
        for batch_level in (False, True):
            flows: dict[int, list[Request]] = {}
            for r in sorted((r for r in requests if (r.priority == BATCH) == batch_level), key=lambda r: r.priority):
                flows.setdefault(id(r.flow), []).append(r)
            tags = {}
            for fid, mine in flows.items():
                mine.reverse()  # pop() from the end takes the next
                tags[fid] = mine[0].flow.ar_tag
            while flows:
                fid = min(flows, key=lambda i: (tags[i], flows[i][-1].flow.order))
                r = flows[fid].pop()
                if not flows[fid]:
                    del flows[fid]
                if not taken and (r.n > cap or r.solo):
                    return [r]
                if r.n <= room and not r.solo:
                    taken.append(r)
                    tags[fid] += r.n * r.flow.inc
                    room -= r.n
                    if room == 0:
                        return taken
        return taken
