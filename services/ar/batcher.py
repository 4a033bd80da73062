"""Admission to the one model of a server: calls run one at a time, in arrival order, off the event loop.

A call that arrives while the model is busy waits in a FIFO queue. A waiter whose caller cancels, or whose deadline
passes, leaves the queue before it starts, so the model never spends time on work nobody waits for.
The slot is held until the worker thread really returns, even when the caller gave up mid-run, so a cancelled
run can never overlap the next one.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import TypeVar

from services.runtime.errors import DeadlineExceeded, ResourceExhausted
from services.runtime.executor import SerialExecutor

log = logging.getLogger(__name__)

T = TypeVar("T")


class AdmissionQueue:
    def __init__(self, executor: SerialExecutor, *, max_waiting: int = 0,
                 on_depth: Callable[[int], None] | None = None) -> None:
        """max_waiting: calls allowed to wait behind the running one (0: no limit)."""
        self._executor = executor
        self._max_waiting = max_waiting
        self._on_depth = on_depth
        self._waiting: deque[asyncio.Future[None]] = deque()
        self._busy = False
        self._changed = asyncio.Event()  # replaced (after being set) on every change

    @property
    def busy(self) -> bool:
        return self._busy

    @property
    def waiting(self) -> int:
        return sum(not f.done() for f in self._waiting)

    async def wait_for(self, predicate: Callable[[AdmissionQueue], bool]) -> None:
        """Return once predicate(self) holds, re-checked on every change: for drains and tests."""
        while not predicate(self):
            await self._changed.wait()

    def _notify(self) -> None:
        if self._on_depth is not None:
            self._on_depth(self.waiting)
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def acquire(self, deadline: float | None = None) -> float:
        """Wait for the slot; returns the seconds waited. Raises DeadlineExceeded, ResourceExhausted, or
        CancelledError (the caller went away), in each case without ever taking the slot."""
        t0 = time.perf_counter()
        if not self._busy and not self._waiting:
            self._busy = True
            self._notify()
            return 0.0
        if self._max_waiting and self.waiting >= self._max_waiting:
            raise ResourceExhausted(f"the AR queue is full ({self._max_waiting} calls waiting; --max-queue)")
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append(turn)
        self._notify()
        try:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            await asyncio.wait_for(turn, timeout)
        except BaseException as exc:
            if turn.done() and not turn.cancelled():
                self._release()  # handed the slot just as the caller gave up: pass it on
            else:
                turn.cancel()
                self._waiting.remove(turn)
                self._notify()
            if isinstance(exc, TimeoutError):
                raise DeadlineExceeded("the deadline passed while waiting for the AR model") from None
            raise
        return time.perf_counter() - t0

    def _release(self, _: object = None) -> None:
        while self._waiting:
            turn = self._waiting.popleft()
            if not turn.done():
                turn.set_result(None)  # the slot passes straight to the next waiter
                self._notify()
                return
        self._busy = False
        self._notify()

    async def run_acquired(self, fn: Callable[..., T], *args) -> T:
        """Run fn on the worker thread with the slot already held; frees it when the thread returns."""
        work = asyncio.ensure_future(self._executor.run(fn, *args))
        work.add_done_callback(self._finished)
        # shield: a cancelled caller must not free the slot while the thread still runs.
        return await asyncio.shield(work)

    def _finished(self, work: asyncio.Future) -> None:
        if not work.cancelled():
            work.exception()  # retrieved here, so an abandoned run's error is not reported as never retrieved
        self._release()

    async def run(self, fn: Callable[..., T], *args, deadline: float | None = None) -> T:
        await self.acquire(deadline)
        return await self.run_acquired(fn, *args)
