"""The checking half of the scheduler state machine (tests/test_scheduler_machine.py): it feeds the pure scheduler
core events, keeps the reference model (tests/support/scheduler_model.py) in step with the actions it returns,
checks the invariants after every step, and drains the cluster at the end. The rules that choose the events are the
test's."""
from __future__ import annotations

from hypothesis.stateful import (
    RuleBasedStateMachine,
)

from gateway.scheduler.core import Scheduler
from gateway.scheduler.types import (
    BATCH,
    Action,
    ArBatchFailed,
    ArBatchSucceeded,
    CancelArBatch,
    CancelDenoise,
    CompleteRequest,
    DenoiseFailed,
    DenoiseRefusedBusy,
    DenoiserOccupancy,
    DenoiseSucceeded,
    DispatchArBatch,
    DispatchDenoise,
    Event,
    FailRequest,
    JobId,
    RequestArrived,
    RequestCancelled,
    SchedulerConfig,
    Tick,
    WorkerAdded,
    WorkerCapabilities,
    WorkerDown,
    WorkerHealthy,
    WorkerNotServing,
    WorkerRemoved,
    WorkerRole,
    WorkerState,
    WorkerUnhealthy,
)
from runtime.errors import ErrorKind
from tests.support.scheduler_model import (
    AR,
    CAPABILITIES,
    DN,
    _ar_out,
    _Member,
    _Req,
    _result,
    _World,
    can_run,
)


