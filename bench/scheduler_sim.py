"""Scheduler benchmark: the real gateway against simulated backends (issue 5, "make bench scheduler part").

`python -m bench.scheduler_sim` (from the repo root) starts:
- `python -m bench.sim_backends`: 1 simulated AR server and 14 simulated denoisers whose costs are the reference
  figures scaled down 100x (AR batch 20.4-33.2 s by size, one batch at a time; denoise 12.2 s per image);
- `python -m gateway` (driver + scheduler + GatewayService, `--ar-batch-max-outputs 28`) twice, one policy at a time:
  ``ours`` (n outputs fan out to n denoisers) and ``baseline`` (`--outputs serial`: the reference deployment's
  policy, a request's outputs one after another; both keep one AR batch in flight, the gateway default);
and drives GatewayService.GenerateImages with closed-loop clients from this process.

All times are reported in reference seconds (measured wall time x 100), so they compare with DESIGN.md's figures.
Writes bench/results/scheduler_sim.json and bench/results/scheduler_sim.png.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.common import RESULTS, percentile, write_result
from bench.sim_backends import ar_batch_seconds
from glmimage.v1 import gateway_service_pb2 as pb
from glmimage.v1 import gateway_service_pb2_grpc

SCALE = 0.01  # simulated time = reference time x SCALE
DENOISERS = 14
AR_BATCH_MAX_OUTPUTS = 28
BOUND = min(DENOISERS / 12.2, AR_BATCH_MAX_OUTPUTS / ar_batch_seconds(AR_BATCH_MAX_OUTPUTS))  # img/s, reference
POLICIES = {"ours": "fan-out", "baseline": "serial"}
LOADS = {  # name -> (closed-loop clients, n drawn uniformly from, measured wall seconds)
    "saturation_160_n1": (160, (1,), 10.0),
    # Few clients with random n: the longest window, or the ratio is mostly noise.
    "mixed_8_n124": (8, (1, 2, 4), 24.0),
    "reference_56_n1": (56, (1,), 10.0),
}
SWEEP = (1, 2, 4, 8, 16, 32, 56, 112, 160)
SWEEP_NS = (1, 2, 4)
REQUEST = dict(prompt='a red "STOP" sign', height=1024, width=1024)


@dataclass
class LoadResult:
    clients: int
    ns: tuple[int, ...]
    window_s: float  # measurement window, wall seconds
    requests: int
    images: int
    errors: int
    throughput: float  # images per reference second
    throughput_vs_bound: float
    latency_mean: float  # reference seconds
    latency_p95: float


async def _wait_file(path: Path, proc: subprocess.Popen, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[2]} exited with {proc.returncode} during start-up")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{proc.args[2]} did not start in {timeout:.0f}s")
        await asyncio.sleep(0.05)
    return path.read_text()


def _spawn(argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", *argv], env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def _status(stub: gateway_service_pb2_grpc.GatewayServiceStub) -> pb.GetStatusResponse:
    return await stub.GetStatus(pb.GetStatusRequest(), timeout=10)


async def _until_idle(stub: gateway_service_pb2_grpc.GatewayServiceStub, workers: int, timeout: float = 60.0) -> None:
    """Every worker healthy and free, nothing queued: each measurement starts from the same state."""
    deadline = time.monotonic() + timeout
    while True:
        s = await _status(stub)
        free = sum(w.state == pb.WORKER_STATE_AVAILABLE for w in s.workers)
        if free == workers and s.active_requests == 0:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"gateway not idle: {s}")
        await asyncio.sleep(0.05)


async def closed_loop(stub: gateway_service_pb2_grpc.GatewayServiceStub, clients: int, ns: tuple[int, ...],
                      warmup: float, window: float, seed: int) -> LoadResult:
    """``clients`` clients, each sending its next request when the previous one returns. Requests completed in
    the window after the warm-up are counted; at the end the outstanding ones are cancelled."""
    start = time.monotonic()
    t0, t1 = start + warmup, start + warmup + window
    done: list[tuple[float, float, int]] = []  # (end, latency, n)
    errors = 0

    async def client(i: int) -> None:
        nonlocal errors
        rng = random.Random(seed * 7919 + i)
        while True:
            n = rng.choice(ns)
            began = time.monotonic()
            try:
                await stub.GenerateImages(pb.GenerateImagesRequest(n=n, seed=i, **REQUEST), timeout=600)
            except grpc.aio.AioRpcError:
                errors += 1
                continue
            end = time.monotonic()
            done.append((end, end - began, n))

    tasks = [asyncio.ensure_future(client(i)) for i in range(clients)]
    await asyncio.sleep(t1 - time.monotonic())  # the load runs for a fixed time: that is the measurement
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    counted = [(lat, n) for end, lat, n in done if t0 <= end < t1]
    images = sum(n for _, n in counted)
    latencies = [lat / SCALE for lat, _ in counted]
    throughput = images / window * SCALE
    return LoadResult(clients=clients, ns=ns, window_s=window, requests=len(counted), images=images, errors=errors,
                      throughput=round(throughput, 4), throughput_vs_bound=round(throughput / BOUND, 4),
                      latency_mean=round(statistics.fmean(latencies), 2) if latencies else float("nan"),
                      latency_p95=round(percentile(latencies, 0.95), 2))


async def idle_latency(stub: gateway_service_pb2_grpc.GatewayServiceStub, workers: int, repeats: int) -> dict:
    """One request at a time on an idle pool: n=4 against n=1."""
    lat: dict[int, list[float]] = {1: [], 4: []}
    for i in range(repeats):
        for n in (1, 4):
            await _until_idle(stub, workers)
            began = time.monotonic()
            await stub.GenerateImages(pb.GenerateImagesRequest(n=n, seed=i, **REQUEST), timeout=60)
            lat[n].append((time.monotonic() - began) / SCALE)
    m1, m4 = statistics.fmean(lat[1]), statistics.fmean(lat[4])
    return {"n1_mean": round(m1, 2), "n4_mean": round(m4, 2), "n4_over_n1": round(m4 / m1, 3)}


async def run_policy(policy: str, addresses: dict, workdir: Path, args: argparse.Namespace) -> dict:
    port_file = workdir / f"gateway-{policy}.port"
    argv = ["gateway", "--port", "0", "--port-file", str(port_file), "--log-level", "WARNING",
            "--ar", *addresses["ar"], *[f"--denoiser={d}" for d in addresses["denoisers"]],
            "--ar-batch-max-outputs", str(AR_BATCH_MAX_OUTPUTS), "--max-queued-outputs", "4096",
            "--request-timeout", "600", "--outputs", POLICIES[policy]]
    proc = _spawn(argv)
    try:
        port = int(await _wait_file(port_file, proc))
        workers = len(addresses["ar"]) + len(addresses["denoisers"])
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            await health.Check(health_pb2.HealthCheckRequest(service="glmimage.v1.GatewayService"),
                               wait_for_ready=True, timeout=30)
            stub = gateway_service_pb2_grpc.GatewayServiceStub(channel)
            await _until_idle(stub, workers)
            out: dict = {"loads": {}, "sweep": []}
            out["idle_n4_vs_n1"] = await idle_latency(stub, workers, args.idle_repeats)
            print(f"[{policy}] idle pool: {out['idle_n4_vs_n1']}", flush=True)
            for name in args.loads:
                clients, ns, window = LOADS[name]
                await _until_idle(stub, workers)
                r = await closed_loop(stub, clients, ns, args.warmup, window * args.window_factor, seed=1)
                out["loads"][name] = asdict(r)
                print(f"[{policy}] {name}: {r.throughput:.3f} img/s = {r.throughput_vs_bound:.3f} of bound, "
                      f"latency mean {r.latency_mean:.1f} s p95 {r.latency_p95:.1f} s, errors {r.errors}",
                      flush=True)
            for clients in args.sweep:
                await _until_idle(stub, workers)
                r = await closed_loop(stub, clients, SWEEP_NS, args.sweep_warmup, args.sweep_window, seed=2)
                out["sweep"].append(asdict(r))
                print(f"[{policy}] sweep c={clients}: {r.throughput:.3f} img/s, mean {r.latency_mean:.1f} s",
                      flush=True)
        return out
    finally:
        _stop(proc)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for policy, style in (("ours", "o-"), ("baseline", "s--")):
        sweep = results["policies"][policy]["sweep"]
        x = [r["clients"] for r in sweep]
        ax1.plot(x, [r["throughput"] for r in sweep], style, label=policy)
        ax2.plot(x, [r["latency_mean"] for r in sweep], style, label=policy)
    ax1.axhline(BOUND, color="grey", linestyle=":", label=f"bound {BOUND:.3f} img/s")
    for ax, ylabel in ((ax1, "throughput (img/s, reference time)"), (ax2, "mean latency (s, reference time)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(SWEEP, [str(c) for c in SWEEP])
        ax.set_xlabel("closed-loop clients (n from {1, 2, 4})")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle("Gateway scheduler, simulated backends (reference costs / 100): 1 AR, 14 denoisers, batch cap 28")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


async def main_async(args: argparse.Namespace) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="scheduler-sim-"))
    ready = workdir / "sim.json"
    sim = _spawn(["bench.sim_backends", "--denoisers", str(DENOISERS), "--scale", str(SCALE),
                  "--ready-file", str(ready)])
    try:
        addresses = json.loads(await _wait_file(ready, sim))
        policies = {policy: await run_policy(policy, addresses, workdir, args) for policy in POLICIES}
    finally:
        _stop(sim)
    ours, base = policies["ours"], policies["baseline"]
    summary = {}
    for name in LOADS:
        o, b = ours["loads"][name], base["loads"][name]
        summary[name] = {
            "throughput_vs_bound": o["throughput_vs_bound"],
            "throughput_ours_over_baseline": round(o["throughput"] / b["throughput"], 3),
            "mean_latency_ours_over_baseline": round(o["latency_mean"] / b["latency_mean"], 3),
            "latency_mean": o["latency_mean"], "latency_p95": o["latency_p95"],
            "baseline_latency_mean": b["latency_mean"], "baseline_latency_p95": b["latency_p95"],
        }
    summary["idle_n4_over_n1"] = ours["idle_n4_vs_n1"]["n4_over_n1"]
    targets = {
        "saturation >= 0.95 of bound": summary["saturation_160_n1"]["throughput_vs_bound"] >= 0.95,
        "8 clients mixed n: >= 1.2x baseline throughput": (
            summary["mixed_8_n124"]["throughput_ours_over_baseline"] >= 1.2),
        "8 clients mixed n: <= 0.85x baseline mean latency": (
            summary["mixed_8_n124"]["mean_latency_ours_over_baseline"] <= 0.85),
        "idle n=4 / n=1 latency <= 1.3": summary["idle_n4_over_n1"] <= 1.3,
    }
    return {"setup": {"scale": SCALE, "denoisers": DENOISERS, "ar_servers": 1,
                      "ar_batch_max_outputs": AR_BATCH_MAX_OUTPUTS, "bound_img_per_s": round(BOUND, 4),
                      "units": "reference seconds (wall x 100)", "warmup_s": args.warmup,
                      "sweep_n": SWEEP_NS},
            "summary": summary, "targets_met": targets, "policies": policies}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--warmup", type=float, default=3.0, help="wall seconds before each load's window")
    p.add_argument("--window-factor", type=float, default=1.0, help="multiplier on each load's measured window")
    p.add_argument("--sweep-warmup", type=float, default=1.5)
    p.add_argument("--sweep-window", type=float, default=5.0)
    p.add_argument("--sweep", type=lambda s: [int(x) for x in s.split(",") if x], default=list(SWEEP),
                   help="comma-separated client counts ('' skips the sweep)")
    p.add_argument("--idle-repeats", type=int, default=6)
    p.add_argument("--loads", type=lambda s: [x for x in s.split(",") if x], default=list(LOADS),
                   help=f"comma-separated subset of {', '.join(LOADS)} (the summary needs all of them)")
    args = p.parse_args(argv)
    results = asyncio.run(main_async(args))
    write_result("scheduler_sim", results, "python -m bench.scheduler_sim " + " ".join(argv or sys.argv[1:]))
    if results["policies"]["ours"]["sweep"]:
        png = RESULTS / "scheduler_sim.png"
        plot(results, png)
        print(f"wrote {png}")
    print(json.dumps({"summary": results["summary"], "targets_met": results["targets_met"]}, indent=2))


if __name__ == "__main__":
    main()
