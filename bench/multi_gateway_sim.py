"""Several gateways over one simulated pool, at saturation (issue: several gateways over one denoiser pool).

`python -m bench.multi_gateway_sim` (from the repo root), for each scenario, starts:
- `python -m bench.sim_backends`: simulated AR servers and denoisers whose costs are the reference figures times the
  scenario's scale (AR batch 20.4-33.2 s by size, merging concurrent calls within the batch cap like the real AR
  server; denoise 12.2 s per image, one job at a time, publishing who holds it);
- G `python -m gateway` processes (`--ar-batch-max-outputs 28`, the gateway defaults otherwise: one AR batch in
  flight per AR server), each given every AR server and every denoiser and its own `--metrics-port`;
and drives GatewayService.GenerateImages (n=1) from this process with closed-loop clients spread evenly over the
gateways, the same total for 1, 2 and 4 gateways over one pool, so their latencies compare.

Scenarios: 1, 2 and 4 gateways over 1 AR + 14 denoisers (the reference pool), and 4 gateways over 8 AR + 112
denoisers. Bound = min(denoisers / 12.2, AR servers x 28 / T_ar(28)) images per reference second. Each gateway's
busy collisions and denoise dispatches are read from its Prometheus /metrics at the start and the end of the
measured window. All times are reported in reference seconds (wall time / scale). Writes
bench/results/multi_gateway_sim.json and bench/results/multi_gateway_sim.png.

With ``--base REV`` every run is paired with one whose gateways are those of an earlier revision (its gateway/ and
services/ packages, from git), the two in alternating order, so that both see the same machine load; each
scenario's summary then has the base's figures and the head/base ratios beside its own (collisions per dispatch
first: how often two gateways reached for the same free denoiser).
"""
from __future__ import annotations

import argparse
import asyncio
import bisect
import io
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import grpc
import psutil
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from bench.common import RESULTS, percentile, write_result
from bench.scheduler_sim import REQUEST, _spawn, _stop, _until_idle, _wait_file
from bench.sim_backends import DENOISE_SECONDS, ar_batch_seconds
from glmimage.v1 import gateway_service_pb2 as pb
from glmimage.v1 import gateway_service_pb2_grpc

AR_BATCH_MAX_OUTPUTS = 28
COLLISIONS = "glmimage_gateway_denoise_collisions_total"
DISPATCHES = "glmimage_gateway_denoise_dispatches_total"
AR_BATCHES, AR_OUTPUTS = "glmimage_gateway_ar_batch_size_count", "glmimage_gateway_ar_batch_size_sum"
SCRAPED = (COLLISIONS, DISPATCHES, AR_BATCHES, AR_OUTPUTS)


@dataclass(frozen=True)
class Scenario:
    gateways: int
    ar: int
    denoisers: int
    clients: int  # closed-loop clients in all, spread evenly over the gateways
    scale: float  # simulated time = reference time x scale
    warmup: float  # wall seconds before the measured window
    window: float  # measured wall seconds
    repeats: int
    probe_interval: float = 1.0  # the gateway's --health-probe-interval (its default: 1 s)

    @property
    def bound(self) -> float:
        """Images per reference second: the denoisers' rate or the AR servers' at full batches, the smaller."""
        return min(self.denoisers / DENOISE_SECONDS,
                   self.ar * AR_BATCH_MAX_OUTPUTS / ar_batch_seconds(AR_BATCH_MAX_OUTPUTS))


# Clients: a gateway keeps one full batch (28) in flight per AR server and needs the next 28 queued when it returns,
# while its last batch's outputs are still denoising: about 60 per gateway over one AR server, 72 leaves a margin. The
# 14-denoiser runs share one total (288) so their latencies compare at one offered load; scale 0.01 as the one-gateway
# simulation (bench/scheduler_sim.py). The 112-denoiser run is 8x the work per reference second: scale 0.1 keeps its
# wall rate (about 70 jobs/s) below the 14-denoiser runs' (about 87 jobs/s), so the 2 CPU cores are not the limit. Its
# 8 AR servers share each gateway's one queue, so fewer clients per AR server suffice; 40 per gateway and AR server
# left some gateway batches short of 28 (0.96-0.98 of the bound), 48 fills them. Its images complete in bursts of an
# AR batch: 45 s (450 reference s, about 110 batches) keeps the count within a couple of percent of the rate.
SCENARIOS: dict[str, Scenario] = {
    "g1_ar1_d14": Scenario(gateways=1, ar=1, denoisers=14, clients=288, scale=0.01, warmup=4.0, window=12.0,
                           repeats=2),
    "g2_ar1_d14": Scenario(gateways=2, ar=1, denoisers=14, clients=288, scale=0.01, warmup=4.0, window=12.0,
                           repeats=2),
    "g4_ar1_d14": Scenario(gateways=4, ar=1, denoisers=14, clients=288, scale=0.01, warmup=4.0, window=12.0,
                           repeats=2),
    "g4_ar8_d112": Scenario(gateways=4, ar=8, denoisers=112, clients=4 * 8 * 48, scale=0.1, warmup=15.0,
                            window=45.0, repeats=3),
}
SINGLE = "g1_ar1_d14"  # what the 14-denoiser latencies are compared with


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name in SCRAPED}


