"""Micro-benchmark of the pure scheduler alone (issue 15, item 6): events per second against the denoiser pool size.

`python -m bench.scheduler_micro` builds, for each pool size (10, 100, 1,000 denoisers and a few AR servers), a
Scheduler holding ~10,000 queued outputs (admitted, AR done, waiting for a denoiser) with every worker busy, then
drives a steady stream of events: DenoiseSucceeded for the jobs in flight (each frees a denoiser, which takes the
next queued output), RequestArrived and ArBatchSucceeded to keep the queue at ~10,000.

The stream is recorded once from a live run (the events depend on the job and batch ids the scheduler hands out)
and then replayed, timed, on fresh twins built the same way: the scheduler is deterministic, so a twin produces the
very same actions, and the clock measures handle() alone, not this harness. Figures are medians of rounds:
events/s and ns per event for each pool size, and the cost curve (ns per event at the largest pool over the
smallest, which logarithmic growth bounds by log(1000)/log(10) = 3). Besides, per pool size: what one publish of the
metrics costs (Scheduler.gauges(): counts, no entry per worker) against the full snapshot() GetStatus builds.

With ``--base REV`` the scheduler of an earlier revision (its gateway/scheduler/ package, or gateway/scheduler.py
before the package, over this checkout's exchange types) replays the same streams, in rounds alternating with this
one's, so both see the same machine load; the head/base ratio of the medians is the speed-up, and both must complete
the same requests. Both sides' Python bytecodes per event are counted too (on the first 3,000 events): on a shared,
loaded machine the clock can hide a few percent either way, the count cannot.
Writes bench/results/scheduler_micro.json.
"""
from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import importlib.util
import math
import subprocess
import sys
import time
import types
from collections import deque
from collections.abc import Callable
from pathlib import Path

from bench.common import median, write_result
from gateway.scheduler import types as exchange_types
from gateway.scheduler.core import Scheduler
from gateway.scheduler.types import (
    ArBatchSucceeded,
    DenoiseSucceeded,
    DispatchArBatch,
    DispatchDenoise,
    Event,
    RequestArrived,
    SchedulerConfig,
    WorkerAdded,
    WorkerHealthy,
    WorkerRole,
)

POOLS = (10, 100, 1000)
AR_SERVERS = 4
QUEUED = 10_000  # outputs kept waiting for a denoiser
BATCH = 8  # AR batch capacity in outputs; a batch leaves when full (the delay is out of reach)
TICK = 1e-6  # simulated seconds between events
TARGET_EVENTS_PER_S = 100_000
BYTECODE_EVENTS = 3_000  # events of each stream whose bytecodes are counted (traced: about 100x slower)
REPO = Path(__file__).resolve().parents[1]


class _Harness:
    """Plays the driver and the workers: answers every dispatch, in order, with a success."""

    def __init__(self, denoisers: int, scheduler: type = Scheduler) -> None:
        self.sched = scheduler(SchedulerConfig(max_queued_outputs=4 * QUEUED, ar_batch_max_outputs=BATCH,
                                               ar_batch_delay=3600.0))
        self.now = 0.0
        self.arrivals = 0
        self.jobs: deque[DispatchDenoise] = deque()
        self.batches: deque[DispatchArBatch] = deque()
        for i in range(AR_SERVERS):
            self._join(f"ar-{i}", WorkerRole.AR)
        for i in range(denoisers):
            self._join(f"dn-{i}", WorkerRole.DENOISER)
        # Fill up: every denoiser busy, QUEUED outputs behind them.
        while self.sched.queued_outputs() < QUEUED or len(self.jobs) < denoisers:
            self.feed(self.next_event())

    def _join(self, address: str, role: WorkerRole) -> None:
        self.feed(WorkerAdded(self.now, address, role))
        self.feed(WorkerHealthy(self.now, address))

    def feed(self, event: Event) -> None:
        for a in self.sched.handle(event):
            if isinstance(a, DispatchDenoise):
                self.jobs.append(a)
            elif isinstance(a, DispatchArBatch):
                self.batches.append(a)

    def next_event(self) -> Event:
        """Below the target: AR results first, then arrivals (which fill the next batch); at it: denoise results."""
        self.now += TICK
        if self.sched.queued_outputs() < QUEUED or not self.jobs:
            if self.batches:
                b = self.batches.popleft()
                return ArBatchSucceeded(self.now, b.batch_id, {rid: [f"ar:{rid}"] for rid in b.request_ids})
            self.arrivals += 1
            return RequestArrived(self.now, f"r{self.arrivals}", 1, 1024, 1024, deadline=self.now + 3600.0)
        job = self.jobs.popleft()
        return DenoiseSucceeded(self.now, job.job, job.worker, b"png")


