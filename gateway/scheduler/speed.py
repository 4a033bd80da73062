"""The scheduler's CPython speed tricks, in one place, and what each buys.

bench/scheduler_micro.py measures the scheduler alone: an event costs about 6 to 9 µs at 10 to 1,000 denoisers
(BENCHMARKS.md, "Scheduler alone"), where the scheduler before tuning took 13 to 16 µs; tests/test_scheduler_replay.py
pins that no trick changes a single output.

Defined here: the enum members the hot paths compare against, bound to module globals (``from .speed import QUEUED``
makes them globals of the importing module). Reading a member off its class (``OutState.QUEUED``) goes through the
enum metaclass's __getattr__ hook in CPython 3.11: about 110 ns, against 16 ns for a global (``timeit`` of
``x is OutState.QUEUED`` and ``x is QUEUED``), and an event makes a dozen such reads: about 1 µs an event. And NEVER,
because ``float("inf")`` parses a string on every call (and the AR pass compares against it on every look).

Kept where their invariant lives, each said there:
- the ready counts and each worker's ``ready`` flag (pool.Pool.recount): "does any worker of this stage take work"
  (every event, with fail-fast on) in O(1), not a scan of the denoiser pool;
- MinQueue.first, ArQueue.outputs and ArQueue.oldest() (containers.py): a peek is an attribute read, not a scan;
- Pool.ar_servers, bound once: the role enum is not hashed on every event;
- __slots__ on the records (records.py, pool.Worker): attributes read and written on every event;
- the handler table on the exact event type (core.Scheduler.handle): one dict lookup, not isinstance over 14 types.
"""

from __future__ import annotations

import math

from .records import OutState, Stage
from .types import WorkerRole

PENDING_AR, AR_INFLIGHT, DENOISING = Stage.PENDING_AR, Stage.AR_INFLIGHT, Stage.DENOISING
IDLE, QUEUED, INFLIGHT, DONE = OutState.IDLE, OutState.QUEUED, OutState.INFLIGHT, OutState.DONE
AR, DENOISER = WorkerRole.AR, WorkerRole.DENOISER

NEVER = math.inf  # a time no clock reaches
