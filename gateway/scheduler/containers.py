"""The scheduler's two hand-tuned containers: ``MinQueue`` (the denoise queue and the deadlines) and ``ArQueue`` (one
AR queue). Each keeps the figure the scheduler asks for on every event (the smallest entry; the outputs waiting and
the oldest request) up to date, so that asking costs an attribute read, not a scan of 10,000 entries.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from .records import Request


class MinQueue:
    """A priority queue of unique, comparable entries, smallest first: a heap with a fast lane.

    Entries usually come in increasing order (deadlines of requests with the same timeout; the outputs of AR
    batches answered in turn), and a pop from a heap of 10,000 sifts through cold memory. So an entry greater than
    the last one in the lane is appended to the lane (a deque, sorted by construction), any other goes to the heap,
    and a pop takes the smaller of the two heads: the same order as one heap. ``first`` is the smallest entry
    (None if empty), kept up to date so that a peek costs an attribute read."""

    __slots__ = ("first", "_lane", "_heap")

    def __init__(self) -> None:
        self.first: Any = None
        self._lane: deque[Any] = deque()
        self._heap: list[Any] = []

    def __len__(self) -> int:
        return len(self._lane) + len(self._heap)

    def __iter__(self) -> Iterator[Any]:
        """Every entry, in no particular order."""
        yield from self._lane
        yield from self._heap

    def push(self, entry: Any) -> None:
        lane = self._lane
        if not lane or lane[-1] < entry:
            lane.append(entry)
        else:
            heapq.heappush(self._heap, entry)
        if self.first is None or entry < self.first:
            self.first = entry

    def pop(self) -> Any:
        """Take the smallest entry out (the queue must not be empty)."""
        entry = self.first
        if self._heap and self._heap[0] is entry:
            heapq.heappop(self._heap)
        else:
            self._lane.popleft()
        self._find_first()
        return entry

    def drop_if(self, doomed: Callable[[Any], bool]) -> None:
        self._lane = deque(e for e in self._lane if not doomed(e))
        self._heap = [e for e in self._heap if not doomed(e)]
        heapq.heapify(self._heap)
        self._find_first()

    def _find_first(self) -> None:
        lane, heap = self._lane, self._heap
        if lane and heap:
            self.first = lane[0] if lane[0] < heap[0] else heap[0]
        elif lane:
            self.first = lane[0]
        else:
            self.first = heap[0] if heap else None


class ArQueue:
    """One AR queue (a resolution's, or a solo request's own): its requests in dispatch order, and the two figures
    the AR dispatch pass checks on every look, kept up to date instead of recomputed from the requests each time:
    ``outputs`` (the sum of their n) and ``oldest()`` (the smallest (arrived_at, seq), cached)."""

    __slots__ = ("requests", "outputs", "_oldest")

    def __init__(self) -> None:
        self.requests: deque[Request] = deque()
        self.outputs = 0
        self._oldest: tuple[float, int] | None = None  # None: to be computed (empty, or its oldest left)

    def push(self, req: Request, front: bool) -> None:
        if front:
            self.requests.appendleft(req)
        else:
            self.requests.append(req)
        self.outputs += req.n
        if self._oldest is not None and (req.arrived_at, req.seq) < self._oldest:
            self._oldest = (req.arrived_at, req.seq)  # a retried request keeps its age: it may be the oldest

    def remove(self, req: Request) -> None:
        self.requests.remove(req)
        self.outputs -= req.n
        if (req.arrived_at, req.seq) == self._oldest:
            self._oldest = None

    def keep_only(self, rest: deque[Request]) -> None:
        """After a batch took some of the requests: ``rest`` are those left, in order."""
        self.requests = rest
        self.outputs = sum(r.n for r in rest)
        self._oldest = None

    def oldest(self) -> tuple[float, int]:
        if self._oldest is None:
            self._oldest = min((r.arrived_at, r.seq) for r in self.requests)
        return self._oldest
