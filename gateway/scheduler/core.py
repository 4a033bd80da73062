"""Pure scheduling core of the gateway (functional core, imperative shell).

The scheduler is a deterministic state machine: ``Scheduler.handle(event)`` is the only mutator and returns
the actions an asyncio driver must perform (dispatch/cancel RPCs, finish client calls). It does no I/O, reads
no clock and imports nothing outside the standard library, so it can be tested in microseconds and with
property-based tests. Time only enters through ``event.now`` (monotonic seconds).

Pipeline: admitted requests wait in a pending-AR queue grouped by resolution; AR batches (capacity counted in
output slots) are formed just in time when an AR worker has room; each request's n AR outputs then enter the
pending-denoise queue and fan out to n batch-1 denoisers at once.

Invariants (checked by the tests/test_scheduler_*.py files):
- every admitted request ends exactly once (CompleteRequest or FailRequest);
- a denoiser never holds more than one job;
- a result from a superseded attempt, a finished request or the wrong worker is fenced: it completes nothing and
  frees only a slot that is really held by exactly that job;
- a worker that is healthy again gets work immediately (every handle() ends with the dispatch loop).

This module is the policy, top to bottom: the public API, the event handlers, the request lifecycle, the AR stage,
the denoise stage. Parts of it have modules of their own: fairness.py (the share of both stages between tenants:
the order in which queued work is served), placement.py (the LoRA placement's denoise pass), capability.py (which
workers may run which requests, in a mixed pool) and arrival.py (whether an arriving request is admitted). What it
keeps its books with is in the other siblings: records.py (a request and its outputs), containers.py (the queues),
pool.py (the workers, and the choice of a free one), speed.py (the CPython speed tricks).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any, get_args

# Failure classes are shared with the gRPC edge, which maps them to status codes (that module is stdlib-only).
from runtime.errors import ErrorKind

from .arrival import refusal
from .capability import Capability, Fits
from .containers import ArQueue, MinQueue
from .fair_queue import QueueKey
from .fairness import Shares
from .placement import Placement
from .pool import Pool, Worker
from .records import Output, Request
from .speed import AR, AR_INFLIGHT, DENOISER, DENOISING, DONE, IDLE, INFLIGHT, NEVER, PENDING_AR, QUEUED
from .types import (
    Action,
    ArBatchFailed,
    ArBatchSucceeded,
    CancelArBatch,
    CancelDenoise,
    CompleteRequest,
    Counters,
    DenoiseFailed,
    DenoiseRefusedBusy,
    DenoiserOccupancy,
    DenoiseSucceeded,
    DispatchArBatch,
    DispatchDenoise,
    Event,
    FailRequest,
    Gauges,
    JobId,
    RequestArrived,
    RequestCancelled,
    RequestError,
    SchedulerConfig,
    Snapshot,
    Tick,
    WorkerAdded,
    WorkerCapabilities,
    WorkerDown,
    WorkerHealthy,
    WorkerNotServing,
    WorkerRemoved,
    WorkerUnhealthy,
)

__all__ = ["Scheduler"]


_EVENT_TYPES: tuple[type, ...] = get_args(Event)


# A denoise queue entry (fair_queue.QueueKey): (priority class, requeued?, admission seq, index, request_id); requeued
# ones (_FRONT) go first within their class and tenant.
_FRONT, _FRESH = 0, 1

# How many ended request ids remember their highest attempt number. A reused id continues above it, so a late
# result of the previous incarnation cannot pass the fencing check of the new one.
_ATTEMPT_MEMORY = 4096


class Scheduler:
    """Deterministic two-stage scheduler. See the module docstring."""

    def __init__(self, config: SchedulerConfig = SchedulerConfig(), pick_seed: str | None = None,
                 fits: Fits | None = None) -> None:
        """``pick_seed``: this gateway's own order of the denoisers, for the choice of a free one (see Pool); the
        choices are deterministic given it. None: the order they joined in. ``fits(needs, capabilities)``: whether a
        request fits a worker (capability.py); None: every request fits every worker."""
        self.config = config
        self.counters = Counters()
        self._now: float = float("-inf")
        self._seq = itertools.count(1)
        self._batch_ids = itertools.count(1)
        self._maybe_abandoned: set[int] = set()  # batches that lost a request during the current event
        self._active: dict[str, Request] = {}
        # (height, width, 0) -> the requests that may batch together; a solo request queues under its own key.
        self._pending_ar: dict[tuple[int, int, int], ArQueue] = {}  # none is empty
        self._pending_ar_outputs = 0
        # The tenants, and the fair order of both stages: the denoise queue is theirs (see fairness.py).
        self._shares = Shares()
        self._denoise_q = self._shares.denoise
        self._batches: dict[int, DispatchArBatch] = {}  # in flight, as dispatched
        self._pool = Pool(config.ar_max_inflight_batches, pick_seed)
        self._deadlines = MinQueue()  # of (deadline, seq, request_id), lazily pruned
        self._attempt_floor: OrderedDict[str, int] = OrderedDict()
        self._ended = False  # a request ended during this event (see _prune_deadlines)
        # When the AR dispatch pass may find something to do again (see _dispatch_ar): at once if _ar_dirty (an AR
        # queue or an AR worker changed), else from _ar_recheck_at on (a waiting group's batch delay expires).
        self._ar_dirty = False
        self._ar_recheck_at = NEVER
        self._placement = Placement(config.lora_load_cost)  # and what it learns (see placement.py)
        self._capability = Capability(fits)  # which workers may run which requests (see capability.py)
        # Event type -> its handler, in the order of the Event union (handle() looks up the exact type).
        self._handlers: dict[type, Callable[[Any, list[Action]], None]] = {
            RequestArrived: self._on_arrived,
            ArBatchSucceeded: self._on_ar_succeeded,
            ArBatchFailed: self._on_ar_failed,
            DenoiseSucceeded: self._on_denoise_succeeded,
            DenoiseFailed: self._on_denoise_failed,
            DenoiseRefusedBusy: self._on_denoise_refused_busy,
            DenoiserOccupancy: self._on_denoiser_occupancy,
            WorkerAdded: self._on_worker_added,
            WorkerRemoved: self._on_worker_removed,
            WorkerHealthy: self._on_worker_healthy,
            WorkerUnhealthy: self._on_worker_unhealthy,
            WorkerNotServing: self._on_worker_not_serving,
            WorkerCapabilities: self._on_worker_capabilities,
            RequestCancelled: self._on_cancelled,
            Tick: self._on_tick,
        }
        assert tuple(self._handlers) == _EVENT_TYPES, "a handler per event type, in the union's order"

    # ------------------------------------------------------------------------------------------------ public API

    @property
    def fenced_results(self) -> int:
        return self.counters.fenced_results

    def handle(self, event: Event) -> list[Action]:
        """Apply one event; return the actions to perform, in order."""
        # One dict lookup on the exact type, not isinstance over the 14 types of the union: this runs on every event.
        # Anything else (a subclass of an event type, or not an event) takes the slow path: isinstance against each
        # type in the union's order.
        handler = self._handlers.get(type(event))
        if handler is None:
            handler = self._handler_by_isinstance(event)
        # Time never goes backwards, even if the driver delivers slightly out-of-order timestamps.
        if event.now > self._now:
            self._now = event.now
        actions: list[Action] = []
        # Deadlines first: a result that arrives at or after the deadline must not complete the request.
        # (Each pass below is called only when its first test would not return at once: this runs on every event.)
        first = self._deadlines.first
        if first is not None and first[0] <= self._now:
            self._expire_deadlines(actions)
        handler(event, actions)
        # After any event: the last worker of a stage may be gone, a batch may have lost its last request.
        pool = self._pool
        if self._pending_ar and not pool.ready_ar:
            self._fail_stranded_ar_requests(actions)
        if self._denoise_q.first is not None and not pool.ready_denoisers:
            self._fail_stranded_denoise_requests(actions)
        if self._maybe_abandoned:
            self._stop_abandoned_batches(actions)
        # Work conservation: every event may have freed a worker or queued work. The AR pass runs only when what
        # it reads has changed since it last found nothing to do (see _dispatch_ar). The denoise pass needs both
        # queued work and a denoiser that may be free (with either missing it does nothing, and touches nothing).
        if self._ar_dirty or self._now >= self._ar_recheck_at:  # else the AR pass would find nothing to do
            self._dispatch_ar(actions)
        if pool.idle and self._denoise_q.first is not None:
            self._dispatch_denoise(actions)
        if self._ended:  # only an ended request can leave a dead entry at the head of the deadline queue
            self._prune_deadlines()
        return actions

    def _handler_by_isinstance(self, event: Event) -> Callable[[Any, list[Action]], None]:
        for event_type, handler in self._handlers.items():  # in the order of the Event union
            if isinstance(event, event_type):
                return handler
        raise TypeError(f"unknown event type {type(event).__name__}")

    def next_wakeup(self) -> float | None:
        """Earliest time at which a Tick would change something, or None."""
        candidates: list[float] = []
        if self._deadlines.first is not None:
            candidates.append(self._deadlines.first[0])  # pruned after every handle(): the head is live
        # When a waiting group's batch delay lets it leave, as the AR pass last found (see _dispatch_ar), if an AR
        # server could take it; otherwise the event that frees one triggers the dispatch. (Without this, an expired
        # group would make the driver spin.)
        if self._ar_recheck_at < NEVER and self._pool.free_ar_server() is not None:
            candidates.append(self._ar_recheck_at)
        # A job waiting for a busy holder of its adapters while a denoiser is free: placed when its wait ends.
        recheck = self._placement.recheck_at
        if recheck < NEVER and self._denoise_q.first is not None and self._pool.idle:
            candidates.append(recheck)
        return min(candidates) if candidates else None

    def snapshot(self) -> Snapshot:
        return Snapshot(**self._queue_figures(), workers=self._pool.snapshots())

    def gauges(self) -> Gauges:
        """What the metrics publish: the queues and the workers counted by role and state, from figures kept as
        they change (snapshot() builds an entry per worker, for GetStatus)."""
        return Gauges(**self._queue_figures(), workers=self._pool.state_counts(),
                      denoisers_held_elsewhere=self._pool.held_elsewhere)

    def _queue_figures(self) -> dict[str, Any]:
        return {"pending_ar_requests": sum(len(q.requests) for q in self._pending_ar.values()),
                "pending_ar_outputs": self._pending_ar_outputs, "pending_denoise_outputs": len(self._denoise_q),
                # (a walk of the denoise queue: counting them as they come and go would cost every denoise job)
                "pending_denoise_requests": len({k[2] for k in self._denoise_q}),
                "active_requests": len(self._active),
                "tenants": self._shares.snapshots(self._now)}  # (each tenant's figures kept as they change)

    def tenant_of(self, request_id: str) -> str | None:
        """The tenant an active request was admitted under (None: not active)."""
        req = self._active.get(request_id)
        return None if req is None else req.flow.tenant.name

    def queued_outputs(self) -> int:
        """Outputs waiting in either queue (for an AR batch or for a denoiser): what admission bounds."""
        return self._pending_ar_outputs + len(self._denoise_q)

    def is_not_serving(self, address: str) -> bool:
        """Whether ``address`` said NOT_SERVING (draining: finishing what it holds, taking nothing new)."""
        w = self._pool.members.get(address)
        return w is not None and w.not_serving

    def has_worker(self, address: str) -> bool:
        """Whether ``address`` is still a member (a removed worker stays one until it has drained)."""
        return address in self._pool.members

    # --------------------------------------------------------------------------------------------- event handlers

    def _on_arrived(self, ev: RequestArrived, actions: list[Action]) -> None:
        rid = ev.request_id
        refused = refusal(ev, self.config, self._pool, self._shares, rid in self._active,
                          self._pending_ar_outputs + len(self._denoise_q))  # (queued_outputs(), on the hot path)
        if refused is not None:
            self.counters.rejected += 1
            kind, message, note = refused
            actions.append(FailRequest(rid, RequestError(kind, message, operator_note=note)))
            return

        base = self._attempt_floor.pop(rid, 0)
        req = Request(
            request_id=rid,
            seq=next(self._seq),
            n=ev.n,
            height=ev.height,
            width=ev.width,
            deadline=ev.deadline,
            arrived_at=self._now,
            attempt_base=base,
            outputs=[Output(index=i, attempt=base) for i in range(ev.n)],
            solo=ev.solo,
            loras=ev.loras,
            priority=ev.priority,
            needs=ev.needs,
        )
        self._active[rid] = req
        self.counters.admitted += 1
        self._shares.admit(ev, req)
        if req.loras:
            self._placement.requests += 1
        self._capability.admit(req)
        self._enqueue_ar(req, front=False)
        if ev.deadline is not None and ev.deadline <= self._now:
            # Admitted and ended at once, so every admitted request still ends exactly once.
            self._fail(req, ErrorKind.DEADLINE_EXCEEDED, "deadline exceeded on arrival", actions)
        elif ev.deadline is not None:
            self._deadlines.push((ev.deadline, req.seq, rid))

    def _on_cancelled(self, ev: RequestCancelled, actions: list[Action]) -> None:
        req = self._active.get(ev.request_id)
        if req is not None:
            self._fail(req, ev.kind, ev.message, actions)

    def _on_ar_succeeded(self, ev: ArBatchSucceeded, actions: list[Action]) -> None:
        batch = self._take_batch(ev.batch_id)
        if batch is None:
            return
        for req in self._waiting_for(batch):  # one that ended while the batch was in flight is just dropped
            req.ar_batch = None
            outs = ev.outputs.get(req.request_id)
            if outs is None or len(outs) != req.n:
                got = "no" if outs is None else str(len(outs))
                self._fail(
                    req, ErrorKind.INTERNAL, f"AR stage returned {got} outputs, expected {req.n}", actions
                )
                continue
            req.stage = DENOISING
            req.ar_outputs = tuple(outs)
            for out in req.outputs[:1] if self.config.serial_outputs else req.outputs:
                self._enqueue_output(req, out, front=False)

    def _on_ar_failed(self, ev: ArBatchFailed, actions: list[Action]) -> None:
        batch = self._take_batch(ev.batch_id)
        if batch is None:
            return
        if ev.kind not in (ErrorKind.INVALID_ARGUMENT, ErrorKind.INTERNAL):
            self._ar_batch_failed(batch, f"AR stage failed: {ev.message}", "ar_failed", actions)
            return
        # The fault lies with one of the batch's requests (the AR refused its input, or handling it failed in the
        # gateway itself): not worth a retry as is, and nobody else's fault.
        live = self._waiting_for(batch)
        if len(live) == 1:  # the message is meant for this client (the AR's names the field): relay it unchanged
            self._fail(live[0], ev.kind, ev.message, actions, field=ev.field)
            return
        # One of them is bad and the others must not pay for it: each goes again alone, at the front, with no
        # retry charged. The bad one then fails by itself.
        for req in reversed(live):
            req.ar_batch = None
            req.solo = True
            self._enqueue_ar(req, front=True)
        self.counters.requeues["ar_batch_split"] += len(live)

    def _on_denoise_succeeded(self, ev: DenoiseSucceeded, actions: list[Action]) -> None:
        found = self._take_job(ev.job, ev.worker)
        if found is None:
            return
        req, out = found
        if req.loras:  # (plain jobs: no learning, nothing on the hot path)
            self._placement.learn_job(ev.now - out.started_at, ev.lora_load_s)
        out.state = DONE
        out.worker = None
        out.result = ev.result
        req.done += 1
        if self.config.serial_outputs and req.done < req.n:
            # Outputs finish in index order here; the next one goes first, like a continuation of this job.
            self._enqueue_output(req, req.outputs[out.index + 1], front=True)
        if req.done == req.n:
            self._end(req, actions)
            self.counters.completed += 1
            actions.append(
                CompleteRequest(req.request_id, tuple([o.result for o in req.outputs]), req.ar_outputs)
            )

    def _on_denoise_failed(self, ev: DenoiseFailed, actions: list[Action]) -> None:
        found = self._take_job(ev.job, ev.worker)
        if found is None:
            return
        req, out = found
        w = self._pool.members.get(ev.worker)
        if req.loras and w is not None:  # whether it loaded them is unknown: its occupancy stream will say
            self._pool.set_loras(w, w.loras - req.loras)
        out.state, out.worker = IDLE, None
        if ev.retryable:
            self._retry_output(req, out, "denoise_failed", ev.message, actions)
        else:
            # Bad input is the client's to fix: relay the worker's message (it names the field) unchanged.
            message = ev.message if ev.kind is ErrorKind.INVALID_ARGUMENT else f"denoise failed: {ev.message}"
            self._fail(req, ev.kind, message, actions, field=ev.field)

    def _on_denoise_refused_busy(self, ev: DenoiseRefusedBusy, actions: list[Action]) -> None:
        self.counters.collisions += 1
        w = self._pool.members.get(ev.worker)
        held = w is not None and w.role is DENOISER and w.job == ev.job
        found = self._take_job(ev.job, ev.worker)
        # (Not for one that was draining: _take_job has just forgotten it, and a forgotten worker holds nothing.)
        member = held and self._pool.members.get(ev.worker) is w
        if member and (ev.sequence is None or ev.sequence >= w.occupancy_seq):
            # Busy until its stream says free; a free state newer than the refusal already came (stale).
            self._pool.hold_elsewhere(w, True)
            if ev.sequence is not None:
                w.occupancy_seq = ev.sequence
        if found is not None:
            req, out = found
            out.state, out.worker = IDLE, None
            out.refusals += 1
            self._enqueue_output(req, out, front=True)  # to another free denoiser in this same event

    def _on_denoiser_occupancy(self, ev: DenoiserOccupancy, actions: list[Action]) -> None:
        w = self._pool.members.get(ev.worker)
        if w is None or w.role is not DENOISER:
            return
        if ev.sequence is not None:
            if ev.sequence <= w.occupancy_seq:
                return  # older than what a refusal or the stream already said
            w.occupancy_seq = ev.sequence
        if ev.loras is not None:
            # What it holds now, plus what a job of ours it runs will have loaded by its end.
            running = self._active.get(w.job.request_id) if w.job is not None else None
            self._pool.set_loras(w, ev.loras | running.loras if running is not None else ev.loras)
        self._pool.hold_elsewhere(w, ev.elsewhere)
        if not w.elsewhere:
            self._pool.offer(w)

    def _on_tick(self, ev: Tick, actions: list[Action]) -> None:
        pass  # time moved: deadlines before the handler, batch delays in the dispatch loop after it

    def _on_worker_added(self, ev: WorkerAdded, actions: list[Action]) -> None:
        w = self._pool.members.get(ev.worker)
        if w is None:
            w = self._pool.add(ev.worker, ev.role)
            self._recount(w)
        elif w.role is ev.role:
            w.draining = False  # re-added while draining (endpoint flap): keep it
            self._recount(w)
            self._pool.offer(w)
        # A different role under a live address is a discovery glitch: keep the known worker until it is gone.

    def _on_worker_removed(self, ev: WorkerRemoved, actions: list[Action]) -> None:
        w = self._pool.members.get(ev.worker)
        if w is None:
            return
        if w.busy():
            w.draining = True
            self._recount(w)
        else:
            self._forget(w)

    def _on_worker_healthy(self, ev: WorkerHealthy, actions: list[Action]) -> None:
        w = self._pool.members.get(ev.worker)
        if w is not None:
            w.healthy = True  # the dispatch loop at the end of handle() hands it work right away
            w.not_serving = False
            w.down = None
            self._recount(w)
            self._pool.offer(w)

    def _on_worker_not_serving(self, ev: WorkerNotServing, actions: list[Action]) -> None:
        w = self._pool.members.get(ev.worker)
        if w is not None and w.healthy:
            w.not_serving = True  # unlike WorkerUnhealthy, nothing it holds is cancelled or requeued
            self._recount(w)

    def _on_worker_capabilities(self, ev: WorkerCapabilities, actions: list[Action]) -> None:
        w = self._pool.members.get(ev.worker)
        if w is not None:  # (a job of its own already on it was placed by what it could do then, and may end)
            self._capability.set(w, ev.capabilities, self._active.values())
            self._ar_dirty = self._ar_dirty or w.role is AR  # it may take requests it could not (or the reverse)

    def _on_worker_unhealthy(self, ev: WorkerUnhealthy, actions: list[Action]) -> None:
        w = self._pool.members.get(ev.worker)
        if w is None:
            return
        w.down = ev.why  # also for one never healthy: it refused the credential when it joined
        if not w.healthy:
            return  # an unhealthy worker holds nothing (released when it went down)
        w.healthy = False
        w.not_serving = False
        self._recount(w)
        self._pool.hold_elsewhere(w, False)  # its occupancy stream broke too; it says again when it is back
        self._pool.set_loras(w, frozenset())  # (it may come back as a new process, holding none)
        # It refused the call before running it (a credential is checked first): no attempt was used.
        charge = ev.why is not WorkerDown.CREDENTIAL_REFUSED
        # Client-facing: which stage, never which address (the driver logs that with the request ids).
        stage = "the AR server" if w.role is AR else "the denoiser"
        reason = f"{stage} running it " + ("became unavailable" if ev.why is WorkerDown.GONE else ev.why.value)
        if w.role is AR:
            for bid in sorted(w.batches):
                actions.append(CancelArBatch(bid, w.address))
                batch = self._batches.pop(bid)  # fence: its result is ignored from now on
                self._ar_batch_failed(batch, f"AR stage failed: {reason}", "worker_unhealthy", actions, charge)
            w.batches.clear()
            self._ar_dirty = True  # its slots are free (_recount above has set it too: it is unhealthy now)
        elif w.job is not None:
            job, w.job = w.job, None  # the slot is free; the old attempt is fenced by the attempt number
            found = self._live_output(job, w.address)
            if found is not None:
                req, out = found
                actions.append(CancelDenoise(job, w.address))
                out.state, out.worker = IDLE, None
                if not charge:
                    out.refusals += 1  # like a busy refusal: a dispatch, not an attempt
                self._retry_output(req, out, "worker_unhealthy", reason, actions)
            # else: the request already ended and CancelDenoise was sent then.
        if w.draining:
            self._forget(w)

    # The pool's books change here, so that the AR pass hears of every change to an AR worker (see _dispatch_ar).

    def _recount(self, w: Worker) -> None:
        """After a change to a worker's healthy, draining or not_serving flag (see Pool.recount)."""
        self._pool.recount(w)
        if w.role is AR:
            self._ar_dirty = True  # a worker joined, left, or may take batches now (or no longer)

    def _forget(self, w: Worker) -> None:
        """Drop a worker from membership."""
        self._pool.forget(w)
        self._capability.set(w, None, self._active.values())
        if w.role is AR:
            self._ar_dirty = True

    # ----------------------------------------------------------------------------------------- request lifecycle

    def _fail_stranded_ar_requests(self, actions: list[Action]) -> None:
        """With fail-fast on, requests still waiting for an AR batch fail once no AR worker is left to take it."""
        if not self._pending_ar or not self.config.fail_fast_without_workers or self._pool.any_ready(AR):
            return
        stranded = [req for q in self._pending_ar.values() for req in q.requests]
        for req in sorted(stranded, key=lambda r: r.seq):
            self._fail(req, ErrorKind.UNAVAILABLE, self._pool.none_ready(AR, "it went away"), actions)

    def _waiting_for(self, batch: DispatchArBatch) -> list[Request]:
        """The live requests whose current AR batch this is (an ended or re-batched one no longer counts)."""
        return [r for rid in batch.request_ids
                if (r := self._active.get(rid)) is not None and r.ar_batch == batch.batch_id]

    def _stop_abandoned_batches(self, actions: list[Action]) -> None:
        """Stop AR batches still in flight whose every request has ended: with clients timing out, the AR would
        otherwise keep computing for nobody. The slot stays held until the driver reports the call's end."""
        if not self._maybe_abandoned:  # the common case, on every event
            return
        for bid in sorted(self._maybe_abandoned):
            batch = self._batches.get(bid)
            if batch is not None and not self._waiting_for(batch):
                actions.append(CancelArBatch(bid, batch.worker, abandoned=True))
        self._maybe_abandoned.clear()

    def _fail_stranded_denoise_requests(self, actions: list[Action]) -> None:
        """With fail-fast on, requests with an output waiting for a denoiser fail once none is left to take it
        (the last one went away or is draining), rather than at their deadline minutes later."""
        if not self._denoise_q or not self.config.fail_fast_without_workers or self._pool.any_ready(DENOISER):
            return
        stranded = {self._active[k[4]] for k in self._denoise_q if k[4] in self._active}
        for req in sorted(stranded, key=lambda r: r.seq):
            self._fail(req, ErrorKind.UNAVAILABLE, self._pool.none_ready(DENOISER, "it went away"), actions)

    def _fail(self, req: Request, kind: ErrorKind, message: str, actions: list[Action], *,
              field: str | None = None) -> None:
        self._end(req, actions)
        self.counters.failed[kind] += 1
        actions.append(FailRequest(req.request_id, RequestError(kind, message, field)))

    def _end(self, req: Request, actions: list[Action]) -> None:
        """Remove an active request from every queue and cancel its in-flight denoise jobs."""
        del self._active[req.request_id]
        self._ended = True
        t = req.flow.tenant  # its share's figures (fair_queue.Tenant)
        del t.requests[req.seq]
        t.active_outputs -= req.n
        if not t.requests:
            self._shares.idle(t)
        if req.loras:
            self._placement.requests -= 1
        self._capability.end(req)
        if req.stage is PENDING_AR:
            q = self._pending_ar[req.queue_key]
            q.remove(req)
            if not q.requests:
                del self._pending_ar[req.queue_key]
            self._pending_ar_outputs -= req.n
            self._shares.ar_removed(req)
            # (A removal cannot let a batch leave: its group only gets smaller and younger. Set all the same, so
            # that the rule stays simple: every change to the AR queues sets the flag.)
            self._ar_dirty = True
        elif req.stage is DENOISING:
            queued = False
            for out in req.outputs:  # one pass: on the hot path of every completion
                if out.state is QUEUED:
                    queued = True
                elif out.state is INFLIGHT and out.worker is not None:
                    # The worker keeps the slot until the RPC ends, so it is never oversubscribed.
                    actions.append(CancelDenoise(JobId(req.request_id, out.index, out.attempt), out.worker))
            if queued:
                self._denoise_q.drop(req.flow, req.seq)
        elif req.stage is AR_INFLIGHT and req.ar_batch is not None:
            # The batch result will drop this request (it is no longer active). If nobody else waits for the
            # batch, it is stopped at the end of this event (unless this event is its result).
            self._maybe_abandoned.add(req.ar_batch)
        top = max([o.attempt for o in req.outputs])
        if top > 0:
            floor = self._attempt_floor
            floor[req.request_id] = top
            floor.move_to_end(req.request_id)
            if len(floor) > _ATTEMPT_MEMORY:
                floor.popitem(last=False)

    def _expire_deadlines(self, actions: list[Action]) -> None:
        deadlines = self._deadlines
        while deadlines.first is not None and deadlines.first[0] <= self._now:
            _, seq, rid = deadlines.pop()
            req = self._active.get(rid)
            if req is not None and req.seq == seq:
                self._fail(req, ErrorKind.DEADLINE_EXCEEDED, "deadline exceeded", actions)

    def _prune_deadlines(self) -> None:
        # Drop entries of requests that ended otherwise, so next_wakeup() can peek at a live head. Only an ending
        # makes an entry dead (a pushed one is live), so handle() calls this only after an event that ended one.
        self._ended = False
        deadlines = self._deadlines
        while deadlines.first is not None:
            _, seq, rid = deadlines.first
            req = self._active.get(rid)
            if req is not None and req.seq == seq:
                break
            deadlines.pop()

    # ------------------------------------------------------------------------------------------------- AR stage

    def _enqueue_ar(self, req: Request, front: bool) -> None:
        req.stage = PENDING_AR
        key = req.queue_key
        q = self._pending_ar.get(key)
        if q is None:  # (not setdefault: that would build a queue on every call)
            q = self._pending_ar[key] = ArQueue()
        q.push(req, front)
        self._pending_ar_outputs += req.n
        self._ar_dirty = True
        if front:  # back after a failure (Shares.admit counts an admitted one)
            self._shares.ar_added(req)

    def _take_batch(self, batch_id: int) -> DispatchArBatch | None:
        """Pop an in-flight batch and free its AR slot; None (and counted as fenced) if unknown."""
        batch = self._batches.pop(batch_id, None)
        if batch is None:
            self.counters.fenced_results += 1
            return None
        self._ar_dirty = True  # an AR slot is free
        w = self._pool.members.get(batch.worker)
        if w is not None:
            w.batches.discard(batch_id)
            if w.draining and not w.busy():
                self._forget(w)
        return batch

    def _ar_batch_failed(self, batch: DispatchArBatch, message: str, reason: str, actions: list[Action],
                         charge: bool = True) -> None:
        """Requeue the batch's live requests, each charged one AR failure (``charge``) and failed past its retries;
        uncharged, every one goes again (its AR refused the call before running it)."""
        retry: list[Request] = []
        for req in self._waiting_for(batch):
            req.ar_batch = None
            if charge:
                req.ar_failures += 1
            if req.ar_failures > self.config.ar_retries:
                self._fail(req, ErrorKind.UNAVAILABLE, message, actions)
            else:
                retry.append(req)
        # Front of the queue in their original order, keeping their age, so they leave in the next batch.
        for req in reversed(retry):
            self._enqueue_ar(req, front=True)
        self.counters.requeues[reason] += len(retry)

    def _dispatch_ar(self, actions: list[Action]) -> None:
        # Just in time: a batch is formed only when a worker can take it, so late arrivals can still join.
        #
        # This reads the AR queues, the AR workers (membership, flags, slots) and the clock. Every change to the
        # first two sets _ar_dirty; when the pass ends with nothing left to do, _ar_recheck_at says when the clock
        # alone will let a waiting group leave. handle() skips the pass until one of them says otherwise: most
        # events (denoise results) change neither, and the pass would scan the queues for nothing.
        self._ar_dirty = False
        self._ar_recheck_at = NEVER
        if self._capability.ar_restricted:  # some request cannot run on every AR server: each batch goes where it can
            self._ar_recheck_at = self._capability.dispatch_ar(self._pending_ar, self._pool, self._shares, self.config,
                                                               self._now, self._start_batch, actions)
            return
        shares = self._shares
        while self._pending_ar:  # checked first: cheaper than looking for a group or a free worker
            # The group first: usually none may leave yet (a batch is filling up), and then no worker is looked at.
            key, wait_until = shares.ar_group(self._pending_ar, self.config, self._now)
            if key is None:
                self._ar_recheck_at = wait_until
                return
            w = self._pool.free_ar_server()
            if w is None:
                return  # until a slot frees up or a worker becomes ready (both set _ar_dirty)
            taken = shares.ar_batch(self._pending_ar[key].requests, self.config.ar_batch_max_outputs)
            self._start_batch(w, key, taken, actions)

    def _start_batch(self, w: Worker, key: tuple[int, int, int], taken: list[Request], actions: list[Action]) -> None:
        """Send ``taken``, requests of the AR queue ``key`` in batch order, to AR server ``w`` as one batch."""
        q = self._pending_ar[key]
        ids = {id(r) for r in taken}
        rest = deque(r for r in q.requests if id(r) not in ids)
        if rest:
            q.keep_only(rest)
        else:
            del self._pending_ar[key]
        batch = DispatchArBatch(next(self._batch_ids), w.address, key[0], key[1], tuple(r.request_id for r in taken))
        for r in taken:
            r.stage = AR_INFLIGHT
            r.ar_batch = batch.batch_id
            self._pending_ar_outputs -= r.n
        self._shares.ar_taken(taken)
        self._batches[batch.batch_id] = batch
        w.batches.add(batch.batch_id)
        self._pool.used(w)
        actions.append(batch)

    # -------------------------------------------------------------------------------------------- denoise stage

    def _enqueue_output(self, req: Request, out: Output, front: bool) -> None:
        out.state = QUEUED
        out.passed_at = None
        self._denoise_q.push((req.priority, _FRONT if front else _FRESH, req.seq, out.index, req.request_id), req.flow)
        if not req.listed:
            self._shares.relist(req)

    def _live_output(self, job: JobId, worker: str) -> tuple[Request, Output] | None:
        """The output ``job`` is the current, in-flight attempt of, on ``worker``; else None (stale)."""
        req = self._active.get(job.request_id)
        if req is None or req.stage is not DENOISING or not 0 <= job.index < req.n:
            return None
        out = req.outputs[job.index]
        if out.state is not INFLIGHT or out.attempt != job.attempt or out.worker != worker:
            return None
        return req, out

    def _take_job(self, job: JobId, worker: str) -> tuple[Request, Output] | None:
        """Handle the end of a denoise RPC: free the worker only if it holds exactly ``job``.

        Returns the live output the result belongs to, or None if the result is fenced."""
        pool = self._pool
        w = pool.members.get(worker)
        # (``is`` first: the driver usually hands back the very JobId it was given; equal values also match.)
        if w is None or w.role is not DENOISER or (w.job is not job and w.job != job):
            # Superseded (worker went unhealthy and maybe took another job), unknown, or duplicated.
            self.counters.fenced_results += 1
            return None
        found = self._live_output(job, worker)
        w.job = None
        if w.draining:
            self._forget(w)
        else:
            pool.offer(w)
        if found is None:
            # The request ended while this RPC ran (cancel/deadline/failure); the slot is freed above.
            self.counters.fenced_results += 1
        return found

    def _retry_output(
        self, req: Request, out: Output, reason: str, message: str, actions: list[Action]
    ) -> None:
        used = out.attempt - req.attempt_base - out.refusals
        if used >= self.config.max_attempts:
            self._fail(
                req, ErrorKind.UNAVAILABLE, f"denoise failed after {used} attempt(s): {message}", actions
            )
            return
        self.counters.requeues[reason] += 1
        self._enqueue_output(req, out, front=True)

    def _dispatch_denoise(self, actions: list[Action]) -> None:
        # One output per free denoiser, so a request's n outputs fan out to n workers at once, in the fair order
        # of the queue. (LoRA placement while a request names adapters, or a denoiser holds some, which plain jobs
        # then keep off; and while some request cannot run on every denoiser, capability placement, affinity or not.)
        restricted = self._capability.restricted
        if restricted or (self._placement.requests or self._pool.holders) and self.config.lora_affinity:
            self._placement.dispatch(self._denoise_q, self._pool, self._now, self._active, self._start_job,
                                     self._live_output, actions, self._capability.can_run if restricted else None,
                                     self.config.lora_affinity)
            return
        queue, pool = self._denoise_q, self._pool
        while queue.first is not None and pool.idle:  # (no entry left in the idle heap: none is free)
            w = pool.take_free_denoiser()
            if w is None:
                return
            self._start_job(w, queue.pop(), actions)

    def _start_job(self, w: Worker, key: QueueKey, actions: list[Action]) -> None:
        _, _, _, index, rid = key
        req = self._active[rid]
        out = req.outputs[index]
        attempt = out.attempt = out.attempt + 1
        out.state = INFLIGHT
        out.started_at = self._now
        address = out.worker = w.address
        job = w.job = JobId(rid, index, attempt)
        if req.loras and not req.loras <= w.loras:
            self._pool.set_loras(w, w.loras | req.loras)  # loaded by the time the job ends
        self.counters.denoise_dispatches += 1
        actions.append(DispatchDenoise(job, address, req.ar_outputs[index]))