class CheckedScheduler(RuleBasedStateMachine):
    """A scheduler and its reference world; `send` is the only way an event reaches the scheduler."""

    def __init__(self) -> None:
        super().__init__()
        self.s: Scheduler | None = None
        self.cfg = SchedulerConfig()
        self.now = 0.0
        self.w = _World()
        self.next_rid = 0
        self.last_fenced = 0
        self.broken = False
        self.seq = 0  # the occupancy sequences the other gateways' denoisers report

    # ----------------------------------------------------------------------------------------------- driving

    def send(self, ev: Event) -> list[Action]:
        try:
            return self._send(ev)
        except BaseException:
            self.broken = True  # skip the drain in teardown: report the first failure, shrink fast
            raise

    def _live(self, rid: str) -> _Req | None:
        r = self.w.reqs.get(rid)
        return r if r is not None and rid not in self.w.ended else None

    def _ar_batch_lost(self, bid: int) -> None:
        """A batch holding an AR slot failed (error or its worker went down): charge its live requests."""
        for rid in self.w.batch_rids[bid]:
            r = self._live(rid)
            if r is not None and r.batch == bid:
                r.ar_failures += 1

    def _send(self, ev: Event) -> list[Action]:
        assert self.s is not None
        before = self.s.snapshot()
        w = self.w
        # Model side of membership events, applied before reading the actions (they refer to the new state).
        expect_ar_cancels: set[int] = set()
        expect_invalid: tuple[str, ErrorKind] | None = None  # a lone request whose batch was refused as its fault
        if isinstance(ev, WorkerAdded):
            m = w.members.get(ev.worker)
            if m is None:
                w.members[ev.worker] = _Member(ev.role)
                w.ar_owned.setdefault(ev.worker, set())
            elif m.role is ev.role:
                m.draining = False
        elif isinstance(ev, WorkerRemoved) and ev.worker in w.members:
            if ev.worker in w.holding or w.ar_owned.get(ev.worker):
                w.members[ev.worker].draining = True
            else:
                self._forget(ev.worker)
        elif isinstance(ev, WorkerHealthy) and ev.worker in w.members:
            w.members[ev.worker].healthy = True
            w.members[ev.worker].serving = True
        elif isinstance(ev, WorkerNotServing) and ev.worker in w.members and w.members[ev.worker].healthy:
            w.members[ev.worker].serving = False  # and nothing it holds is cancelled (checked below)
        elif isinstance(ev, WorkerUnhealthy) and ev.worker in w.members and w.members[ev.worker].healthy:
            w.members[ev.worker].healthy = False
            w.members[ev.worker].serving = True
            w.elsewhere[ev.worker] = False  # its occupancy stream broke with it
            held = w.holding.pop(ev.worker, None)  # the slot is free; the old attempt is fenced
            expect_ar_cancels = set(w.ar_owned.get(ev.worker, set()))
            if ev.why is WorkerDown.CREDENTIAL_REFUSED:
                # It refused the credential, before running anything: what it held costs no attempt, no AR retry.
                if held is not None and self._live(held.request_id) is not None:
                    key = (held.request_id, held.index)
                    w.refusals[key] = w.refusals.get(key, 0) + 1
            else:
                for bid in expect_ar_cancels:
                    self._ar_batch_lost(bid)
            w.ar_owned[ev.worker] = set()
            if w.members[ev.worker].draining:
                self._forget(ev.worker)
        elif isinstance(ev, WorkerCapabilities):
            if ev.worker in w.members and ev.capabilities is not None:
                w.caps[ev.worker] = ev.capabilities  # type: ignore[assignment]
            elif ev.worker in w.members:
                w.caps.pop(ev.worker, None)
        elif isinstance(ev, DenoiserOccupancy):
            if ev.worker in w.members and w.members[ev.worker].role is DN and (
                    ev.sequence is None or ev.sequence > w.occupancy_seq.get(ev.worker, -1)):
                w.elsewhere[ev.worker] = ev.elsewhere
                if ev.sequence is not None:
                    w.occupancy_seq[ev.worker] = ev.sequence
        elif isinstance(ev, DenoiseRefusedBusy):
            if w.holding.get(ev.worker) == ev.job:  # it never ran: the slot is free, the output goes elsewhere
                del w.holding[ev.worker]
                if ev.sequence is None or ev.sequence >= w.occupancy_seq.get(ev.worker, -1):
                    w.elsewhere[ev.worker] = True
                    if ev.sequence is not None:
                        w.occupancy_seq[ev.worker] = ev.sequence
                self._maybe_gone(ev.worker)
                if self._live(ev.job.request_id) is not None:
                    key = (ev.job.request_id, ev.job.index)
                    w.refusals[key] = w.refusals.get(key, 0) + 1
        elif isinstance(ev, (DenoiseSucceeded, DenoiseFailed)):
            if w.holding.get(ev.worker) == ev.job:  # a result frees only the slot held by exactly that job
                del w.holding[ev.worker]
                self._maybe_gone(ev.worker)
                rid, i = ev.job.request_id, ev.job.index
                r = self._live(rid)
                if (
                    isinstance(ev, DenoiseSucceeded)
                    and r is not None
                    and w.attempts[(rid, i)][0] == ev.job.attempt
                ):
                    r.done.add(i)
        elif isinstance(ev, (ArBatchSucceeded, ArBatchFailed)):
            for name, owned in w.ar_owned.items():
                if ev.batch_id in owned:  # a live batch (else fenced)
                    owned.discard(ev.batch_id)
                    self._maybe_gone(name)
                    if isinstance(ev, ArBatchFailed) and ev.kind in (ErrorKind.INVALID_ARGUMENT, ErrorKind.INTERNAL):
                        live = [rid for rid in w.batch_rids[ev.batch_id]
                                if (r := self._live(rid)) is not None and r.batch == ev.batch_id]
                        if len(live) == 1:
                            expect_invalid = (live[0], ev.kind)
                        for rid in live if len(live) > 1 else ():
                            w.reqs[rid].solo = True  # split, with no retry charged
                    elif isinstance(ev, ArBatchFailed):
                        self._ar_batch_lost(ev.batch_id)
                    else:
                        for rid in w.batch_rids[ev.batch_id]:
                            r = self._live(rid)
                            if (
                                r is not None
                                and r.batch == ev.batch_id
                                and len(ev.outputs.get(rid, ())) == r.n
                            ):
                                r.denoising = True
                    break

        actions = self.s.handle(ev)
        self.now = max(self.now, ev.now)
        if isinstance(ev, RequestArrived) and not any(
            isinstance(a, FailRequest)
            and a.request_id == ev.request_id
            and a.error.kind in (ErrorKind.INVALID_ARGUMENT, ErrorKind.RESOURCE_EXHAUSTED)
            for a in actions
        ):
            w.reqs[ev.request_id] = _Req(ev.n, (ev.height, ev.width), ev.deadline, priority=ev.priority,
                                         tenant=ev.tenant, needs=ev.needs, arrived=self.now)  # type: ignore[arg-type]
        assert {a.batch_id for a in actions if isinstance(a, CancelArBatch) and not a.abandoned} == expect_ar_cancels
        if expect_invalid is not None:  # failed at once, not retried (or its deadline passed first)
            assert any(isinstance(a, FailRequest) and a.request_id == expect_invalid[0]
                       and a.error.kind in (expect_invalid[1], ErrorKind.DEADLINE_EXCEEDED)
                       for a in actions), "bad input not relayed"
        for a in actions:
            self._apply(ev, a, before)
        self._check_batch_class(actions)
        self._check_abandoned_batches({a.batch_id for a in actions if isinstance(a, CancelArBatch) and a.abandoned})
        # A request that fails cancels every job of it that still occupies a denoiser ("timeouts cancel work").
        cancels = {(a.job, a.worker) for a in actions if isinstance(a, CancelDenoise)}
        for a in actions:
            if isinstance(a, FailRequest) and a.request_id in w.reqs and w.ended.get(a.request_id) is a:
                for i in range(w.reqs[a.request_id].n):
                    if (a.request_id, i) in w.attempts:
                        attempt, wk = w.attempts[(a.request_id, i)]
                        j = JobId(a.request_id, i, attempt)
                        if w.holding.get(wk) == j:
                            assert (j, wk) in cancels, f"{j} left running on {wk}"
        self._check()
        return actions

    def _check_batch_class(self, actions: list[Action]) -> None:
        """BATCH work runs only on capacity nothing else waits for: a BATCH job left for a denoiser in this event only
        if no job of another class is queued for one after it (one that waits for a holder of its adapters too: the
        BATCH job would take the denoiser it may load on); an AR batch of BATCH requests alone only if no request of
        another class waits for the AR (one holding another's request may carry BATCH ones in its spare room)."""
        s, w = self.s, self.w
        assert s is not None
        if any(isinstance(a, DispatchDenoise) and w.reqs[a.job.request_id].priority == BATCH for a in actions):
            assert all(k[0] == BATCH for k in s._denoise_q), "a BATCH job went before queued work of another class"
        for a in actions:
            if isinstance(a, DispatchArBatch) and all(w.reqs[r].priority == BATCH for r in a.request_ids):
                assert not any(r.priority != BATCH and can_run(r.needs, w.caps.get(a.worker))
                               for r in self._waiting_for_ar()), "a BATCH-only AR batch went first"

    def _check_abandoned_batches(self, cancelled: set[int]) -> None:
        """A batch is stopped exactly when its last waiting request ends, and keeps its AR slot until it returns."""
        w = self.w

        def waited_for(bid: int) -> bool:
            return any((r := self._live(rid)) is not None and r.batch == bid for rid in w.batch_rids[bid])

        for bid in cancelled:
            assert any(bid in owned for owned in w.ar_owned.values()), "a stopped batch must keep its slot"
            assert bid not in w.abandoned and not waited_for(bid), "stopped twice, or while still waited for"
            w.abandoned.add(bid)
        for owned in w.ar_owned.values():
            for bid in owned:
                assert waited_for(bid) or bid in w.abandoned, f"batch {bid} keeps running for nobody"

    def _waiting_for_ar(self) -> list[_Req]:
        """The live requests waiting for an AR batch (none of theirs in flight), as the model derives them."""
        w = self.w
        held = set().union(*w.ar_owned.values()) if w.ar_owned else set()
        return [r for rid, r in w.reqs.items()
                if rid not in w.ended and not r.denoising and (r.batch is None or r.batch not in held)]

    def _forget(self, name: str) -> None:
        self.w.members.pop(name, None)
        self.w.ar_owned.pop(name, None)
        self.w.elsewhere.pop(name, None)  # a member added again under this name starts afresh
        self.w.occupancy_seq.pop(name, None)
        self.w.caps.pop(name, None)

    def _maybe_gone(self, name: str) -> None:
        m = self.w.members.get(name)
        if m is not None and m.draining and name not in self.w.holding and not self.w.ar_owned.get(name):
            self._forget(name)

    def _apply(self, ev: Event, a: Action, before: object) -> None:
        w, cfg = self.w, self.cfg
        if isinstance(a, DispatchArBatch):
            m = w.members.get(a.worker)
            assert m is not None and m.role is AR and m.healthy and not m.draining and m.serving
            assert len(w.ar_owned[a.worker]) < cfg.ar_max_inflight_batches
            w.ar_owned[a.worker].add(a.batch_id)
            assert a.batch_id not in w.ar_rpcs and a.batch_id not in w.delivered_batches
            w.ar_rpcs[a.batch_id] = a
            w.batch_rids[a.batch_id] = a.request_ids
            slots = 0
            for rid in a.request_ids:
                r = w.reqs[rid]
                assert rid not in w.ended
                assert r.size == (a.height, a.width)
                r.batch = a.batch_id
                slots += r.n
            assert len(a.request_ids) >= 1
            # Capability placement: a batch goes only to an AR server that can run every request in it.
            assert all(can_run(w.reqs[rid].needs, w.caps.get(a.worker)) for rid in a.request_ids), \
                f"batch {a.batch_id} on {a.worker}, which cannot run all of {a.request_ids}"
            assert len(a.request_ids) == 1 or not any(w.reqs[rid].solo for rid in a.request_ids)
            assert slots <= cfg.ar_batch_max_outputs or len(a.request_ids) == 1
        elif isinstance(a, DispatchDenoise):
            m = w.members.get(a.worker)
            assert m is not None and m.role is DN and m.healthy and not m.draining and m.serving
            assert a.worker not in w.holding, f"{a.worker} would hold two jobs"
            assert not w.elsewhere.get(a.worker), f"{a.worker} is held by another gateway's job"
            rid, i = a.job.request_id, a.job.index
            assert rid not in w.ended and 0 <= i < w.reqs[rid].n
            # Capability placement: a job only ever goes to a denoiser that can run it.
            assert can_run(w.reqs[rid].needs, w.caps.get(a.worker)), f"{rid}/{i} on {a.worker}, which cannot run it"
            prev = w.attempts.get((rid, i), (0, ""))[0]
            # Busy refusals are not attempts: only real tries count against max_attempts.
            assert a.job.attempt == prev + 1
            assert a.job.attempt - w.refusals.get((rid, i), 0) <= cfg.max_attempts
            assert a.ar_output == _ar_out(rid, i, w.reqs[rid].batch)
            w.holding[a.worker] = a.job
            w.attempts[(rid, i)] = (a.job.attempt, a.worker)
            w.dn_rpcs[a.job] = a.worker
        elif isinstance(a, CancelDenoise):
            assert w.attempts.get((a.job.request_id, a.job.index)) == (a.job.attempt, a.worker)
            # Outstanding, or the very job whose end is being delivered (a result or a busy refusal: its deadline
            # fired first, and cancelling a call that has ended is a no-op for the driver).
            assert a.job in w.dn_rpcs or (
                isinstance(ev, (DenoiseSucceeded, DenoiseFailed, DenoiseRefusedBusy)) and ev.job == a.job
            )
        elif isinstance(a, CancelArBatch):
            assert a.batch_id in w.ar_rpcs
        elif isinstance(a, CompleteRequest):
            r = w.reqs[a.request_id]
            assert a.request_id not in w.ended, "ended twice"
            w.ended[a.request_id] = a
            assert len(a.results) == r.n and len(a.ar_outputs) == r.n
            for i, res in enumerate(a.results):
                attempt, worker_name = w.attempts[(a.request_id, i)]
                assert res == _result(JobId(a.request_id, i, attempt), worker_name), "not the current attempt"
                assert a.ar_outputs[i] == _ar_out(a.request_id, i, r.batch)
        elif isinstance(a, FailRequest):
            if (
                isinstance(ev, RequestArrived)
                and a.request_id == ev.request_id
                and a.error.kind
                in (
                    ErrorKind.INVALID_ARGUMENT,
                    ErrorKind.RESOURCE_EXHAUSTED,
                )
            ):
                assert a.request_id not in w.reqs
                if a.error.kind is ErrorKind.RESOURCE_EXHAUSTED:
                    queued = before.pending_ar_outputs + before.pending_denoise_outputs  # type: ignore[attr-defined]
                    assert queued + ev.n > cfg.max_queued_outputs
                    # ... and the tenant is past its weighted share of the bound (or the total past twice the bound)
                    backlog = {t.name: t for t in before.tenants  # type: ignore[attr-defined]
                               if t.pending_ar_outputs + t.pending_denoise_outputs}
                    mine = backlog.get(ev.tenant)
                    held = 0 if mine is None else mine.pending_ar_outputs + mine.pending_denoise_outputs
                    weights = ev.weight + sum(t.weight for name, t in backlog.items() if name != ev.tenant)
                    assert (queued + ev.n > 2 * cfg.max_queued_outputs
                            or held + ev.n > cfg.max_queued_outputs * ev.weight / weights), "refused within its share"
                else:
                    assert ev.n < 1 or ev.n > cfg.max_queued_outputs
                return
            assert a.request_id in w.reqs and a.request_id not in w.ended, "ended twice or never admitted"
            w.ended[a.request_id] = a
            r = w.reqs[a.request_id]
            if a.error.kind is ErrorKind.DEADLINE_EXCEEDED:
                assert r.deadline is not None and self.now >= r.deadline
            if a.error.kind is ErrorKind.CANCELLED:
                assert isinstance(ev, RequestCancelled) and ev.request_id == a.request_id
            # Out of tries only when they are really used up: busy and credential refusals are not tries.
            if a.error.message.startswith("AR stage failed"):
                assert r.ar_failures > cfg.ar_retries, f"{a.request_id} failed before its AR retries were used"
            if a.error.message.startswith("denoise failed after"):
                used = int(a.error.message.split()[3])
                assert used >= cfg.max_attempts and any(
                    att - w.refusals.get((a.request_id, i), 0) == used
                    for (rid, i), (att, _) in w.attempts.items() if rid == a.request_id), a.error.message

    def _check(self) -> None:
        s, w = self.s, self.w
        assert s is not None
        snap = s.snapshot()
        # The counts the metrics publish, kept as workers change, agree with the snapshot's entries; so do the queues.
        gauges = s.gauges()
        assert gauges.workers == {(role, state): sum(1 for x in snap.workers if (x.role, x.state) == (role, state))
                                  for role in WorkerRole for state in WorkerState}
        assert gauges.denoisers_held_elsewhere == sum(1 for x in snap.workers if x.held_elsewhere)
        assert (gauges.pending_ar_requests, gauges.pending_ar_outputs, gauges.pending_denoise_outputs,
                gauges.pending_denoise_requests, gauges.active_requests) == (
            snap.pending_ar_requests, snap.pending_ar_outputs, snap.pending_denoise_outputs,
            snap.pending_denoise_requests, snap.active_requests)
        # Each tenant's figures, kept as they change, add up to the totals and agree with the model.
        assert gauges.tenants == snap.tenants
        for figure in ("pending_ar_requests", "pending_ar_outputs", "pending_denoise_outputs", "active_requests"):
            assert sum(getattr(t, figure) for t in gauges.tenants) == getattr(snap, figure), figure
        live = {rid: r for rid, r in w.reqs.items() if rid not in w.ended}
        mine = {name: [r for r in live.values() if r.tenant == name] for name in {r.tenant for r in live.values()}}
        assert {t.name: (t.active_requests, t.active_outputs) for t in gauges.tenants} == {
            name: (len(rs), sum(r.n for r in rs)) for name, rs in mine.items()}
        assert all(s.tenant_of(rid) == r.tenant for rid, r in live.items())
        # Membership and slots exactly as the model derives them from events and actions: a fenced result
        # never freed another job's slot, and no denoiser holds two jobs.
        assert {x.address for x in snap.workers} == set(w.members)
        for x in snap.workers:
            m = w.members[x.address]
            assert x.role is m.role
            if x.role is DN:
                assert x.held_elsewhere == w.elsewhere.get(x.address, False)
                assert x.current_job == w.holding.get(x.address)
                assert x.inflight == (x.address in w.holding)
            else:
                assert x.inflight == len(w.ar_owned[x.address]) <= self.cfg.ar_max_inflight_batches
            if m.draining:
                assert x.state is WorkerState.DRAINING
            elif not m.healthy:
                assert x.state is WorkerState.UNHEALTHY
            elif not m.serving:
                assert x.state is WorkerState.DRAINING
            else:
                assert x.state in (WorkerState.AVAILABLE, WorkerState.BUSY)
        # Work conservation: a job waits while a denoiser that can run it is free (a job no free one can run waits
        # for one that can: capability placement) only if it names adapters that no such free denoiser holds, and for
        # less than one load's time since it was queued (LoRA placement waits for a busy holder that long at most);
        # so neither a plain job nor one of a less popular adapter waits behind others' loads. (The queue is read
        # from the scheduler itself: the model does not follow adapters.)
        idle = [x for x in snap.workers if x.role is DN and x.state is WorkerState.AVAILABLE]
        if snap.pending_denoise_outputs and idle:
            other_class = any(k[0] != BATCH for k in s._denoise_q)  # (BATCH work waits for it: _check_batch_class)
            for cls, _, _, index, rid in s._denoise_q:
                req = s._active[rid]
                if cls == BATCH and other_class:
                    continue
                free = [x for x in idle if can_run(w.reqs[rid].needs, w.caps.get(x.address))]
                if not free:
                    continue
                assert self.cfg.lora_affinity, f"{rid}/{index} queued while a denoiser that can run it is free"
                assert req.loras, f"plain job {rid}/{index} queued while a denoiser is free"
                assert not any(req.loras <= x.loras for x in free), f"{rid}/{index} passed over a free holder"
                passed_at = req.outputs[index].passed_at
                assert passed_at is not None and self.now < passed_at + s._placement.load_cost, \
                    f"{rid}/{index} waited too long"
        # Work conservation among the AR servers that can run a request: none of them is free while it waits past
        # its batch delay (a BATCH one waits while one of another class that server can run does; a request no free
        # server can run waits for one that can); and when one would be free for it once a delay ends, the
        # scheduler asks to be woken.
        free_ar = [x.address for x in snap.workers if x.role is AR and x.state is WorkerState.AVAILABLE]
        if free_ar and snap.pending_ar_requests:
            waiting = self._waiting_for_ar()
            for name in free_ar:
                mine = [r for r in waiting if can_run(r.needs, w.caps.get(name))]
                other_class = any(r.priority != BATCH for r in mine)
                for r in mine:
                    assert r.priority == BATCH and other_class or self.now < r.arrived + self.cfg.ar_batch_delay, \
                        f"{name} is free while a request it can run waited past its batch delay"
                assert not mine or s.next_wakeup() is not None, f"{name} can run a waiting request; no wakeup"
        wake = s.next_wakeup()
        assert wake is None or wake > self.now, "a Tick now would change something: the driver would spin"
        # Conservation: every output of a live request is exactly one of queued / in flight / done, as
        # derived from the events and actions alone (nothing lost, nothing duplicated).
        held_batches = set().union(*w.ar_owned.values()) if w.ar_owned else set()
        held_jobs = set(w.holding.values())
        exp_ar_reqs = exp_ar_outs = exp_dn = 0
        for rid, r in w.reqs.items():
            if rid in w.ended:
                continue
            assert r.ar_failures <= self.cfg.ar_retries, f"{rid} exceeded the AR retry budget"
            if r.denoising:
                waiting = 0
                running = 0
                for i in range(r.n):
                    att = w.attempts.get((rid, i))
                    if att and JobId(rid, i, att[0]) in held_jobs:
                        running += 1
                    elif i not in r.done:
                        waiting += 1
                if self.cfg.serial_outputs:
                    # One output at a time: the next waits in the queue only while none of its siblings runs.
                    assert running <= 1
                    exp_dn += 0 if running else min(waiting, 1)
                else:
                    exp_dn += waiting
            elif r.batch is None or r.batch not in held_batches:
                exp_ar_reqs += 1
                exp_ar_outs += r.n
        assert (snap.pending_ar_requests, snap.pending_ar_outputs, snap.pending_denoise_outputs) == (
            exp_ar_reqs,
            exp_ar_outs,
            exp_dn,
        )
        # Deadlines are enforced on every event.
        for rid, r in w.reqs.items():
            if rid not in w.ended and r.deadline is not None:
                assert r.deadline > self.now
        # Bookkeeping.
        active = [rid for rid in w.reqs if rid not in w.ended]
        assert snap.active_requests == len(active)
        c = s.counters
        assert c.admitted == len(w.reqs)
        assert c.admitted == c.completed + sum(c.failed.values()) + snap.active_requests
        assert c.fenced_results >= self.last_fenced
        self.last_fenced = c.fenced_results

    def advance(self, dt: float) -> float:
        self.now += dt
        return self.now

    def _deliver_ar(self, bid: int, outcome: str, now: float) -> list[Action]:
        batch = self.w.ar_rpcs.pop(bid)
        self.w.delivered_batches.append(bid)
        if outcome == "fail":
            return self.send(ArBatchFailed(now, bid, "ar boom"))
        if outcome == "invalid":
            return self.send(ArBatchFailed(now, bid, "bad input", ErrorKind.INVALID_ARGUMENT))
        if outcome == "internal":  # the gateway itself failed handling the batch (an unexpected exception)
            return self.send(ArBatchFailed(now, bid, "internal error", ErrorKind.INTERNAL))
        outs = {
            rid: [_ar_out(rid, i, bid) for i in range(self.w.reqs[rid].n - (outcome == "short"))]
            for rid in batch.request_ids
        }
        return self.send(ArBatchSucceeded(now, bid, outs))

    def _deliver_dn(self, j: JobId, outcome: str, now: float) -> list[Action]:
        wname = self.w.dn_rpcs.pop(j)
        self.w.delivered.append((j, wname))
        if outcome == "ok":
            # Some jobs say they loaded adapters, so the learned load cost moves.
            load = 0.002 * (j.attempt % 3)
            return self.send(DenoiseSucceeded(now, j, wname, _result(j, wname), lora_load_s=load))
        return self.send(DenoiseFailed(now, j, wname, "dn boom", outcome == "retry"))

    # ------------------------------------------------------------------------------------------------ drain

    def teardown(self) -> None:
        """Heal the cluster, let all outstanding work succeed: every admitted request must end."""
        if self.s is None or self.broken:
            return
        for role, name in ((AR, "ar-final"), (DN, "d-final")):
            if not any(m.role is role and not m.draining for m in self.w.members.values()):
                self.send(WorkerAdded(self.now, name, role))
        for name, m in list(self.w.members.items()):
            if not m.healthy or not m.serving:
                self.send(WorkerHealthy(self.now, name))
            self.send(WorkerCapabilities(self.now, name, CAPABILITIES))  # each can run anything: what waits runs
            if m.role is DN:  # the other gateways' jobs end
                self.seq += 1
                self.send(DenoiserOccupancy(self.now, name, False, self.seq))
        for _ in range(10_000):
            if self.w.dn_rpcs:
                self._deliver_dn(min(self.w.dn_rpcs), "ok", self.now)
            elif self.w.ar_rpcs:
                self._deliver_ar(min(self.w.ar_rpcs), "ok", self.now)
            elif (wake := self.s.next_wakeup()) is not None:
                self.send(Tick(wake))
            else:
                break
        assert self.s.snapshot().active_requests == 0, "work got stuck with a healthy cluster"
        assert set(self.w.ended) == set(self.w.reqs), "an admitted request never ended"
        assert self.send(Tick(self.now + 1000.0)) == []
        snap = self.s.snapshot()
        assert (snap.pending_ar_requests, snap.pending_ar_outputs, snap.pending_denoise_outputs) == (0, 0, 0)
        assert all(x.inflight == 0 for x in snap.workers)
