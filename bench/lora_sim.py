"""LoRA placement, simulated (issue 23): 8 adapters over 14 denoisers, affinity against random placement.

`python -m bench.lora_sim` (from the repo root) drives the real pure scheduler (gateway/scheduler/core.py) in virtual
time, no processes, no sockets: 1 AR server that is never the bottleneck and 14 denoisers, each with the denoiser's
adapter LRU (--max-loaded-loras, 4). A job naming an adapter the denoiser does not hold pays one load per missing
adapter (evicting the least recently used), then its denoise time; at its end the denoiser reports DenoiseSucceeded
(lora_load_s = the seconds it loaded) and its occupancy (free, the adapters it holds, the next sequence number), as
the real occupancy stream does on release.

Requests: Poisson arrivals, n=1, each naming one adapter drawn Zipf(s) over 8 (optionally a share of plain ones).
The same arrival sequence runs under three policies: no adapters at all (the bound: what the pool completes),
``affinity`` (SchedulerConfig.lora_affinity=True) and ``random`` (lora_affinity=False: the next free denoiser in the
scheduler's rotation, blind to adapters). Several seeds, medians.

Costs, in reference seconds: a denoise is 12.2 s (DESIGN.md, the reference deployment's 30 DiT steps at batch 1, the
figure every simulation here uses). A load is measured on the tiny model and scaled to a real adapter
(bench/lora_load_cost.py); --load-seconds sets the load cost instead. Writes bench/results/lora_sim.json and
bench/results/lora_sim.png.
"""
from __future__ import annotations

import argparse
import heapq
import itertools
import json
import random
import statistics
import sys
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.common import RESULTS, percentile, write_result
from bench.lora_load_cost import load_cost
from bench.sim_backends import DENOISE_SECONDS
from gateway.scheduler.core import Scheduler
from gateway.scheduler.types import (
    ArBatchSucceeded,
    CompleteRequest,
    DenoiserOccupancy,
    DenoiseSucceeded,
    DispatchArBatch,
    DispatchDenoise,
    FailRequest,
    RequestArrived,
    SchedulerConfig,
    Tick,
    WorkerAdded,
    WorkerHealthy,
    WorkerRole,
)

DENOISERS = 14
ADAPTERS = 8
ZIPF_S = 1.1
LRU_CAPACITY = 4  # services/denoiser/engine.py DenoiseSettings.max_loaded_loras, the denoiser's default
CAPACITY = DENOISERS / DENOISE_SECONDS  # images per second with no adapters: the pool's bound
# The AR is kept out of the way: a short fixed batch time, several batches in flight, so the denoisers decide.
AR_SECONDS = 0.5
AR_BATCH_MAX_OUTPUTS = 28
AR_INFLIGHT = 4
TARGET_LOAD = 0.875  # offered load at the done-when, a share of CAPACITY
OVERLOAD = 1.1  # arrivals beyond the pool's capacity: the throughput is then the policy's capacity
SWEEP = (0.5, 0.7, 0.8, TARGET_LOAD, 0.95, OVERLOAD)
POLICIES = ("bound", "affinity", "random")
SIZE = (1024, 1024)

# ---- the simulation ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Arrival:
    at: float
    adapter: str | None  # None: a plain request


def adapter_names() -> list[str]:
    return [f"style-{k}" for k in range(1, ADAPTERS + 1)]  # style-1 the most popular


def arrivals(rate: float, until: float, seed: int, plain_share: float) -> list[Arrival]:
    rng = random.Random(seed)
    names = adapter_names()
    weights = [1 / k**ZIPF_S for k in range(1, ADAPTERS + 1)]
    out, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= until:
            return out
        plain = rng.random() < plain_share
        out.append(Arrival(t, None if plain else rng.choices(names, weights)[0]))


@dataclass
class Denoiser:
    """One simulated denoiser: its adapter LRU (least recently used first) and occupancy sequence."""

    capacity: int
    lru: OrderedDict[str, None] = field(default_factory=OrderedDict)
    sequence: int = 0

    def take(self, loras: frozenset[str]) -> int:
        """Make ``loras`` loaded and most recently used; how many it had to load."""
        missing = sorted(loras - self.lru.keys())
        for name in missing:
            while len(self.lru) >= self.capacity:
                del self.lru[next(n for n in self.lru if n not in loras)]
            self.lru[name] = None
        for name in sorted(loras):
            self.lru.move_to_end(name)
        return len(missing)


