"""The start-time fair queue's parts (fairness.py has the rules and how the scheduler uses them): a stage level's
virtual time, a tenant's flows with their start tags, the tenant with its figures, and the denoise stage's queue of
flows. Nothing here knows of the AR stage's batches or of the gauges' snapshots: Shares (fairness.py) does."""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator

from .containers import MinQueue
from .records import Request

# A denoise queue entry: (class, requeued?, admission seq, index, request_id). Requeued = 0 goes first within the
# class, fresh = 1. (class, requeued?, seq, index) is unique, so request_id never takes part in comparisons.
QueueKey = tuple[int, int, int, int, str]
NON_BATCH_LEVEL, BATCH_LEVEL = 0, 1


class Level:
    """One level of a stage's fair queue: its virtual time, and (denoise stage) its backlogged flows."""

    __slots__ = ("lead", "heap", "vtime")

    def __init__(self) -> None:
        self.lead: Flow | None = None  # the backlogged flow served next (kept out of the heap)
        self.heap: list[tuple[float, int, Flow]] = []  # the other backlogged flows by (tag, tenant order)
        self.vtime = 0.0


class Flow(MinQueue):
    """A tenant's work of one level: its queued denoise jobs (a MinQueue of QueueKey) and their start tag, and its
    requests waiting for an AR batch (counted) and their start tag."""

    __slots__ = ("tenant", "level", "tag", "inc", "order", "ar_level", "ar_tag", "ar_requests", "ar_outputs")

    def __init__(self, tenant: Tenant, level: Level, ar_level: Level) -> None:
        super().__init__()
        self.tenant = tenant
        self.level = level
        self.tag = 0.0
        self.inc = 1.0 / tenant.weight  # a job's cost over the weight
        self.order = tenant.order  # the last tie-break between equal tags
        self.ar_level = ar_level
        self.ar_tag = 0.0
        self.ar_requests = 0
        self.ar_outputs = 0


class Tenant:
    """A tenant: its two flows (non-batch, batch) and its figures, kept as they change."""

    __slots__ = ("name", "weight", "order", "flows", "by_class", "active_outputs", "requests", "waiting", "late",
                 "waiting_cap")

    def __init__(self, name: str, weight: float, order: int, levels: tuple[Level, ...]) -> None:
        self.name = name
        self.weight = weight
        self.order = order
        self.flows = (Flow(self, levels[0], levels[2]), Flow(self, levels[1], levels[3]))
        self.by_class = (self.flows[0], self.flows[0], self.flows[1])  # INTERACTIVE, DEFAULT, BATCH
        self.active_outputs = 0
        # Its active requests by seq (their count is its active requests'), and its non-batch ones that may have queued
        # work: each has one entry (its seq;
        # Request.listed), in ``waiting`` (admission order) or, listed again after the gauges dropped it, in ``late``
        # (a heap). Every one with queued work has an entry; the oldest wait is the first one's that still has some
        # (Shares.oldest_wait). Entries are ints: they keep no ended request alive and allocate nothing the cyclic
        # GC counts (a tuple an admission made it collect 13 times as often).
        self.requests: dict[int, Request] = {}
        self.waiting: deque[int] = deque()
        self.late: list[int] = []
        self.waiting_cap = 64  # past this many entries, those of ended requests are dropped


