"""Fair share between tenants in the pure scheduler (gateway/scheduler/fairness.py): each rule on its own, in both
stages. The state machine test (tests/test_scheduler_machine.py) checks the BATCH rule and the invariants on random
streams of several tenants; tests/test_scheduler_replay.py pins that one tenant's traffic is served as before.
"""

from __future__ import annotations

from collections import Counter, deque

from gateway.scheduler.core import Scheduler
from gateway.scheduler.fair_queue import DenoiseQueue
from gateway.scheduler.fairness import Shares
from gateway.scheduler.types import (
    BATCH,
    DEFAULT,
    INTERACTIVE,
    Action,
    ArBatchSucceeded,
    DenoiseFailed,
    DenoiseSucceeded,
    DispatchArBatch,
    DispatchDenoise,
    Event,
    FailRequest,
    RequestArrived,
    Tick,
    WorkerAdded,
    WorkerHealthy,
)
from runtime.errors import ErrorKind
from tests.support.scheduler_events import make, up
from tests.support.scheduler_model import AR, DN, OTHER, SIZE


class Driver:
    """Plays the workers: AR batches answered when run_ar() says, denoise jobs when finish() says; logs which tenant
    each dispatch served."""

    def __init__(self, s: Scheduler) -> None:
        self.s = s
        self.now = 0.0
        self.batches: deque[DispatchArBatch] = deque()
        self.jobs: deque[DispatchDenoise] = deque()
        self.ar_log: list[list[str]] = []  # per AR batch: the tenant of each request in it
        self.dn_log: list[str] = []  # per denoise dispatch: its tenant
        self.dn_ids: list[str] = []  # and its request
        self.classes: dict[str, int] = {}

    def feed(self, ev: Event) -> list[Action]:
        actions = self.s.handle(ev)
        for a in actions:
            if isinstance(a, DispatchArBatch):
                self.batches.append(a)
                self.ar_log.append([self.s.tenant_of(rid) for rid in a.request_ids])
            elif isinstance(a, DispatchDenoise):
                self.jobs.append(a)
                self.dn_log.append(self.s.tenant_of(a.job.request_id))
                self.dn_ids.append(a.job.request_id)
        return actions

    def arrive(self, tenant: str, count: int = 1, n: int = 1, weight: float = 1.0, priority: int = DEFAULT,
               size: tuple[int, int] = SIZE) -> list[str]:
        rids = []
        for _ in range(count):
            rid = f"{tenant}-{len(self.classes)}"
            self.classes[rid] = priority
            self.feed(RequestArrived(self.now, rid, n, *size, tenant=tenant, weight=weight, priority=priority))
            rids.append(rid)
        return rids

    def run_ar(self, batches: int | None = None) -> None:
        while self.batches and (batches is None or batches > 0):
            b = self.batches.popleft()
            self.feed(ArBatchSucceeded(self.now, b.batch_id, {r: ["ar"] * self._n(r) for r in b.request_ids}))
            batches = None if batches is None else batches - 1

    def _n(self, rid: str) -> int:
        return self.s._active[rid].n

    def finish(self, jobs: int = 1) -> None:
        for _ in range(jobs):
            j = self.jobs.popleft()
            self.now += 0.001
            self.feed(DenoiseSucceeded(self.now, j.job, j.worker, "png"))


def cluster(denoisers: int = 0, cap: int = 8, ar: bool = True, **kw: object) -> Driver:
    s = make(ar_batch_delay=0.0, ar_batch_max_outputs=cap, max_queued_outputs=100_000, **kw)
    if ar:
        up(s, "ar0", AR)
    for i in range(denoisers):
        up(s, f"d{i}", DN)
    return Driver(s)


def add_denoisers(d: Driver, count: int) -> None:
    for i in range(count):
        d.s.handle(WorkerAdded(d.now, f"d{i}", DN))
        d.feed(WorkerHealthy(d.now, f"d{i}"))


def add_ar(d: Driver) -> None:
    d.s.handle(WorkerAdded(d.now, "ar0", AR))
    d.feed(WorkerHealthy(d.now, "ar0"))


def share(log: list[str]) -> Counter:
    return Counter(log)


# ------------------------------------------------------------------------------------------------ weights


def test_weights_1_1_2_share_the_denoisers_25_25_50() -> None:
    d = cluster()
    for name, weight in (("t1", 1.0), ("t2", 1.0), ("t3", 2.0)):
        d.arrive(name, 300, weight=weight)
    d.run_ar()  # every output waits for a denoiser
    assert len(d.s._denoise_q) == 900
    add_denoisers(d, 4)
    d.finish(396)
    got = share(d.dn_log[:400])
    assert abs(got["t1"] - 100) <= 2 and abs(got["t2"] - 100) <= 2 and abs(got["t3"] - 200) <= 2, got