@dataclass
class Costs:
    denoise_s: float
    load_s: float
    ar_s: float = AR_SECONDS


@dataclass
class RunResult:
    policy: str
    offered: float  # requests per second
    completed: int  # in the window
    throughput: float  # completed per second in the window
    throughput_vs_bound: float = float("nan")
    latency_p50: float = float("nan")  # over every request completed in the window
    latency_p95: float = float("nan")
    per_adapter: dict[str, dict[str, float]] = field(default_factory=dict)  # name -> count, p50, p95
    plain: dict[str, float] | None = None
    loads_per_request: float = 0.0
    max_p95_over_median_adapter_p95: float = float("nan")
    max_p95_over_median_latency: float = float("nan")
    queued_at_end: int = 0
    failed: int = 0
    # Of the jobs that loaded (whole run): the share that loaded while a job left waiting named only adapters that
    # denoiser held, and the share that had waited for a denoiser at least one load's time first.
    loads_with_a_match_waiting: float | None = None  # None: no job loaded
    loads_after_waiting_a_load: float | None = None


def simulate(policy: str, reqs: list[Arrival], costs: Costs, warmup: float, window: float,
             capacity: int = LRU_CAPACITY) -> RunResult:
    """Run ``reqs`` through the real scheduler until warmup + window (virtual seconds)."""
    sched = Scheduler(SchedulerConfig(max_queued_outputs=1 << 30, ar_batch_max_outputs=AR_BATCH_MAX_OUTPUTS,
                                      ar_max_inflight_batches=AR_INFLIGHT, lora_affinity=policy != "random"))
    end = warmup + window
    names = [f"d{i}" for i in range(DENOISERS)]
    denoisers = {name: Denoiser(capacity) for name in names}
    for w, role in [("ar0", WorkerRole.AR)] + [(d, WorkerRole.DENOISER) for d in names]:
        sched.handle(WorkerAdded(0.0, w, role))
        sched.handle(WorkerHealthy(0.0, w))
    loras_of: dict[str, frozenset[str]] = {}
    arrived: dict[str, float] = {}
    adapter_of: dict[str, str | None] = {}
    loads_of: dict[str, int] = {}
    done: list[tuple[str, float]] = []  # (request id, latency) completed in the window
    waiting: dict[str, float] = {}  # request id -> when its AR output came back, until its job is dispatched
    loading_jobs = with_match = after_a_load = 0
    failed = 0
    heap: list[tuple[float, int, Any]] = []
    seq = itertools.count()

    def push(at: float, item: Any) -> None:
        heapq.heappush(heap, (at, next(seq), item))

    for i, r in enumerate(reqs):
        push(r.at, ("arrive", f"r{i}", r))

    def perform(now: float, actions: list) -> None:
        nonlocal failed, loading_jobs, with_match, after_a_load
        # Jobs dispatched in this turn are no longer waiting: what stays is the queue the scheduler passed over.
        since = {a.job.request_id: waiting.pop(a.job.request_id, now)
                 for a in actions if isinstance(a, DispatchDenoise)}
        for a in actions:
            if isinstance(a, DispatchArBatch):
                push(now + costs.ar_s, ("ar", a))
            elif isinstance(a, DispatchDenoise):
                d = denoisers[a.worker]
                if not loras_of[a.job.request_id] <= d.lru.keys():
                    loading_jobs += 1
                    after_a_load += now - since[a.job.request_id] >= costs.load_s
                    with_match += any(loras_of[rid] and loras_of[rid] <= d.lru.keys() for rid in waiting)
                loaded = d.take(loras_of[a.job.request_id])
                loads_of[a.job.request_id] = loads_of.get(a.job.request_id, 0) + loaded
                load_s = loaded * costs.load_s
                push(now + load_s + costs.denoise_s, ("denoised", a, load_s))
            elif isinstance(a, CompleteRequest):
                if warmup <= now < end:
                    done.append((a.request_id, now - arrived[a.request_id]))
            elif isinstance(a, FailRequest):
                failed += 1

    now, last_tick = 0.0, -1.0
    while heap:
        wake = sched.next_wakeup()
        # A Tick only where the scheduler asks for one before the next event (a job waiting for a holder); never
        # twice at one instant, so a wake-up the Tick did not clear cannot spin.
        if wake is not None and wake < heap[0][0] and wake > last_tick:
            now = last_tick = max(wake, now)
            perform(now, sched.handle(Tick(now)))
            continue
        at, _, item = heapq.heappop(heap)
        if at >= end:
            break
        now = at
        kind = item[0]
        if kind == "arrive":
            _, rid, r = item
            loras = frozenset() if policy == "bound" or r.adapter is None else frozenset({r.adapter})
            loras_of[rid], arrived[rid], adapter_of[rid] = loras, now, r.adapter
            perform(now, sched.handle(RequestArrived(now, rid, 1, *SIZE, loras=loras)))
        elif kind == "ar":
            batch: DispatchArBatch = item[1]
            waiting.update((rid, now) for rid in batch.request_ids)
            perform(now, sched.handle(ArBatchSucceeded(now, batch.batch_id,
                                                       {rid: [rid] for rid in batch.request_ids})))
        else:
            _, job, load_s = item
            d = denoisers[job.worker]
            actions = sched.handle(DenoiseSucceeded(now, job.job, job.worker, None, lora_load_s=load_s))
            d.sequence += 1  # what it holds as it frees up (before any job dispatched just now loads)
            held = frozenset(d.lru)
            perform(now, actions)
            perform(now, sched.handle(DenoiserOccupancy(now, job.worker, False, d.sequence, loras=held)))

    res = RunResult(policy=policy, offered=round(len(reqs) / end, 4), completed=len(done),
                    throughput=round(len(done) / window, 4), failed=failed,
                    queued_at_end=sched.snapshot().pending_denoise_outputs)
    if loading_jobs:
        res.loads_with_a_match_waiting = round(with_match / loading_jobs, 4)
        res.loads_after_waiting_a_load = round(after_a_load / loading_jobs, 4)
    latencies = [lat for _, lat in done]
    res.latency_p50 = round(percentile(latencies, 0.5), 2)
    res.latency_p95 = round(percentile(latencies, 0.95), 2)
    res.loads_per_request = round(sum(loads_of.get(rid, 0) for rid, _ in done) / max(len(done), 1), 4)
    by_adapter: dict[str | None, list[float]] = {}
    for rid, lat in done:
        by_adapter.setdefault(adapter_of[rid], []).append(lat)
    for name in adapter_names():
        lats = by_adapter.get(name, [])
        res.per_adapter[name] = {"count": len(lats), "p50": round(percentile(lats, 0.5), 2),
                                 "p95": round(percentile(lats, 0.95), 2)}
    if None in by_adapter:
        lats = by_adapter[None]
        res.plain = {"count": len(lats), "p50": round(percentile(lats, 0.5), 2),
                     "p95": round(percentile(lats, 0.95), 2)}
    p95s = [v["p95"] for v in res.per_adapter.values() if v["count"]]
    if p95s:
        res.max_p95_over_median_adapter_p95 = round(max(p95s) / statistics.median(p95s), 4)
        res.max_p95_over_median_latency = round(max(p95s) / res.latency_p50, 4)
    return res


