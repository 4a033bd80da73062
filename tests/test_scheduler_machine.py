"""Property-based test of the pure scheduler core (gateway/scheduler/core.py).

A hypothesis state machine drives the scheduler with random event sequences through a small simulated cluster
(the reference model in tests/support/scheduler_model.py). The rules here choose the events; the checker they extend
(tests/support/scheduler_checker.py) keeps the model in step and checks the invariants after every step.
No I/O, no sleeps: time is a float carried by the events.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    initialize,
    precondition,
    rule,
    run_state_machine_as_test,
)

from gateway.scheduler.core import Scheduler
from gateway.scheduler.types import (
    ArBatchSucceeded,
    DenoiseFailed,
    DenoiseRefusedBusy,
    DenoiserOccupancy,
    DenoiseSucceeded,
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
    WorkerState,
    WorkerUnhealthy,
)
from tests.support.scheduler_checker import CheckedScheduler
from tests.support.scheduler_model import (
    OTHER,
    SIZE,
    WORKERS,
    _role,
    fits,
)

configs = st.builds(
    SchedulerConfig,
    max_queued_outputs=st.integers(3, 16),
    ar_batch_max_outputs=st.integers(1, 4),
    ar_batch_delay=st.sampled_from([0.0, 0.002, 0.01]),
    ar_max_inflight_batches=st.integers(1, 2),
    ar_retries=st.sampled_from([1, 0]),
    max_attempts=st.sampled_from([2, 3, 1]),
    serial_outputs=st.sampled_from([False, True]),
    lora_affinity=st.sampled_from([True, True, False]),
    lora_load_cost=st.sampled_from([0.004, 0.0, 0.03]),
)
# Whose a request is, with what weight, and its class: mostly one tenant's default traffic, as in production.
tenants = st.sampled_from(["default", "default", "t1", "t2"])
weights = st.sampled_from([1.0, 1.0, 2.0, 0.5])
classes = st.sampled_from([1, 1, 0, 2])
# The adapters a request names: mostly none, as in production, so that plain and adapter jobs share the queue.
adapter_sets = st.sampled_from([frozenset(), frozenset(), frozenset({"a"}), frozenset({"b"}), frozenset({"a", "b"})])
# What a worker can do and a request needs (tests/support/scheduler_model.fits): mostly a uniform pool and requests
# that need nothing special, as in production; a mixed pool and requests only some members can run, as in a rolling
# upgrade. None: not said (a worker whose limits are not read yet, a request from before capabilities).
capability_sets = st.sampled_from([None, frozenset({"big", "cache"}), frozenset({"big", "cache"}), frozenset(),
                                   frozenset({"big"}), frozenset({"cache"})])
need_sets = st.sampled_from([None, frozenset(), frozenset(), frozenset({"big"}), frozenset({"cache"}),
                             frozenset({"big", "cache"})])


class SchedulerMachine(CheckedScheduler):
    @initialize(cfg=configs, cluster=st.sets(st.sampled_from(WORKERS)), seed=st.sampled_from([None, "gw-a", "gw-b"]),
                kinds=st.lists(capability_sets, min_size=len(WORKERS), max_size=len(WORKERS)))
    def setup(self, cfg: SchedulerConfig, cluster: set[str], seed: str | None,
              kinds: list[frozenset[str] | None]) -> None:
        self.cfg = cfg
        self.s = Scheduler(cfg, pick_seed=seed, fits=fits)  # any pick order keeps every invariant
        for name in sorted(cluster):  # start with some healthy workers so work flows early
            self.send(WorkerAdded(self.now, name, _role(name)))
            self.send(WorkerCapabilities(self.now, name, kinds[WORKERS.index(name)]))  # read before it is healthy
            self.send(WorkerHealthy(self.now, name))

    @rule(
        n=st.sampled_from([1, 1, 1, 2, 2, 3, 4, 0, 6]),
        other=st.booleans(),
        ttl=st.none() | st.floats(0.0, 0.05),
        dt=st.floats(0.0, 0.003),
        loras=adapter_sets,
        tenant=tenants,
        weight=weights,
        priority=classes,
        needs=need_sets,
    )
    def arrive(self, n: int, other: bool, ttl: float | None, dt: float, loras: frozenset[str], tenant: str,
               weight: float, priority: int, needs: frozenset[str] | None) -> None:
        now = self.advance(dt)
        rid = f"r{self.next_rid}"
        self.next_rid += 1
        size = OTHER if other else SIZE
        deadline = None if ttl is None else now + ttl
        self.send(RequestArrived(now, rid, n, size[0], size[1], deadline, loras=loras, tenant=tenant, weight=weight,
                                 priority=priority, needs=needs))

    @rule(ns=st.lists(st.tuples(st.sampled_from([1, 1, 2]), adapter_sets, tenants, classes, need_sets), min_size=2,
                      max_size=5),
          dt=st.floats(0.0, 0.003))
    def burst(self, ns: list[tuple[int, frozenset[str], str, int, frozenset[str] | None]], dt: float) -> None:
        """Several requests at one instant: the shared AR batches that single arrivals rarely form."""
        now = self.advance(dt)
        for n, loras, tenant, priority, needs in ns:
            rid = f"r{self.next_rid}"
            self.next_rid += 1
            self.send(RequestArrived(now, rid, n, SIZE[0], SIZE[1], None, loras=loras, tenant=tenant,
                                     priority=priority, needs=needs))

    @rule(name=st.sampled_from(WORKERS), caps=capability_sets, dt=st.floats(0.0, 0.003))
    def capabilities(self, name: str, caps: frozenset[str] | None, dt: float) -> None:
        """A worker says what it can run (it was restarted with other flags, or its adapter directory changed):
        jobs that need what it lost go elsewhere from now on, and those waiting for what it gained may go to it."""
        self.send(WorkerCapabilities(self.advance(dt), name, caps))

    @rule(
        data=st.data(),
        kind=st.sampled_from(["add", "remove", "healthy", "unhealthy", "unhealthy", "not_serving"]),
        name=st.sampled_from(WORKERS),
        dt=st.floats(0.0, 0.003),
    )
    def membership(self, data: st.DataObject, kind: str, name: str, dt: float) -> None:
        """Health flaps and membership changes, including for unknown and draining workers."""
        now = self.advance(dt)
        if kind == "add":
            self.send(WorkerAdded(now, name, _role(name)))
        elif kind == "remove":
            self.send(WorkerRemoved(now, name))
        elif kind == "unhealthy":
            self.send(WorkerUnhealthy(now, name, data.draw(st.sampled_from(list(WorkerDown)))))
        elif kind == "not_serving":
            self.send(WorkerNotServing(now, name))
        else:
            was = self.w.members.get(name)
            draining = was is not None and was.draining
            self.send(WorkerHealthy(now, name))
            if was is not None and not draining:
                # Never stays unavailable once healthy again.
                snap = {x.address: x for x in self.s.snapshot().workers}  # type: ignore[union-attr]
                assert snap[name].state in (WorkerState.AVAILABLE, WorkerState.BUSY)

    @precondition(lambda self: self.w.holding or any(self.w.ar_owned.values()))
    @rule(
        data=st.data(),
        how=st.sampled_from(["crash", "flap", "drain", "drain+crash", "sigterm", "sigterm+exit", "sigterm+back"]),
        dt=st.floats(0.0, 0.003),
    )
    def disturb_busy_worker(self, data: st.DataObject, how: str, dt: float) -> None:
        """A worker with work in flight goes down (maybe straight back up), is drained, or says NOT_SERVING
        (SIGTERM: its work must be left to finish, unless it then exits): requeue + fencing."""
        busy = sorted(set(self.w.holding) | {n for n, owned in self.w.ar_owned.items() if owned})
        name = data.draw(st.sampled_from(busy))
        now = self.advance(dt)
        if how.startswith("drain"):
            self.send(WorkerRemoved(now, name))
        if how.startswith("sigterm"):
            self.send(WorkerNotServing(now, name))
        if how not in ("drain", "sigterm", "sigterm+back"):
            self.send(WorkerUnhealthy(now, name))
        if how in ("flap", "sigterm+back"):
            self.send(WorkerHealthy(now, name))

    @precondition(lambda self: self.w.holding or any(self.w.ar_owned.values()))
    @rule(data=st.data(), back=st.booleans(), dt=st.floats(0.0, 0.003))
    def credential_refused(self, data: st.DataObject, back: bool, dt: float) -> None:
        """A worker with work in flight refused the gateway's credential (maybe fixed at once): its work goes
        elsewhere and never uses an attempt or an AR retry, however often it happens (the model checks both)."""
        busy = sorted(set(self.w.holding) | {n for n, owned in self.w.ar_owned.items() if owned})
        name = data.draw(st.sampled_from(busy))
        now = self.advance(dt)
        self.send(WorkerUnhealthy(now, name, WorkerDown.CREDENTIAL_REFUSED))
        if back:
            self.send(WorkerHealthy(now, name))

    @precondition(lambda self: any(len(b.request_ids) > 1 for b in self.w.ar_rpcs.values()))
    @rule(data=st.data(), dt=st.floats(0.0, 0.003))
    def shared_batch_refused_as_bad_input(self, data: st.DataObject, dt: float) -> None:
        """Rare in random runs, so driven directly: the split must never batch those requests together again."""
        bid = data.draw(st.sampled_from(sorted(b for b, a in self.w.ar_rpcs.items() if len(a.request_ids) > 1)))
        self._deliver_ar(bid, "invalid", self.advance(dt))

    @rule(dt=st.floats(0.0, 0.02), finished=st.lists(st.sampled_from(["ok", "ok", "ok", "fail"]), max_size=4))
    def tick(self, dt: float, finished: list[str]) -> None:
        """Time passes: some outstanding RPCs end (oldest first; "fail" is retryable), then a Tick."""
        now = self.advance(dt)
        for i, outcome in enumerate(finished):
            if self.w.ar_rpcs and (i % 2 == 0 or not self.w.dn_rpcs):
                self._deliver_ar(min(self.w.ar_rpcs), outcome, now)
            elif self.w.dn_rpcs:
                self._deliver_dn(min(self.w.dn_rpcs), "retry" if outcome == "fail" else "ok", now)
        self.send(Tick(now))

    @precondition(lambda self: len(self.w.ended) < len(self.w.reqs))
    @rule(data=st.data(), dt=st.floats(0.0, 0.003))
    def cancel(self, data: st.DataObject, dt: float) -> None:
        # Mostly live requests; ended and never-admitted ids must be no-ops.
        live = sorted(rid for rid in self.w.reqs if rid not in self.w.ended)
        rid = data.draw(st.sampled_from(live) | st.sampled_from([f"r{i}" for i in range(self.next_rid)]))
        self.send(RequestCancelled(self.advance(dt), rid))

    @precondition(lambda self: self.w.ar_rpcs)
    @rule(
        data=st.data(),
        outcome=st.sampled_from(["ok", "ok", "ok", "fail", "short", "invalid", "internal"]),
        dt=st.floats(0.0, 0.003),
    )
    def ar_result(self, data: st.DataObject, outcome: str, dt: float) -> None:
        bid = data.draw(st.sampled_from(sorted(self.w.ar_rpcs)))
        self._deliver_ar(bid, outcome, self.advance(dt))

    @precondition(lambda self: self.w.dn_rpcs)
    @rule(
        data=st.data(),
        outcome=st.sampled_from(["ok", "ok", "ok", "retry", "fatal"]),
        dt=st.floats(0.0, 0.003),
    )
    def dn_result(self, data: st.DataObject, outcome: str, dt: float) -> None:
        j = data.draw(st.sampled_from(sorted(self.w.dn_rpcs)))
        self._deliver_dn(j, outcome, self.advance(dt))

    @precondition(lambda self: self.w.dn_rpcs)
    @rule(data=st.data(), stale=st.booleans(), dt=st.floats(0.0, 0.003))
    def refused_busy(self, data: st.DataObject, stale: bool, dt: float) -> None:
        """Another gateway's job took the denoiser first: the refusal names the occupancy sequence it saw, which
        may be older than a free state already applied (then the denoiser is not marked busy)."""
        j = data.draw(st.sampled_from(sorted(self.w.dn_rpcs)))
        wname = self.w.dn_rpcs.pop(j)
        self.w.delivered.append((j, wname))
        self.seq += 1
        sequence = data.draw(st.sampled_from([None, self.seq - 5])) if stale else self.seq
        self.send(DenoiseRefusedBusy(self.advance(dt), j, wname, sequence))

    @rule(name=st.sampled_from([n for n in WORKERS if not n.startswith("ar")]), elsewhere=st.booleans(),
          order=st.sampled_from(["new", "new", "old", "none"]), dt=st.floats(0.0, 0.003),
          loras=st.none() | adapter_sets | st.just(frozenset({"c"})))
    def other_gateway(self, name: str, elsewhere: bool, order: str, dt: float, loras: frozenset[str] | None) -> None:
        """A denoiser's occupancy stream: another gateway's job took it or left it (maybe a state older than one
        already seen, which must change nothing, or an unordered one after the stream broke), and the adapters it
        holds (an eviction, or loads by another gateway's jobs)."""
        self.seq += 1
        sequence = {"new": self.seq, "old": self.seq - 7, "none": None}[order]
        self.send(DenoiserOccupancy(self.advance(dt), name, elsewhere, sequence, loras=loras))

    @precondition(lambda self: self.w.delivered or self.w.delivered_batches)
    @rule(data=st.data(), which=st.integers(0, 3), dt=st.floats(0.0, 0.003))
    def stale_result(self, data: st.DataObject, which: int, dt: float) -> None:
        """Duplicated deliveries, results naming the wrong worker, and results for batches already done."""
        now = self.advance(dt)
        if which == 0 and self.w.delivered_batches:
            bid = data.draw(st.sampled_from(self.w.delivered_batches))
            self.send(ArBatchSucceeded(now, bid, {}))
            return
        if not self.w.delivered:
            return
        j, wname = data.draw(st.sampled_from(self.w.delivered))
        if which == 1:
            wname = data.draw(st.sampled_from(WORKERS))
        if which == 2:
            self.send(DenoiseFailed(now, j, wname, "dup", True))
        else:
            self.send(DenoiseSucceeded(now, j, wname, ("bogus", j, wname)))



def test_state_machine_invariants() -> None:
    run_state_machine_as_test(
        SchedulerMachine,
        settings=settings(
            max_examples=400,
            stateful_step_count=50,
            deadline=None,
            derandomize=True,  # deterministic: the same sequences on every run
            database=None,  # write nothing to the repository
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