def cpu_seconds(pids: list[int]) -> list[float]:
    out = []
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
            out.append(t.user + t.system)
        except psutil.Error:
            out.append(float("nan"))
    return out


async def closed_loop(stubs: list[gateway_service_pb2_grpc.GatewayServiceStub], sc: Scenario,
                      on_start, on_end) -> tuple[list[tuple[float, float, int]], int, float, float]:
    """sc.clients clients, client i on gateway i % G, each sending its next request when the previous one returns.
    Returns (end, latency, gateway) of every request, the errors by code (with the first message of each), and
    the window's wall bounds; ``on_start`` and
    ``on_end`` run at the window's edges (while the load runs)."""
    start = time.monotonic()
    t0, t1 = start + sc.warmup, start + sc.warmup + sc.window
    ramp = ar_batch_seconds(AR_BATCH_MAX_OUTPUTS) * sc.scale
    done: list[tuple[float, float, int]] = []
    errors: dict[str, list] = {}  # code -> [count, first message]

    async def client(i: int) -> None:
        g = i % len(stubs)
        await asyncio.sleep(random.Random(i).uniform(0, ramp))  # arrivals spread over one AR batch time
        while True:
            began = time.monotonic()
            try:
                await stubs[g].GenerateImages(pb.GenerateImagesRequest(n=1, seed=i, **REQUEST), timeout=600)
            except grpc.aio.AioRpcError as exc:
                seen = errors.setdefault(exc.code().name, [0, f"gateway {g}: {exc.details()}"])
                seen[0] += 1
                if seen[0] == 1:
                    print(f"error on gateway {g}: {exc.code().name}: {exc.details()}", flush=True)
                await asyncio.sleep(0.05)
                continue
            end = time.monotonic()
            done.append((end, end - began, g))

    tasks = [asyncio.ensure_future(client(i)) for i in range(sc.clients)]
    await asyncio.sleep(t0 - time.monotonic())
    await on_start()
    await asyncio.sleep(t1 - time.monotonic())
    await on_end()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return done, errors, t0, t1


def gateways_at(rev: str, workdir: Path) -> tuple[Path, str]:
    """A directory holding the gateway/ and services/ packages as of ``rev``, with the protocol package they import
    (clients/python: the stubs and glmimage.wire move between revisions), and the commit ``rev`` names."""
    def git(*args: str) -> bytes:
        return subprocess.run(["git", *args], cwd=RESULTS.parents[1], capture_output=True, check=True).stdout

    commit = git("rev-parse", "--verify", f"{rev}^{{commit}}").decode().strip()
    root = workdir / f"base-{commit[:10]}"
    with tarfile.open(fileobj=io.BytesIO(git("archive", commit, "gateway", "services", "clients/python"))) as tar:
        tar.extractall(root, filter="data")
    return root, commit


def _spawn_gateway(argv: list[str], root: Path | None) -> subprocess.Popen:
    """``python -m gateway`` of this checkout, or (``root``) of the packages under ``root``."""
    if root is None:
        return _spawn(["gateway", *argv])
    return subprocess.Popen([sys.executable, "-m", "gateway", *argv], cwd=root,
                            env={**os.environ, "PYTHONUNBUFFERED": "1",
                                 "PYTHONPATH": os.pathsep.join([str(root), str(root / "clients" / "python")])})


