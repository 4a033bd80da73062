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
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from runtime.errors import DeadlineExceeded, ResourceExhausted
from runtime.executor import SerialExecutor
from runtime.logs import spawn
from services.ar.domain import RunControl

log = logging.getLogger(__name__)

R = TypeVar("R")
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
    def idle(self) -> bool:
        """Nothing holds or waits for the slot: acquire() takes it without waiting."""
        return not self._busy and not self._waiting

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

    def release(self) -> None:
        """Free a slot taken with acquire() that will run nothing (every call merged into it went away)."""
        self._release()


@dataclass(eq=False)
class _Call(Generic[R, T]):
    items: list[R]
    key: Hashable | None  # calls of one key may share a model batch; None: never merged
    rows: int
    control: RunControl
    t0: float = field(default_factory=time.perf_counter)
    claimed: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    result: asyncio.Future[list[T]] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    batch: _Batch | None = None


@dataclass(eq=False)
class _Batch:
    calls: list[_Call]
    control: RunControl  # the model batch's own: cancelled only once every call in it is gone


class CallMerger(Generic[R, T]):
    """Calls waiting for the model that share a key run as one model batch, up to `cap` rows.

    The call handed the slot leads: it gathers compatible waiters (those still in the admission queue), for up to
    `window` seconds while below the cap, and runs them all in one `run(items, control)` on the worker thread; each
    call gets back exactly its own slice of the results. The batch runs in a task of its own, so a call that leaves
    (client gone, deadline) only drops its rows; the model stops early only when every call in the batch is gone.
    """

    def __init__(self, admission: AdmissionQueue, run: Callable[[list[R], RunControl], list[T]], *, cap: int,
                 window: float = 0.0, on_wait: Callable[[float], None] | None = None,
                 on_merged: Callable[[int], None] | None = None) -> None:
        self._admission = admission
        self._run = run
        self._cap = cap
        self._window = window
        self._on_wait = on_wait
        self._on_merged = on_merged
        self._pending: list[_Call] = []  # calls in the admission queue, in arrival order
        self._arrived = asyncio.Event()  # replaced (after being set) on every arrival
        self._tasks: set[asyncio.Task] = set()
        self.current: RunControl | None = None  # the batch holding the model, for drains and tests

    async def submit(self, items: list[R], *, key: Hashable | None, rows: int, control: RunControl) -> list[T]:
        """Wait for the model (alone or merged into another call's batch) and return this call's results.
        Raises what acquire() raises, the batch's error, or CancelledError; a call gone never holds the slot."""
        call: _Call = _Call(items, key, rows, control)
        self._pending.append(call)
        arrived, self._arrived = self._arrived, asyncio.Event()
        arrived.set()
        admitted: asyncio.Future[float]
        if self._admission.idle:  # taken at once, without yielding: `current` is set as soon as `busy` is
            admitted = asyncio.get_running_loop().create_future()
            admitted.set_result(await self._admission.acquire(control.deadline))
        else:
            admitted = asyncio.ensure_future(self._admission.acquire(control.deadline))
        try:
            if not admitted.done():
                await asyncio.wait((admitted, call.claimed), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            self._drop(admitted)
            if call.claimed.done():
                call.result.cancel()
                self._leave(call)
            raise
        finally:
            if call in self._pending:
                self._pending.remove(call)
        if call.claimed.done():  # merged into another call's batch: leave the admission queue
            self._drop(admitted)
        else:
            self._waited(call, admitted.result())  # raises DeadlineExceeded / ResourceExhausted
            call.batch = _Batch([call], RunControl(deadline=control.deadline))
            self.current = call.batch.control  # before any await: set as soon as the model is taken
            # It runs the batch for every call merged into it, not for this one alone.
            task = spawn(self._lead(call.batch), name="ar-batch")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        try:
            return await call.result
        except asyncio.CancelledError:
            self._leave(call)
            raise

    def _waited(self, call: _Call, seconds: float) -> None:
        """The call's wait for the model is over: its caller is told (queue_seconds), and the metrics."""
        call.control.queue_seconds = seconds
        if self._on_wait is not None:
            self._on_wait(seconds)

    def _drop(self, admitted: asyncio.Future[float]) -> None:
        """Give up a call's own place in the admission queue, passing on the slot if it was already handed it."""
        if not admitted.done():
            admitted.cancel()  # acquire() itself passes on a slot handed to it as it is cancelled
        elif not admitted.cancelled() and admitted.exception() is None:
            self._admission.release()

    def _leave(self, call: _Call) -> None:
        call.control.cancel.set()
        batch = call.batch
        if batch is not None and all(c.result.cancelled() for c in batch.calls):
            batch.control.cancel.set()  # nobody waits for any row of it any more

    def _claim(self, batch: _Batch) -> int:
        """Move compatible waiters into the batch while they fit; returns the rows it holds."""
        rows = sum(c.rows for c in batch.calls)
        key = batch.calls[0].key
        if key is None:
            return self._cap
        for call in list(self._pending):
            if call.key != key or call.result.done() or rows + call.rows > self._cap:
                continue
            self._pending.remove(call)
            call.batch = batch
            call.claimed.set_result(None)
            batch.calls.append(call)
            rows += call.rows
            self._waited(call, time.perf_counter() - call.t0)
            deadlines = [c.control.deadline for c in batch.calls]
            batch.control.deadline = None if None in deadlines else max(deadlines)
        return rows

    async def _lead(self, batch: _Batch) -> None:
        """Gather, run and hand out one model batch; the slot is freed however it ends."""
        try:
            stop = time.monotonic() + self._window
            while self._claim(batch) < self._cap and (left := stop - time.monotonic()) > 0:
                try:  # (asyncio.timeout: on 3.11 wait_for swallows a cancel that comes as the event is set)
                    async with asyncio.timeout(left):
                        await self._arrived.wait()
                except TimeoutError:
                    pass
            calls = [c for c in batch.calls if not c.result.done()]
        except BaseException:
            calls = []
        if not calls:
            self.current = None
            self._admission.release()
            return
        if self._on_merged is not None and len(calls) > 1:
            self._on_merged(len(calls) - 1)
        items = [item for c in calls for item in c.items]
        try:
            results = await self._admission.run_acquired(self._run, items, batch.control)
        except Exception as exc:
            for c in calls:
                if not c.result.done():
                    c.result.set_exception(exc)
            return
        except asyncio.CancelledError:  # the server is shutting down
            for c in calls:
                c.result.cancel()
            raise
        finally:
            self.current = None
        start = 0
        for c in calls:
            if not c.result.done():
                c.result.set_result(results[start:start + len(c.items)])
            start += len(c.items)