class DenoiseQueue:
    """The denoise stage's queue: a fair queue over the tenants' flows (Flow), non-batch level first.

    ``first`` is the entry pop() would return (None if empty), kept up to date like MinQueue.first. The LoRA
    placement's pass takes entries with take() between begin() and put_back(): each is charged as if served, so the
    pass sees the jobs in fair order, and those it kept are put back uncharged."""

    __slots__ = ("first", "_nb", "_b", "_len", "_taken", "_kept", "_before")

    def __init__(self) -> None:
        self.first: QueueKey | None = None
        self._nb, self._b = Level(), Level()
        self._len = 0
        self._taken: list[tuple[QueueKey, Flow, float]] = []
        self._kept: list[QueueKey] = []
        self._before = (0.0, 0.0)

    @property
    def levels(self) -> tuple[Level, Level]:
        return self._nb, self._b

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[QueueKey]:
        """Every entry, in no particular order."""
        for level in (self._nb, self._b):
            if level.lead is not None:
                yield from level.lead
                for _, _, flow in level.heap:
                    yield from flow

    def push(self, key: QueueKey, flow: Flow) -> None:
        self._len += 1
        first = flow.first
        if first is not None:  # MinQueue.push, inlined (this runs for every output)
            lane = flow._lane
            if lane[-1] < key if lane else True:
                lane.append(key)
            else:
                heapq.heappush(flow._heap, key)
            if not key < first:
                return  # (no flow's first changed: neither did the queue's)
            flow.first = key
        else:  # idle until now: it starts at the virtual time, banking no credit
            level = flow.level
            if flow.tag < level.vtime:
                flow.tag = level.vtime
            flow.push(key)
            lead = level.lead
            if lead is None:
                level.lead = flow
            elif (flow.tag, flow.order) < (lead.tag, lead.order):
                heapq.heappush(level.heap, (lead.tag, lead.order, lead))
                level.lead = flow
            else:
                heapq.heappush(level.heap, (flow.tag, flow.order, flow))
        self._refirst()

    def _refirst(self) -> None:
        lead = self._nb.lead
        if lead is None:
            lead = self._b.lead
        self.first = None if lead is None else lead.first

    def pop(self) -> QueueKey:
        """Take the first entry out (the queue must not be empty) and charge its flow."""
        level = self._nb
        flow = level.lead
        if flow is None:
            level = self._b
            flow = level.lead
        # MinQueue.pop, inlined (this runs for every dispatch)
        key = flow.first  # type: ignore[union-attr]
        lane = flow._lane  # type: ignore[union-attr]
        fheap = flow._heap  # type: ignore[union-attr]
        if fheap:
            if fheap[0] is key:
                heapq.heappop(fheap)
            else:
                lane.popleft()
            if lane and fheap:
                head = lane[0] if lane[0] < fheap[0] else fheap[0]
            else:
                head = lane[0] if lane else fheap[0] if fheap else None
        else:
            lane.popleft()
            head = lane[0] if lane else None
        flow.first = head  # type: ignore[union-attr]
        self._len -= 1
        level.vtime = start = flow.tag  # type: ignore[union-attr]
        flow.tag = start + flow.inc  # type: ignore[union-attr]
        if level.heap or head is None:
            self._next_lead(level, flow)  # type: ignore[arg-type]
        else:  # the fast path: the only backlogged flow of its level stays the lead
            self.first = head
        return key

    def _next_lead(self, level: Level, flow: Flow) -> None:
        """After ``flow``, the lead of ``level``, was served: the flow with the smallest tag leads."""
        heap = level.heap
        if flow.first is None:
            level.lead = heapq.heappop(heap)[2] if heap else None
        elif heap and heap[0] < (flow.tag, flow.order):
            level.lead = heapq.heapreplace(heap, (flow.tag, flow.order, flow))[2]
        self._refirst()

    def drop(self, flow: Flow, seq: int) -> None:
        """Remove a request's entries (it ended): they are not served, so nothing is charged."""
        before = len(flow)
        if not before:
            return
        flow.drop_if(lambda k: k[2] == seq)
        self._len -= before - len(flow)
        if flow.first is None:
            level = flow.level
            if level.lead is flow:
                level.lead = heapq.heappop(level.heap)[2] if level.heap else None
            else:
                level.heap = [e for e in level.heap if e[2] is not flow]
                heapq.heapify(level.heap)
        self._refirst()

    # The LoRA placement's pass (placement.Placement.dispatch).

    def begin(self) -> None:
        self._taken, self._kept = [], []
        self._before = (self._nb.vtime, self._b.vtime)

    def take(self) -> QueueKey:
        """pop(), remembered: keep() it to have it put back."""
        flow = self._nb.lead
        if flow is None:
            flow = self._b.lead
        key = self.pop()
        self._taken.append((key, flow, flow.level.vtime))  # type: ignore[union-attr]
        return key

    def keep(self, key: QueueKey) -> None:
        self._kept.append(key)

    def put_back(self) -> None:
        """End the pass: the entries kept go back, their flows' charges undone; the virtual time is the start tag of
        the last one served (the largest), not of the last one looked at."""
        if not self._taken:
            return
        kept = {id(k) for k in self._kept}
        vtimes = {id(self._nb): self._before[0], id(self._b): self._before[1]}
        flows: dict[int, Flow] = {}
        for key, flow, start in self._taken:
            if id(key) in kept:
                flow.tag -= flow.inc
                flow.push(key)
                self._len += 1
                flows[id(flow)] = flow
            elif start > vtimes[id(flow.level)]:
                vtimes[id(flow.level)] = start
        self._taken, self._kept = [], []
        for level in (self._nb, self._b):
            level.vtime = vtimes[id(level)]
            backlog = {id(f): f for _, _, f in level.heap}
            if level.lead is not None:
                backlog[id(level.lead)] = level.lead
            backlog.update((i, f) for i, f in flows.items() if f.level is level)
            ranked = sorted(backlog.values(), key=lambda f: (f.tag, f.order))
            level.lead = ranked[0] if ranked else None
            level.heap = [(f.tag, f.order, f) for f in ranked[1:]]  # sorted: a heap already
        self._refirst()