async def run_once(sc: Scenario, workdir: Path, tag: str, root: Path | None = None) -> dict:
    ready, stats_file = workdir / f"{tag}-sim.json", workdir / f"{tag}-stats.json"
    sim = _spawn(["bench.sim_backends", "--ar", str(sc.ar), "--denoisers", str(sc.denoisers), "--scale",
                  str(sc.scale), "--ar-batch-cap", str(AR_BATCH_MAX_OUTPUTS), "--ar-stagger",
                  "--ready-file", str(ready), "--stats-file", str(stats_file)])
    gateways: list = []
    try:
        addresses = json.loads(await _wait_file(ready, sim))
        workers = len(addresses["ar"]) + len(addresses["denoisers"])
        metric_ports = [free_port() for _ in range(sc.gateways)]
        for g, mport in enumerate(metric_ports):
            port_file = workdir / f"{tag}-gateway{g}.port"
            gateways.append((_spawn_gateway([
                "--port", "0", "--port-file", str(port_file), "--metrics-port", str(mport),
                "--log-level", "ERROR", *[f"--ar={a}" for a in addresses["ar"]],
                *[f"--denoiser={d}" for d in addresses["denoisers"]],
                "--ar-batch-max-outputs", str(AR_BATCH_MAX_OUTPUTS), "--max-queued-outputs", "8192",
                "--request-timeout", "600", "--health-probe-interval", str(sc.probe_interval)], root), port_file))
        ports = [int(await _wait_file(f, proc)) for proc, f in gateways]
        channels = [grpc.aio.insecure_channel(f"127.0.0.1:{p}") for p in ports]
        try:
            for channel in channels:
                await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service="glmimage.v1.GatewayService"), wait_for_ready=True,
                    timeout=60)
            stubs = [gateway_service_pb2_grpc.GatewayServiceStub(c) for c in channels]
            for stub in stubs:
                await _until_idle(stub, workers)
            pids = [proc.pid for proc, _ in gateways]
            marks: dict[str, tuple] = {}

            async def mark(name: str) -> None:
                scraped = await asyncio.gather(*(asyncio.to_thread(scrape, p) for p in metric_ports))
                marks[name] = (time.monotonic(), scraped, cpu_seconds(pids), cpu_seconds([sim.pid])[0],
                               sum(cpu_seconds([psutil.Process().pid])), psutil.cpu_times())

            done, errors, t0, t1 = await closed_loop(stubs, sc, lambda: mark("start"), lambda: mark("end"))
        finally:
            for channel in channels:
                await channel.close()
    finally:
        for proc, _ in gateways:
            _stop(proc)
        _stop(sim)
    stats = json.loads(stats_file.read_text()) if stats_file.exists() else {}
    return summarise(sc, done, errors, t0, t1, marks, stats)


def summarise(sc: Scenario, done: list[tuple[float, float, int]], errors: dict[str, list], t0: float, t1: float,
              marks: dict[str, tuple], stats: dict) -> dict:
    counted = [(lat, g) for end, lat, g in done if t0 <= end < t1]
    latencies = [lat / sc.scale for lat, _ in counted]
    throughput = len(counted) / sc.window * sc.scale
    per_gateway = [sum(1 for _, g in counted if g == i) for i in range(sc.gateways)]
    shares = [n / max(len(counted), 1) for n in per_gateway]
    (w0, m0, gw0, sim0, me0, all0), (w1, m1, gw1, sim1, me1, all1) = marks["start"], marks["end"]
    wall = w1 - w0
    collisions, dispatches, ar_batches, ar_sent = (
        [b.get(name, 0) - a.get(name, 0) for a, b in zip(m0, m1, strict=True)] for name in SCRAPED)
    busy = sum(getattr(all1, f) - getattr(all0, f) for f in ("user", "system", "nice", "irq", "softirq"))
    total = busy + (all1.idle - all0.idle) + (getattr(all1, "iowait", 0) - getattr(all0, "iowait", 0))
    ar = stats.get("ar", [])
    sim_batches, sim_outputs = sum(a["batches"] for a in ar), sum(a["outputs"] for a in ar)
    return {
        "requests": len(counted), "images": len(counted), "errors": sum(n for n, _ in errors.values()),
        "errors_by_code": {code: {"count": n, "first": first} for code, (n, first) in errors.items()},
        "throughput": round(throughput, 4), "throughput_vs_bound": round(throughput / sc.bound, 4),
        "latency_mean": round(statistics.fmean(latencies), 2) if latencies else float("nan"),
        "latency_p95": round(percentile(latencies, 0.95), 2),
        "collisions": int(sum(collisions)), "dispatches": int(sum(dispatches)),
        "collisions_per_dispatch": round(sum(collisions) / max(sum(dispatches), 1), 4),
        "per_gateway": {"images": per_gateway, "share": [round(s, 4) for s in shares],
                        "collisions": [int(c) for c in collisions], "dispatches": [int(d) for d in dispatches],
                        # AR batches each gateway sent in the window, and their mean size (its own, before merging)
                        "ar_batches": [int(b) for b in ar_batches],
                        "ar_batch_mean": [round(o / b, 1) if b else None for o, b in zip(ar_sent, ar_batches,
                                                                                          strict=True)]},
        "share_min": round(min(shares), 4), "share_max": round(max(shares), 4),
        "cpu_per_wall_s": {"gateways": [round((b - a) / wall, 3) for a, b in zip(gw0, gw1, strict=True)],
                           "sim_backends": round((sim1 - sim0) / wall, 3), "load_client": round((me1 - me0) / wall, 3),
                           "machine_busy_fraction": round(busy / total, 3) if total > 0 else None},
        # Over the whole run (warm-up too): how full the simulated model batches were.
        "ar_outputs_per_batch": round(sim_outputs / sim_batches, 2) if sim_batches else None,
        "ar_merged_calls": sum(a["merged_calls"] for a in ar), "ar_calls": sum(a["calls"] for a in ar),
        "ar_phase_gap": phase_gap([a.get("started", []) for a in ar], sc.scale),
        "denoiser_max_jobs_at_once": stats.get("denoisers", {}).get("max_holding"),
        "denoiser_refused_busy": stats.get("denoisers", {}).get("refused_busy"),
        # Wall ms from the holder taking a refusing denoiser to the refusal (over the whole run).
        "refused_after_ms": refusal_quantiles(stats.get("denoisers", {}).get("refused_after_s", [])),
        "sim_loop_lag_ms": lag_quantiles(stats.get("loop_lag_s", [])),
    }