def run_load(load: float, seeds: Sequence[int], costs: Costs, args: argparse.Namespace,
             plain_share: float) -> dict[str, Any]:
    """Every policy on each seed's arrivals at ``load`` x CAPACITY; per-seed results and medians."""
    rate = load * CAPACITY
    runs: dict[str, list[dict]] = {p: [] for p in POLICIES}
    for seed in seeds:
        reqs = arrivals(rate, args.warmup + args.window, seed, plain_share)
        bound = simulate("bound", reqs, costs, args.warmup, args.window)
        for policy in POLICIES:
            r = bound if policy == "bound" else simulate(policy, reqs, costs, args.warmup, args.window)
            r.throughput_vs_bound = round(r.throughput / bound.throughput, 4)
            runs[policy].append(asdict(r))
    return {"load": load, "rate": round(rate, 4), "plain_share": plain_share,
            "median": {p: summarize(runs[p]) for p in POLICIES}, "runs": runs}


def summarize(runs: list[dict]) -> dict[str, Any]:
    """Medians over seeds; per adapter, the median of each seed's p50 and p95."""
    med = statistics.median
    keys = ("throughput", "throughput_vs_bound", "latency_p50", "latency_p95", "loads_per_request",
            "max_p95_over_median_adapter_p95", "max_p95_over_median_latency", "queued_at_end",
            "loads_with_a_match_waiting", "loads_after_waiting_a_load")
    out: dict[str, Any] = {}
    for k in keys:
        values = [r[k] for r in runs if r[k] is not None]
        out[k] = round(med(values), 4) if values else None
    out["per_adapter"] = {name: {s: round(med([r["per_adapter"][name][s] for r in runs]), 2)
                                 for s in ("count", "p50", "p95")} for name in runs[0]["per_adapter"]}
    if runs[0]["plain"] is not None:
        out["plain"] = {s: round(med([r["plain"][s] for r in runs]), 2) for s in ("count", "p50", "p95")}
    out["failed"] = sum(r["failed"] for r in runs)
    return out