def _record(denoisers: int, events: int) -> list[Event]:
    h = _Harness(denoisers)
    stream = []
    for _ in range(events):
        ev = h.next_event()
        h.feed(ev)
        stream.append(ev)
    return stream


def _replay(denoisers: int, stream: list[Event], scheduler: type = Scheduler) -> tuple[float, int]:
    """Seconds to handle the stream on a fresh twin, and how many requests it completed (the twin's check)."""
    sched = _Harness(denoisers, scheduler).sched
    handle = sched.handle
    t0 = time.perf_counter()
    for ev in stream:
        handle(ev)
    return time.perf_counter() - t0, sched.counters.completed


def _publish_seconds(denoisers: int, rounds: int) -> dict[str, float]:
    """Seconds per call, median of ``rounds``, of what the driver publishes after a turn of its loop (gauges(): the
    queues and the workers counted by role and state) and of the full snapshot() GetStatus builds (an entry per
    worker), on a twin in the benchmark's state: every denoiser busy, QUEUED outputs waiting."""
    sched = _Harness(denoisers).sched
    out = {}
    for name, call in (("gauges", sched.gauges), ("snapshot", sched.snapshot)):
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(20):
                call()
            times.append((time.perf_counter() - t0) / 20)
        out[name] = median(times)
    return out


def bytecodes_per_event(denoisers: int, stream: list[Event], scheduler: type = Scheduler) -> float:
    """Python bytecodes handle() runs per event of ``stream`` on a fresh twin (sys.settrace's opcode events): a
    measure of the work, which the load on a shared machine does not blur as it does the clock."""
    handle = _Harness(denoisers, scheduler).sched.handle
    count = 0

    def trace(frame: types.FrameType, event: str, arg: object) -> Callable:
        nonlocal count
        frame.f_trace_opcodes = True
        if event == "opcode":
            count += 1
        return trace

    sys.settrace(trace)
    try:
        for ev in stream:
            handle(ev)
    finally:
        sys.settrace(None)
    return count / len(stream)