def refusal_quantiles(after: list[list[float | None]]) -> dict | None:
    """Per busy refusal, at the denoiser: wall ms since the job holding it took the slot; the share of refusals
    whose holder took the denoiser within 5 ms of its last job ending (a race for a denoiser just freed); the share
    sent by a gateway whose occupancy stream had already been written the busy state, and how long before."""
    if not after:
        return None
    since = [a for a, _, _ in after]
    told = [c for _, _, c in after if c is not None]
    out = {"p10": round(percentile(since, 0.1) * 1000, 1), "p50": round(percentile(since, 0.5) * 1000, 1),
           "p90": round(percentile(since, 0.9) * 1000, 1),
           "holder_took_it_within_5ms_of_free": round(sum(gap < 0.005 for _, gap, _ in after) / len(after), 3),
           "busy_already_sent_to_the_refused": round(len(told) / len(after), 3)}
    if told:
        out["sent_before_refusal_p50"] = round(percentile(told, 0.5) * 1000, 1)
        out["sent_before_refusal_p90"] = round(percentile(told, 0.9) * 1000, 1)
    return out


def phase_gap(started: list[list[float]], scale: float) -> float | None:
    """How far apart the AR servers run: the median, over batches, of the reference seconds from a batch's start to
    the nearest start on another AR server, as a share of the batch time at the cap (evenly spread: 1 / AR servers;
    0: in lockstep, every server returning its batches at once)."""
    if len(started) < 2 or not all(started):
        return None
    gaps = []
    for i, mine in enumerate(started):
        others = sorted(t for j, ts in enumerate(started) if j != i for t in ts)
        for t in mine:
            k = bisect.bisect_left(others, t)
            gaps.append(min(abs(t - others[m]) for m in (k - 1, k) if 0 <= m < len(others)))
    return round(statistics.median(gaps) / scale / ar_batch_seconds(AR_BATCH_MAX_OUTPUTS), 3)


def lag_quantiles(lags: list[float]) -> dict | None:
    if not lags:
        return None
    return {q: round(percentile(lags, v) * 1000, 1) for q, v in (("p50", 0.5), ("p99", 0.99))} | {
        "max": round(max(lags) * 1000, 1)}


def median_of(runs: list[dict], key: str) -> float:
    return round(float(statistics.median(r[key] for r in runs)), 4)