def checks(target: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The done-when at the target load, per policy: throughput / bound >= 0.9, and the largest adapter p95 <= 2x the
    median adapter's p95 (the median over the 8 adapters' p95s, each seed's own), as medians over seeds; with how
    many seeds met each on their own."""
    out = {}
    for policy in ("affinity", "random"):
        m, runs = target["median"][policy], target["runs"][policy]
        out[policy] = {
            "throughput_vs_bound >= 0.9": m["throughput_vs_bound"] >= 0.9,
            "max adapter p95 <= 2 x median adapter p95": m["max_p95_over_median_adapter_p95"] <= 2.0,
            "seeds meeting throughput": sum(r["throughput_vs_bound"] >= 0.9 for r in runs),
            "seeds meeting p95": sum(r["max_p95_over_median_adapter_p95"] <= 2.0 for r in runs),
            "seeds": len(runs),
        }
    return out


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ((ax1, ax2), (ax3, ax4)) = plt.subplots(2, 2, figsize=(12, 8.8))
    sweep = results["sweep"]
    x = [s["load"] for s in sweep]
    for policy, style in (("affinity", "o-"), ("random", "s--")):
        ax1.plot(x, [s["median"][policy]["throughput_vs_bound"] for s in sweep], style, label=policy)
        ax2.plot(x, [s["median"][policy]["loads_per_request"] for s in sweep], style, label=policy)
    ax1.axhline(0.9, color="red", linestyle=":", label="done-when 0.9")
    ax1.set_ylabel("throughput / no-adapter throughput")
    ax2.set_ylabel("adapter loads per request")
    for ax in (ax1, ax2):
        ax.set_xlabel(f"offered load (share of {DENOISERS}/{results['setup']['denoise_s']} img/s)")
        ax.grid(True, alpha=0.3)
        ax.legend()
    target = results["target"]
    names = list(target["median"]["affinity"]["per_adapter"])
    width = 0.4
    for k, (policy, color) in enumerate((("affinity", "C0"), ("random", "C1"))):
        per = target["median"][policy]["per_adapter"]
        p95s = [per[n]["p95"] for n in names]
        ax3.bar([i + (k - 0.5) * width for i in range(len(names))], p95s, width, color=color, label=f"{policy} p95")
        ax3.axhline(2 * statistics.median(p95s), color=color, linestyle=":", label=f"{policy}: 2x median adapter p95")
    ax3.set_ylim(0, 1.35 * ax3.get_ylim()[1])  # room for the legend above the 2x lines
    ax3.set_xticks(range(len(names)), [n.removeprefix("style-") for n in names])
    ax3.set_xlabel(f"adapter (Zipf s={ZIPF_S}, 1 = most popular)")
    ax3.set_ylabel("p95 latency (s)")
    ax3.set_title(f"offered load {target['load']}", fontsize=10)
    ax3.legend(fontsize=8)
    measured = {"load_s": results["setup"]["load_s"], "load": OVERLOAD,
                "median": next(s["median"] for s in sweep if s["load"] == OVERLOAD)} if OVERLOAD in x else None
    points = sorted([p for p in results["load_cost_sensitivity"] if p["load"] == OVERLOAD] + ([measured] if measured
                                                                                                 else []),
                    key=lambda p: p["load_s"])
    for policy, style in (("affinity", "o-"), ("random", "s--")):
        ax4.plot([p["load_s"] for p in points], [p["median"][policy]["throughput_vs_bound"] for p in points], style,
                 label=policy)
    ax4.axhline(0.9, color="red", linestyle=":", label="done-when 0.9")
    ax4.set_xlabel("seconds per adapter load")
    ax4.set_ylabel("throughput / no-adapter throughput")
    ax4.set_title(f"offered load {OVERLOAD} (saturated): capacity against load cost", fontsize=10)
    ax4.grid(True, alpha=0.3)
    ax4.legend()
    fig.suptitle(f"LoRA placement, simulated: {ADAPTERS} adapters, {DENOISERS} denoisers, LRU {LRU_CAPACITY}, "
                 f"denoise {results['setup']['denoise_s']} s, load {results['setup']['load_s']:.2f} s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main_run(args: argparse.Namespace) -> dict[str, Any]:
    cost = load_cost(args)
    costs = Costs(denoise_s=DENOISE_SECONDS, load_s=cost["load_s"])
    seeds = list(range(1, args.seeds + 1))
    sweep = [run_load(load, seeds, costs, args, args.plain_share) for load in args.loads]
    target = next((s for s in sweep if s["load"] == args.target), None) or run_load(
        args.target, seeds, costs, args, args.plain_share)
    out: dict[str, Any] = {
        "setup": {"denoisers": DENOISERS, "adapters": ADAPTERS, "zipf_s": ZIPF_S, "lru_capacity": LRU_CAPACITY,
                  "denoise_s": DENOISE_SECONDS, "load_s": costs.load_s, "ar_s": AR_SECONDS,
                  "ar_batch_max_outputs": AR_BATCH_MAX_OUTPUTS, "ar_inflight": AR_INFLIGHT,
                  "capacity_img_per_s": round(CAPACITY, 4), "warmup_s": args.warmup, "window_s": args.window,
                  "seeds": seeds, "plain_share": args.plain_share, "target_load": args.target,
                  "scheduler_lora_load_cost_initial": SchedulerConfig().lora_load_cost},
        "load_cost": cost, "target": target, "checks": checks(target),
        "sweep": [{k: v for k, v in s.items() if k != "runs"} for s in sweep],
    }
    if args.plain_extra > 0:
        extra = run_load(args.target, seeds, costs, args, args.plain_extra)
        out["target_with_plain"] = {k: v for k, v in extra.items() if k != "runs"}  # (medians suffice here)
    # How the answer moves with the load cost (slower storage, larger adapters): the target load and an overload.
    out["load_cost_sensitivity"] = []
    for load_s in args.sensitivity:
        other = Costs(denoise_s=DENOISE_SECONDS, load_s=load_s)
        for load in (args.target, OVERLOAD):
            r = run_load(load, seeds, other, args, args.plain_share)
            out["load_cost_sensitivity"].append({"load_s": load_s, "load": load, "median": r["median"],
                                                 "checks": checks(r) if load == args.target else None})
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--load-seconds", type=float, default=None,
                   help="one adapter load, reference seconds (default: the tiny model's measurement, scaled)")
    p.add_argument("--remeasure", action="store_true", help="measure the tiny model's loads again")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--warmup", type=float, default=600.0, help="virtual seconds before the measured window")
    p.add_argument("--window", type=float, default=4000.0, help="measured virtual seconds")
    p.add_argument("--target", type=float, default=TARGET_LOAD, help="offered load of the done-when's checks")
    p.add_argument("--loads", type=lambda s: [float(x) for x in s.split(",") if x], default=list(SWEEP),
                   help="comma-separated offered loads (shares of the no-adapter capacity) for the sweep")
    p.add_argument("--plain-share", type=float, default=0.0, help="share of plain requests in every run")
    p.add_argument("--plain-extra", type=float, default=0.25,
                   help="an extra run at the target load with this share of plain requests (0: none)")
    p.add_argument("--sensitivity", type=lambda s: [float(x) for x in s.split(",") if x], default=[1.0, 3.0, 6.0],
                   help="comma-separated load costs (s) also run at the target load and at an overload ('' skips)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    results = main_run(args)
    results["setup"]["sim_wall_s"] = round(time.perf_counter() - started, 1)
    write_result("lora_sim", results, "python -m bench.lora_sim " + " ".join(argv or sys.argv[1:]))
    png = RESULTS / "lora_sim.png"
    plot(results, png)
    print(f"wrote {png}")
    t = results["target"]["median"]
    print(json.dumps({p: {k: t[p][k] for k in ("throughput_vs_bound", "latency_p50", "latency_p95",
                                                "loads_per_request", "max_p95_over_median_adapter_p95",
                                                "max_p95_over_median_latency")} for p in POLICIES}, indent=2))
    print(json.dumps(results["checks"], indent=2))


if __name__ == "__main__":
    main()