def test_weights_1_1_2_share_the_ar_batches_25_25_50() -> None:
    d = cluster(cap=4, ar=False)
    for name, weight in (("t1", 1.0), ("t2", 1.0), ("t3", 2.0)):
        d.arrive(name, 300, weight=weight)
    add_ar(d)  # the backlog is there before the first batch leaves
    d.run_ar(99)
    got = Counter(t for batch in d.ar_log[:100] for t in batch)
    assert sum(got.values()) == 400
    assert abs(got["t1"] - 100) <= 2 and abs(got["t2"] - 100) <= 2 and abs(got["t3"] - 200) <= 2, got


def test_the_latest_arrivals_weight_is_the_tenants() -> None:
    d = cluster()
    d.arrive("t1", 100, weight=1.0)
    d.arrive("t2", 99, weight=1.0)
    d.arrive("t2", 1, weight=3.0)  # t2 is 3 from now on, for its queued work too
    d.run_ar()
    add_denoisers(d, 1)
    d.finish(79)
    got = share(d.dn_log[:80])
    assert abs(got["t2"] - 60) <= 2, got
    assert {t.name: t.weight for t in d.s.gauges().tenants} == {"t1": 1.0, "t2": 3.0}


# ----------------------------------------------------------------------------------------- newcomers, idle


def test_a_newcomer_beside_a_backlog_is_served_within_one_job() -> None:
    d = cluster(denoisers=2)
    d.arrive("big", 200)
    d.run_ar()
    d.finish(10)
    d.arrive("small")  # its AR batch leaves at once (the AR is free), its output is queued behind 190 of big's
    d.run_ar()
    d.finish(1)
    assert d.dn_log[-1] == "small"


def test_a_newcomer_beside_an_ar_backlog_goes_in_the_next_batch() -> None:
    d = cluster(cap=1)
    d.arrive("big", 50)
    d.run_ar(5)
    d.arrive("small")
    d.run_ar(1)
    assert d.ar_log[-1] == ["small"]


def test_idle_time_banks_no_credit() -> None:
    d = cluster(denoisers=1)
    d.arrive("a", 1)
    d.arrive("b", 1)
    d.run_ar()
    d.finish(1)
    d.finish(1)  # b is idle from here on
    d.arrive("a", 200)
    d.run_ar()
    d.finish(100)  # a alone for 100 jobs
    d.arrive("b", 100)
    d.run_ar()
    d.finish(40)
    got = share(d.dn_log[-40:])
    assert abs(got["a"] - 20) <= 2 and abs(got["b"] - 20) <= 2, got  # not b's 100 in a row


# ------------------------------------------------------------------------------------------------- classes


def test_within_a_tenant_class_then_arrival() -> None:
    d = cluster(denoisers=1)
    d.arrive("a", 1)  # holds the denoiser
    d.run_ar()
    first = d.arrive("a", 1, priority=DEFAULT)
    batch = d.arrive("a", 1, priority=BATCH)
    urgent = d.arrive("a", 1, priority=INTERACTIVE)
    later = d.arrive("a", 1, priority=DEFAULT)
    d.run_ar()
    d.finish(4)
    assert d.dn_ids[1:] == urgent + first + later + batch


def test_within_a_class_a_requeued_job_goes_first() -> None:
    d = cluster(denoisers=1)
    d.arrive("a", 3)
    d.run_ar()
    j = d.jobs.popleft()  # the first one fails and goes again, before the two queued behind it
    d.feed(DenoiseFailed(d.now, j.job, j.worker, "boom", retryable=True))
    assert d.dn_ids == ["a-0", "a-0"]


def test_batch_runs_only_on_denoisers_nothing_else_waits_for() -> None:
    d = cluster()
    d.arrive("bulk", 20, priority=BATCH)
    d.arrive("web", 10)
    d.run_ar()
    add_denoisers(d, 2)
    d.finish(10)
    assert d.dn_log[:10] == ["web"] * 10  # every default job before any batch job
    assert d.dn_log[10:12] == ["bulk", "bulk"]
    d.arrive("web", 1)  # queued while both run bulk jobs: the next free one is its
    d.run_ar()
    d.finish(1)
    assert d.dn_log[-1] == "web"