def summary_of(name: str, sc: Scenario, runs: list[dict], single: dict | None) -> dict:
    out = {k: median_of(runs, k) for k in ("throughput", "throughput_vs_bound", "latency_mean", "latency_p95",
                                           "collisions_per_dispatch", "share_min", "share_max")}
    out["throughput_vs_bound_range"] = [min(r["throughput_vs_bound"] for r in runs),
                                        max(r["throughput_vs_bound"] for r in runs)]
    out["errors"] = sum(r["errors"] for r in runs)
    out["ar_outputs_per_batch"] = median_of(runs, "ar_outputs_per_batch") if all(
        r["ar_outputs_per_batch"] for r in runs) else None
    if single is not None and name != SINGLE and sc.denoisers == SCENARIOS[SINGLE].denoisers:
        out["latency_mean_vs_single"] = round(out["latency_mean"] / single["latency_mean"], 3)
        out["latency_p95_vs_single"] = round(out["latency_p95"] / single["latency_p95"], 3)
    refused = [r["refused_after_ms"] for r in runs if r["refused_after_ms"]]
    if refused:
        out["refused_after_ms"] = {k: round(float(statistics.median(x[k] for x in refused)), 3) for k in refused[0]}
    lags = [r["sim_loop_lag_ms"] for r in runs if r["sim_loop_lag_ms"]]
    if lags:
        out["sim_loop_lag_ms"] = {k: round(float(statistics.median(x[k] for x in lags)), 1) for k in lags[0]}
    out["gateway_cpu_per_wall_s_max"] = max(max(r["cpu_per_wall_s"]["gateways"]) for r in runs)
    out["sim_cpu_per_wall_s"] = median_of([r["cpu_per_wall_s"] for r in runs], "sim_backends")
    out["machine_busy_fraction"] = median_of([r["cpu_per_wall_s"] for r in runs], "machine_busy_fraction")
    return out


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["scenarios"])
    labels = [f"{s['gateways']} gw\n{s['ar']} AR, {s['denoisers']} dn" for s in
              (results["scenarios"][n]["setup"] for n in names)]
    x = range(len(names))
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(14, 4.2))
    for i, name in enumerate(names):
        sc = results["scenarios"][name]
        ax1.bar(i, sc["summary"]["throughput_vs_bound"], color="tab:blue", alpha=0.7)
        ax1.plot([i] * len(sc["runs"]), [r["throughput_vs_bound"] for r in sc["runs"]], "k.")
        ax2.bar(i - 0.2, sc["summary"]["latency_mean"], 0.4, color="tab:green", alpha=0.7,
                label="mean" if i == 0 else None)
        ax2.bar(i + 0.2, sc["summary"]["latency_p95"], 0.4, color="tab:olive", alpha=0.7,
                label="p95" if i == 0 else None)
        ax3.bar(i, sc["summary"]["collisions_per_dispatch"], color="tab:red", alpha=0.7)
        ax3.plot([i] * len(sc["runs"]), [r["collisions_per_dispatch"] for r in sc["runs"]], "k.")
        ax3.annotate(f"{sc['summary']['collisions_per_dispatch']:.3f}", (i, sc["summary"]["collisions_per_dispatch"]),
                     ha="center", va="bottom", xytext=(0, 3), textcoords="offset points")
    worst = max(r["collisions_per_dispatch"] for sc in results["scenarios"].values() for r in sc["runs"])
    ax3.set_ylim(0, max(0.05, 1.25 * worst))
    ax1.axhline(0.95, color="grey", linestyle=":", label="target 0.95")
    ax1.set_ylim(0, 1.1)
    ax1.set_ylabel("throughput / bound (bars: median, dots: runs)")
    ax2.set_ylabel("latency (s, reference time)")
    ax3.set_ylabel("busy collisions per denoise dispatch (dots: runs)")
    for ax in (ax1, ax2, ax3):
        ax.set_xticks(list(x), labels)
        ax.grid(True, axis="y", alpha=0.3)
    ax1.legend(loc="lower right")
    ax2.legend()
    fig.suptitle("Several gateways over one simulated pool at saturation (n=1, closed loop, batch cap 28)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _line(name: str, k: int, r: dict, side: str = "") -> str:
    cpu = r["cpu_per_wall_s"]
    return (f"[{name} #{k + 1}{side}] {r['throughput']:.3f} img/s = {r['throughput_vs_bound']:.3f} of bound, "
            f"latency mean {r['latency_mean']:.1f} s p95 {r['latency_p95']:.1f} s, collisions/dispatch "
            f"{r['collisions_per_dispatch']:.4f} ({r['collisions']}/{r['dispatches']}), shares "
            f"{r['per_gateway']['share']}, errors {r['errors']}, AR outputs/batch {r['ar_outputs_per_batch']}, CPU/s "
            f"gateways {cpu['gateways']} sim {cpu['sim_backends']} client {cpu['load_client']} machine busy "
            f"{cpu['machine_busy_fraction']}")


async def main_async(args: argparse.Namespace) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="multi-gateway-sim-"))
    base_root, base_commit = gateways_at(args.base, workdir) if args.base else (None, None)
    scenarios: dict[str, dict] = {}
    used: dict[str, Scenario] = {}
    for name in args.scenarios:
        base = SCENARIOS[name]
        sc = used[name] = replace(base, window=base.window * args.window_factor,
                                  warmup=base.warmup * args.window_factor, repeats=args.repeats or base.repeats,
                                  clients=args.clients or base.clients, scale=args.scale or base.scale)
        runs, base_runs = [], []
        for k in range(sc.repeats):
            # With a base: head and base in turn, which one first alternating, so load drift favours neither.
            sides = [("", None)] if base_root is None else [("", None), (" base", base_root)]
            for side, root in sides if k % 2 == 0 else sides[::-1]:
                r = await run_once(sc, workdir, f"{name}-{k}{side.strip()}", root)
                (base_runs if root else runs).append(r)
                print(_line(name, k, r, side), flush=True)
        scenarios[name] = {"setup": {**asdict(sc), "bound_img_per_s": round(sc.bound, 4),
                                     "clients_per_gateway": sc.clients // sc.gateways}, "runs": runs}
        if base_runs:
            scenarios[name]["base"] = {"rev": args.base, "commit": base_commit, "runs": base_runs}
    single = None
    if SINGLE in scenarios:
        single = summary_of(SINGLE, used[SINGLE], scenarios[SINGLE]["runs"], None)
    for name, s in scenarios.items():
        s["summary"] = summary_of(name, used[name], s["runs"], single)
        if "base" in s:
            b = s["base"]["summary"] = summary_of(name, used[name], s["base"]["runs"], None)
            s["summary"]["vs_base"] = {
                "collisions_per_dispatch": [s["summary"]["collisions_per_dispatch"], b["collisions_per_dispatch"]],
                "throughput_vs_bound": [s["summary"]["throughput_vs_bound"], b["throughput_vs_bound"]],
                "latency_mean": [s["summary"]["latency_mean"], b["latency_mean"]]}
    targets = {f"{name}: >= 0.95 of bound": s["summary"]["throughput_vs_bound"] >= 0.95
               for name, s in scenarios.items()}
    targets["no errors"] = all(s["summary"]["errors"] == 0 for s in scenarios.values())
    return {"setup": {"ar_batch_max_outputs": AR_BATCH_MAX_OUTPUTS, "n": 1,
                      "units": "reference seconds (wall seconds / scale)",
                      "ar_merge": "simulated AR merges concurrent calls, 2 ms window, cap 28 (bench.sim_backends)",
                      "summary_is": "median over a scenario's runs"},
            "targets_met": targets, "scenarios": scenarios}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenarios", type=lambda s: [x for x in s.split(",") if x], default=list(SCENARIOS),
                   help=f"comma-separated subset of {', '.join(SCENARIOS)}")
    p.add_argument("--window-factor", type=float, default=1.0, help="multiplier on each warm-up and window")
    p.add_argument("--repeats", type=int, default=0, help="runs per scenario (0: each scenario's own)")
    p.add_argument("--scale", type=float, default=0.0,
                   help="simulated time / reference time in every scenario (0: each scenario's own); the warm-up "
                        "and window stay in wall seconds")
    p.add_argument("--clients", type=int, default=0, help="total clients (0: each scenario's own)")
    p.add_argument("--base", metavar="REV", help="pair every run with one whose gateways are those of this git "
                   "revision, and report both side by side")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    results = asyncio.run(main_async(args))
    write_result("multi_gateway_sim", results, "python -m bench.multi_gateway_sim " + " ".join(argv or sys.argv[1:]))
    png = RESULTS / "multi_gateway_sim.png"
    plot(results, png)
    print(f"wrote {png}")
    for name, s in results["scenarios"].items():
        if "vs_base" in s["summary"]:
            print(f"{name}: [head, base] " + ", ".join(f"{k} {v}" for k, v in s["summary"]["vs_base"].items()))
    print(json.dumps({"summary": {k: s["summary"] for k, s in results["scenarios"].items()},
                      "targets_met": results["targets_met"]}, indent=2))


if __name__ == "__main__":
    main()