def scheduler_at(rev: str) -> tuple[type, str]:
    """The Scheduler class as of ``rev``, and the commit ``rev`` names. Its modules are loaded from git as modules of
    their own, over this checkout's exchange types (so that both sides take the very same events): the package
    gateway/scheduler/ (every module but types.py), or, in a revision from before the package, gateway/scheduler.py
    (which imported them from gateway.scheduler_types)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout

    commit = git("rev-parse", "--verify", f"{rev}^{{commit}}").strip()
    name = f"bench_scheduler_at_{commit[:10]}"
    if not git("ls-tree", "--name-only", commit, "gateway/scheduler/core.py").strip():
        module = types.ModuleType(name)
        module.__file__ = f"{commit[:10]}:gateway/scheduler.py"
        sys.modules[name] = module  # dataclasses look their module up while the class body is built
        sys.modules["gateway.scheduler_types"] = exchange_types
        try:
            exec(compile(git("show", f"{commit}:gateway/scheduler.py"), module.__file__, "exec"), module.__dict__)
        finally:
            del sys.modules["gateway.scheduler_types"]
        return module.Scheduler, commit
    package = types.ModuleType(name)
    package.__path__ = []  # a package: ``from .pool import ...`` in its modules goes through _GitModules
    sys.modules[name] = package
    sys.modules[f"{name}.types"] = exchange_types
    sys.meta_path.insert(0, _GitModules(name, lambda sub: git("show", f"{commit}:gateway/scheduler/{sub}.py")))
    return importlib.import_module(f"{name}.core").Scheduler, commit


class _GitModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds and loads the modules of ``package`` from the sources ``source(module name)`` returns."""

    def __init__(self, package: str, source: Callable[[str], str]) -> None:
        self.package, self.source = package, source

    def find_spec(self, fullname: str, path: object, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.rpartition(".")[0] != self.package:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # the default module

    def exec_module(self, module: types.ModuleType) -> None:
        sub = module.__name__.rpartition(".")[2]
        exec(compile(self.source(sub), f"{self.package}:{sub}.py", "exec"), module.__dict__)


def _figures(times: list[float], events: int) -> dict:
    s = median(times)
    return {"rounds_s": [round(t, 5) for t in times], "events_per_s": round(events / s),
            "events_per_s_range": [round(events / max(times)), round(events / min(times))],
            "ns_per_event": round(s / events * 1e9), "us_per_event": round(s / events * 1e6, 3)}


def run(pools: tuple[int, ...], events: int, rounds: int, base: str | None = None) -> dict:
    base_scheduler, base_commit = scheduler_at(base) if base else (None, None)
    by_pool: dict[str, dict] = {}
    for d in pools:
        stream = _record(d, events)
        mix = {name: sum(type(e).__name__ == name for e in stream)
               for name in ("DenoiseSucceeded", "RequestArrived", "ArBatchSucceeded")}
        sides = {"head": Scheduler} if base_scheduler is None else {"head": Scheduler, "base": base_scheduler}
        times: dict[str, list[float]] = {side: [] for side in sides}
        completed = set()
        for i in range(rounds):
            # Alternate which side goes first (ABBA...), so drift in the machine's load favours neither.
            for side in (list(sides) if i % 2 == 0 else list(sides)[::-1]):
                seconds, done = _replay(d, stream, sides[side])
                times[side].append(seconds)
                completed.add(done)
        assert len(completed) == 1, "replays diverged: a scheduler is not deterministic, or the two differ"
        row = by_pool[str(d)] = {"denoisers": d, "events": len(stream), "event_mix": mix,
                                 **_figures(times["head"], len(stream))}
        line = (f"{d:>5} denoisers: {row['events_per_s']:>8} events/s ({row['events_per_s_range'][0]}-"
                f"{row['events_per_s_range'][1]}), {row['ns_per_event']} ns/event")
        if "base" in times:
            row["base"] = _figures(times["base"], len(stream))
            sample = stream[:BYTECODE_EVENTS]
            row["bytecodes_per_event"] = {side: round(bytecodes_per_event(d, sample, sides[side]), 1)
                                          for side in ("head", "base")}
            row["speedup_over_base"] = round(row["events_per_s"] / row["base"]["events_per_s"], 3)
            line += (f"; base {row['base']['events_per_s']} events/s, {row['base']['ns_per_event']} ns/event: "
                     f"{row['speedup_over_base']:.2f}x; bytecodes/event head {row['bytecodes_per_event']['head']}, "
                     f"base {row['bytecodes_per_event']['base']}")
        publish = _publish_seconds(d, rounds)
        row["publish_us"] = {name: round(v * 1e6, 1) for name, v in publish.items()}
        line += f"; publish: gauges() {publish['gauges'] * 1e6:.1f} us, snapshot() {publish['snapshot'] * 1e6:.1f} us"
        print(line, flush=True)
    lo, hi = by_pool[str(pools[0])], by_pool[str(pools[-1])]
    growth = hi["ns_per_event"] / lo["ns_per_event"]
    # Logarithmic growth allows cost(hi)/cost(lo) up to log(hi)/log(lo) (3.0 for 1,000 over 10).
    log_bound = math.log(pools[-1]) / math.log(pools[0])
    summary = {"events_per_s_at_max_pool": hi["events_per_s"],
               "ns_per_event_by_pool": {k: v["ns_per_event"] for k, v in by_pool.items()},
               "cost_growth_max_over_min_pool": round(growth, 3), "log_growth_bound": round(log_bound, 3),
               "publish_us_by_pool": {k: v["publish_us"] for k, v in by_pool.items()}}
    if base:
        summary["base"] = {"rev": base, "commit": base_commit,
                           "events_per_s_at_max_pool": hi["base"]["events_per_s"],
                           "ns_per_event_by_pool": {k: v["base"]["ns_per_event"] for k, v in by_pool.items()},
                           "speedup_by_pool": {k: v["speedup_over_base"] for k, v in by_pool.items()}}
    targets = {f">= {TARGET_EVENTS_PER_S:,} events/s at {pools[-1]} denoisers":
               hi["events_per_s"] >= TARGET_EVENTS_PER_S,
               f"per-event cost {pools[-1]} vs {pools[0]} denoisers <= log ratio ({log_bound:.1f}x)":
               growth <= log_bound}
    return {"setup": {"pools": list(pools), "ar_servers": AR_SERVERS, "queued_outputs": QUEUED,
                      "ar_batch_max_outputs": BATCH, "n": 1, "events_per_round": events, "rounds": rounds,
                      "base": base, "python": sys.version.split()[0]},
            "by_pool": by_pool, "summary": summary, "targets_met": targets}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--events", type=int, default=50_000, help="events per timed round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--pools", type=lambda s: tuple(int(x) for x in s.split(",")), default=POOLS,
                   help="comma-separated denoiser counts, smallest first")
    p.add_argument("--base", metavar="REV", help="also replay on the scheduler as of this git revision, "
                   "in alternating rounds, and report the speed-up")
    args = p.parse_args(argv)
    results = run(args.pools, args.events, args.rounds, args.base)
    write_result("scheduler_micro", results, "python -m bench.scheduler_micro " + " ".join(argv or sys.argv[1:]))
    s = results["summary"]
    print(f"cost curve: {', '.join(f'{k}: {v} ns' for k, v in s['ns_per_event_by_pool'].items())}; "
          f"{args.pools[-1]} over {args.pools[0]}: {s['cost_growth_max_over_min_pool']}x "
          f"(logarithmic: <= {s['log_growth_bound']}x)")
    for k, v in results["targets_met"].items():
        print(f"- {k}: {'met' if v else 'MISSED'}")


if __name__ == "__main__":
    main()