def test_batch_fills_only_the_spare_room_of_an_ar_batch() -> None:
    d = cluster(cap=4, ar=False)
    d.arrive("bulk", 8, priority=BATCH)
    d.arrive("web", 1)
    d.arrive("web", 1, size=OTHER)
    add_ar(d)
    d.run_ar(2)
    # First the oldest web request's group, bulk filling its room; then the other web request alone (its group has
    # no room to fill), and only then bulk's own batches.
    assert d.ar_log[0] == ["web", "bulk", "bulk", "bulk"]
    assert d.ar_log[1] == ["web"]
    assert d.ar_log[2] == ["bulk"] * 4


def test_priority_and_weight_are_checked() -> None:
    s = make()
    for ev in (RequestArrived(0.0, "r", 1, *SIZE, priority=3), RequestArrived(0.0, "r", 1, *SIZE, weight=0.0)):
        (fail,) = s.handle(ev)
        assert isinstance(fail, FailRequest) and fail.error.kind is ErrorKind.INVALID_ARGUMENT


# ---------------------------------------------------------------------------------- the LoRA pass, figures


def test_a_job_the_placement_pass_puts_back_is_not_charged() -> None:
    shares = Shares()
    q: DenoiseQueue = shares.denoise
    a = shares._tenant("a", 1.0).flows[0]
    b = shares._tenant("b", 1.0).flows[0]
    for seq in (1, 2):
        q.push((DEFAULT, 1, seq, 0, f"a{seq}"), a)
    q.push((DEFAULT, 1, 3, 0, "b3"), b)
    q.begin()
    first, second = q.take(), q.take()  # a1 (kept: waits for its holder), then b3 (served)
    assert (first[4], second[4]) == ("a1", "b3")
    q.keep(first)
    q.put_back()
    assert (a.tag, b.tag) == (0.0, 1.0)  # a uncharged, b charged once
    assert q.first == first and len(q) == 2
    assert q.pop() == first and q.pop()[4] == "a2"


def test_each_tenants_figures() -> None:
    d = cluster(denoisers=1)
    d.arrive("a", 2, n=2)
    d.now = 1.0
    d.arrive("b", 1, n=3, weight=2.0)
    d.arrive("c", 1, n=1, priority=BATCH)
    d.now = 3.0
    d.s.handle(Tick(d.now))
    figures = {t.name: t for t in d.s.gauges().tenants}
    assert list(figures) == ["a", "b", "c"]
    a, b, c = figures["a"], figures["b"], figures["c"]
    # a's first request left in the AR's one batch at once; the others wait for the AR.
    assert (a.pending_ar_requests, a.pending_ar_outputs, a.active_requests, a.active_outputs) == (1, 2, 2, 4)
    assert (b.weight, b.pending_ar_requests, b.pending_ar_outputs, b.active_outputs) == (2.0, 1, 3, 3)
    assert (a.oldest_wait, b.oldest_wait) == (3.0, 2.0)  # queued since 0.0 and 1.0
    assert c.oldest_wait == 0.0  # BATCH work is not counted
    d.run_ar(1)  # a-0's two outputs: one on the denoiser, one queued
    assert {t.name: t for t in d.s.gauges().tenants}["a"].pending_denoise_outputs == 1
    assert d.s.tenant_of("b-2") == "b" and d.s.tenant_of("nobody") is None
    assert [t.name for t in d.s.snapshot().tenants] == ["a", "b", "c"]


# ------------------------------------------------------------------------------------------------ admission


def refused(d: Driver, tenant: str, count: int, weight: float = 1.0) -> int:
    """How many of ``count`` arrivals of ``tenant`` the admission bound refused."""
    before = d.s.counters.rejected
    d.arrive(tenant, count, weight=weight)
    return d.s.counters.rejected - before


def test_a_flood_fills_the_admission_bound_for_itself_never_against_another_tenant() -> None:
    s = make(ar_batch_delay=0.0, max_queued_outputs=20)  # no worker: everything stays queued
    d = Driver(s)
    assert refused(d, "flood", 30) == 10  # alone, the bound is all its own
    # Past the bound, a tenant within its share (20 x 1/2) still gets in; the flood, past its share, does not.
    assert refused(d, "light", 12) == 2 and refused(d, "flood", 5) == 5
    assert s.queued_outputs() == 30
    # A heavier tenant's share is larger (20 x 2/4), and the total never passes twice the bound.
    assert refused(d, "heavy", 15, weight=2.0) == 5 and s.queued_outputs() == 40
    assert refused(d, "other", 1) == 1
    actions = s.handle(RequestArrived(d.now, "x", 1, *SIZE, tenant="light"))
    (ending,) = [a for a in actions if isinstance(a, FailRequest)]
    assert ending.error.kind is ErrorKind.RESOURCE_EXHAUSTED and "busy" in ending.error.message
