"""Rolling restarts under load (issue 32): the whole stack rolled role by role, twice, then each role SIGKILLed once.

`python -m services.launcher` (what `make run` starts) on the tiny model, on ports it picks: one AR, two denoisers,
two gateways (the launcher gives them --queue-without-workers, so that requests wait for the lone AR instead of
failing fast while it restarts) and the REST front over both. Four client threads send back-to-back requests through
the REST front: a mix of generations (n=1..3, 64x64 or 128x128) and edits of a small reference. After a quiet phase,
`python -m services.launcher ctl restart ROLE` rolls each role in turn (ar, denoiser, gateway, rest), twice; then one
server of each role is SIGKILLed (the launcher starts it again). Each restart is a window; a request belongs to every
window its run overlaps.

Printed: requests sent, failed, retried by whom (the REST front's resubmits and mid-stream reruns, counted from its
log by request id; the gateways' requeues, from their /metrics; the client's own retries: only a connection refused,
where nothing was sent, and only with --client-retries refused; by default the client retries nothing, so every
failure shows), and per window the p95 latency against the quiet
p95. Exit 1 if any request failed during a SIGTERM restart (the issue's done-when), or during the SIGKILL of an AR
or a denoiser; failures while the REST front or a gateway is SIGKILLed are reported, per role, not fatal (that work
was inside the killed process). Run: .venv/bin/python -m bench.rolling [--quick]
"""
from __future__ import annotations

import argparse
import io
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from PIL import Image

from bench.common import percentile, write_result

ROLES = ("ar", "denoiser", "gateway", "rest")
# A SIGKILL loses what was inside the process; for these roles the suite must redo it (the gateway replays a dead
# worker's work), so no request may fail.
KILL_MUST_NOT_FAIL = ("ar", "denoiser")
REQUEST_TIMEOUT_S = 180.0
# A client pauses this long after a failure or a refused connection, so that a server down for seconds is tried some
# tens of times, not spun on.
PAUSE_S = 0.1
FAILURES_KEPT = 20  # per window, in the result file and the printout: the first ones, with their request ids
# The REST front's own retries, as its log says them (rest/upstream.py, rest/streaming.py).
RESUBMIT = re.compile(r"(\S+) gateway unavailable before answering; resubmitting")
RERUN = re.compile(r"(\S+) gateway went away mid-stream")


@dataclass
class Outcome:
    """One request as the client saw it: monotonic start and end, and the error if it failed."""

    rid: str
    kind: str  # "generate n=2 128" or "edit 64"
    start: float
    end: float
    error: str | None = None
    client_retries: int = 0  # refused connections retried (only with --client-retries refused)

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass
class Window:
    """One restart: what was restarted, how, from when to when (monotonic), and what the launcher said."""

    label: str  # "round 1: ctl restart denoiser", "SIGKILL gateway-2"
    role: str
    how: str  # "sigterm" or "sigkill"
    start: float
    end: float = 0.0
    said: str = ""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--quiet", type=float, default=40.0, help="seconds of load before the first restart")
    p.add_argument("--gap", type=float, default=8.0, help="seconds of load between two restarts")
    p.add_argument("--rounds", type=int, default=2, help="how many times every role is rolled (ctl restart)")
    p.add_argument("--roles", default=",".join(ROLES), help="the roles rolled and killed, in this order")
    p.add_argument("--no-kill", action="store_true", help="leave out the SIGKILL phase")
    p.add_argument("--edit-share", type=float, default=0.3, help="the share of requests that are edits")
    p.add_argument("--client-retries", choices=("none", "refused"), default="none",
                   help="none (default): every error is a failure; refused: retry a connection the REST front "
                        "refused (nothing was sent, so nothing can be lost or doubled: for a stack whose lone REST "
                        "front listens on nothing while it restarts), counted in the table")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: 10 s quiet, one ctl restart of one denoiser, no SIGKILL, no result file")
    p.add_argument("--run-dir", type=Path, default=None, help="where the ready file and the stack's log go")
    a = p.parse_args(argv)
    a.roles = [r for r in a.roles.split(",") if r]
    unknown = sorted(set(a.roles) - set(ROLES))
    if unknown:
        p.error(f"--roles: unknown {', '.join(unknown)}; the roles: {', '.join(ROLES)}")
    if a.quick:
        a.quiet, a.gap, a.rounds, a.roles, a.no_kill = 10.0, 3.0, 1, ["denoiser-1"], True
    return a


# --- the pure part: what the run's outcomes and windows say ---------------------------------------------------------


def overlapping(outcomes: Iterable[Outcome], start: float, end: float) -> list[Outcome]:
    """The requests whose run overlaps [start, end]."""
    return [o for o in outcomes if o.start <= end and o.end >= start]


def p95(outcomes: Iterable[Outcome]) -> float:
    return percentile([o.seconds for o in outcomes if o.error is None], 0.95)


def resubmitted(log_text: str) -> dict[str, set[str]]:
    """Request ids the REST front resubmitted to another gateway (before an answer) or ran again (mid-stream)."""
    return {"resubmitted": set(RESUBMIT.findall(log_text)), "rerun": set(RERUN.findall(log_text))}


WORKERS = re.compile(r'^glmimage_gateway_workers\{role="(\w+)",state="(\w+)"\} (\S+)$', re.M)


def usable_workers(metrics_text: str, role: str) -> float:
    """How many of ``role``'s workers a gateway's /metrics shows AVAILABLE or BUSY (the ones it gives work)."""
    return sum(float(n) for r, state, n in WORKERS.findall(metrics_text)
               if r == role and state in ("available", "busy"))


@dataclass
class CounterTrack:
    """A counter summed over the restarts of the process serving it: a value below the last one is a new process,
    whose count starts again from 0, so the last one's is kept."""

    base: float = 0.0
    last: float = 0.0

    def see(self, value: float) -> None:
        if value < self.last:
            self.base += self.last
        self.last = value

    @property
    def total(self) -> float:
        return self.base + self.last


def counter_sum(metrics_text: str, name: str) -> float:
    """The sum of one counter's samples (every label) in Prometheus text."""
    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            metric, _, value = line.rpartition(" ")
            if metric.split("{")[0] in (name, f"{name}_total"):
                total += float(value)
    return total


def summarize(outcomes: list[Outcome], windows: list[Window], quiet_end: float, rest_log: dict[str, set[str]],
              gateway_requeues: float) -> dict:
    """Every figure the table and the verdict need, as plain data (the result file holds it)."""
    quiet = [o for o in outcomes if o.end <= quiet_end]
    quiet_p95 = p95(quiet)
    rows = []
    for w in windows:
        inside = overlapping(outcomes, w.start, w.end)
        failed = [o for o in inside if o.error]
        ids = {o.rid for o in inside}
        w_p95 = p95(inside) if any(o.error is None for o in inside) else None  # None: nothing answered in it
        rows.append({"label": w.label, "role": w.role, "how": w.how, "seconds": round(w.end - w.start, 1),
                     "requests": len(inside), "failed": len(failed),
                     "failures": [f"{o.rid} ({o.kind}): {o.error}" for o in failed[:FAILURES_KEPT]],
                     "failures_by_error": dict(Counter(error_kind(o.error or "") for o in failed)),
                     "rest_resubmits": len(ids & rest_log["resubmitted"]), "rest_reruns": len(ids & rest_log["rerun"]),
                     "client_retries": sum(o.client_retries for o in inside),
                     "p95_s": None if w_p95 is None else round(w_p95, 3),
                     "p95_over_quiet": round(w_p95 / quiet_p95, 2) if w_p95 is not None and quiet_p95 else None,
                     "said": w.said})
    failed = [o for o in outcomes if o.error]
    return {"requests": len(outcomes), "ok": len(outcomes) - len(failed), "failed": len(failed),
            "failures_outside_windows": [f"{o.rid} ({o.kind}): {o.error}" for o in failed
                                         if not any(o.start <= w.end and o.end >= w.start for w in windows)],
            "retried": {"rest_resubmits": len(rest_log["resubmitted"]), "rest_reruns": len(rest_log["rerun"]),
                        "gateway_requeues": gateway_requeues,
                        "client_retries": sum(o.client_retries for o in outcomes)},
            "quiet": {"requests": len(quiet), "p95_s": round(quiet_p95, 3),
                      "median_s": round(percentile([o.seconds for o in quiet if o.error is None], 0.5), 3)},
            "windows": rows}


def error_kind(error: str) -> str:
    """A failure's kind, for counting: the exception's name or the HTTP status ("ConnectError", "HTTP 503")."""
    return error.split(":", 1)[0]


def verdict(summary: dict) -> list[str]:
    """Why the run fails the issue's done-when: any failure in a SIGTERM restart, or in an AR's or a denoiser's
    SIGKILL, or any outside every window (the quiet phase, the gaps). Empty: it passes."""
    problems = [f"{w['label']}: {w['failed']} failed" for w in summary["windows"]
                if w["failed"] and (w["how"] == "sigterm" or w["role"] in KILL_MUST_NOT_FAIL)]
    if summary["failures_outside_windows"]:
        problems.append(f"{len(summary['failures_outside_windows'])} failed outside every restart")
    problems += [f"{w['label']}: {w['said']}" for w in summary["windows"] if w["said"].startswith("error")]
    return problems


def failed_cell(w: dict) -> str:
    """A window's failures and their kinds: "0", or "4 (RemoteProtocolError 4)"."""
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(w["failures_by_error"].items()))
    return f"{w['failed']} ({kinds})" if kinds else str(w["failed"])


def table(summary: dict) -> str:
    r, q = summary["retried"], summary["quiet"]
    lines = [f"requests {summary['requests']}, ok {summary['ok']}, failed {summary['failed']}; retried: REST front "
             f"resubmitted {r['rest_resubmits']} and reran {r['rest_reruns']} streams, gateways requeued "
             f"{r['gateway_requeues']:g} jobs, the client retried {r['client_retries']} refused connections",
             f"quiet: {q['requests']} requests, median {q['median_s']:.2f} s, p95 {q['p95_s']:.2f} s", "",
             "| window | s | requests | failed | REST resubmits / reruns | client retries | p95 | p95 / quiet |",
             "|---|---|---|---|---|---|---|---|"]
    for w in summary["windows"]:
        ratio = "-" if w["p95_over_quiet"] is None else f"{w['p95_over_quiet']:.2f}"
        p95_s = "-" if w["p95_s"] is None else f"{w['p95_s']:.2f} s"
        lines.append(f"| {w['label']} | {w['seconds']:.0f} | {w['requests']} | {failed_cell(w)} | "
                     f"{w['rest_resubmits']} / {w['rest_reruns']} | {w['client_retries']} | {p95_s} | "
                     f"{ratio} |")
    return "\n".join(lines)


# --- the run: a stack, its load, its restarts ------------------------------------------------------------------------


def _png(size: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (size, size), (40, 120, 200)).save(buf, format="PNG")
    return buf.getvalue()


@dataclass
class Load:
    """Client threads sending back-to-back requests through the REST front until stopped; every outcome kept."""

    rest: str
    retry_refused: bool
    seed: int
    edit_share: float
    outcomes: list[Outcome] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def client(self, i: int) -> None:
        rng, refs = random.Random(self.seed * 100 + i), {64: _png(64), 128: _png(128)}
        with httpx.Client(base_url=f"http://{self.rest}", timeout=REQUEST_TIMEOUT_S) as http:
            seq = 0
            while not self.stop.is_set():
                seq += 1
                rid, size = f"roll-{i}-{seq}", rng.choice((64, 128))
                edit = rng.random() < self.edit_share
                n = 1 if edit else rng.choice((1, 2, 3))
                kind = f"edit {size}" if edit else f"generate n={n} {size}"
                outcome = Outcome(rid, kind, time.monotonic(), 0.0)

                def send(size: int = size, n: int = n, edit: bool = edit, rid: str = rid) -> httpx.Response:
                    common = {"prompt": f"rolling {rid}", "n": n, "size": f"{size}x{size}",
                              "seed": rng.randrange(2**31)}
                    if edit:
                        return http.post("/v1/images/edits", headers={"X-Request-Id": rid},
                                         data={k: str(v) for k, v in common.items()},
                                         files=[("image", ("ref.png", refs[size], "image/png"))])
                    return http.post("/v1/images/generations", headers={"X-Request-Id": rid},
                                     json={**common, "num_inference_steps": 2})
                outcome.error = self._answer(send, outcome, n)
                outcome.end = time.monotonic()
                with self.lock:
                    self.outcomes.append(outcome)
                if outcome.error:
                    time.sleep(PAUSE_S)

    def _answer(self, send: Callable[[], httpx.Response], outcome: Outcome, n: int) -> str | None:
        deadline = outcome.start + REQUEST_TIMEOUT_S
        while True:
            try:
                r = send()
            except httpx.ConnectError as exc:  # refused: nothing was sent
                if self.retry_refused and time.monotonic() < deadline and not self.stop.is_set():
                    outcome.client_retries += 1
                    time.sleep(PAUSE_S)
                    continue
                return f"{type(exc).__name__}: {exc}"
            except httpx.HTTPError as exc:
                return f"{type(exc).__name__}: {exc}"
            if r.status_code != 200:
                return f"HTTP {r.status_code}: {r.text[:300]}"
            got = len(r.json().get("data") or [])
            return None if got == n else f"{got} image(s) for n={n}"

    def snapshot(self) -> list[Outcome]:
        with self.lock:
            return list(self.outcomes)


class Stack:
    """`python -m services.launcher` on ports it picks, its log (every server's) in a file of the run directory."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.ready = run_dir / "ready.json"
        self.log_path = run_dir / "stack.log"
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.launcher", "--rest-port", "0", "--gateway-ports", "0,0",
             "--gateway-metrics-ports", "0,0", "--ar-port", "0", "--denoiser-ports", "0,0",
             "--ready-file", str(self.ready), "--log-level", "INFO", "--jobs-dir", str(run_dir / "jobs")],
            stdout=self._log, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 600
        while not self.ready.exists():  # written once every server is SERVING
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise SystemExit(f"the stack did not start: see {self.log_path}")
            time.sleep(0.2)

    def addresses(self) -> dict:
        return json.loads(self.ready.read_text())

    def ctl_restart(self, word: str) -> str:
        done = subprocess.run([sys.executable, "-m", "services.launcher", "ctl", "--ready-file", str(self.ready),
                               "restart", word], capture_output=True, text=True, timeout=900)
        said = (done.stdout + done.stderr).strip()
        return ("ok " if done.returncode == 0 else "error ") + said

    def sigkill(self, name: str) -> str:
        """SIGKILL ``name``; back once the ready file names its new PID (the launcher rewrites it when the
        new process is SERVING) and, for a worker, every gateway takes it again."""
        old = self.addresses()["pids"][name]
        os.kill(old, signal.SIGKILL)
        deadline = time.monotonic() + 300
        while self.addresses().get("pids", {}).get(name) in (None, old):
            if time.monotonic() > deadline:
                return f"error {name} was not restarted within 300 s"
            time.sleep(0.1)
        if not name.startswith(("ar", "denoiser")) or self._gateways_take(name, deadline):
            return f"ok {name} killed (pid {old}), back as pid {self.addresses()['pids'][name]}"
        return f"error no gateway took {name} back"

    def _gateways_take(self, name: str, deadline: float) -> bool:
        """Every gateway's health watch has the restarted worker again: its workers gauge counts it up."""
        addresses = self.addresses()
        urls = [addresses[k] for k in gateway_metrics(addresses)]
        role = "ar" if name == "ar" else "denoiser"
        want = 1 if role == "ar" else 2
        for url in urls:
            while True:
                try:
                    if usable_workers(httpx.get(url, timeout=5).text, role) >= want:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.2)
        return True

    def gateway_requeues(self) -> dict[str, float]:
        addresses = self.addresses()
        out = {}
        for key in gateway_metrics(addresses):
            try:
                out[key] = counter_sum(httpx.get(addresses[key], timeout=5).text, "glmimage_gateway_requeues")
            except httpx.HTTPError:
                pass  # a gateway down just now: its last count stays
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()


def gateway_metrics(addresses: dict) -> list[str]:
    """The ready file's keys of every gateway's /metrics URL (not "gateway-metrics": the first one's again)."""
    return sorted(k for k in addresses if re.fullmatch(r"gateway-\d+-metrics", k))


def kill_target(addresses: dict, role: str, rng: random.Random) -> str:
    """One server of ``role`` from the ready file's PIDs (the launcher itself is none of them)."""
    names = sorted(n for n in addresses["pids"] if n != "launcher" and (n == role or n.rsplit("-", 1)[0] == role))
    return rng.choice(names)


def uncommitted() -> list[str]:
    """The tracked files changed since the commit the result names: its figures are of that tree, not the commit."""
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                             check=True, cwd=Path(__file__).resolve().parents[1]).stdout
    except (OSError, subprocess.CalledProcessError):
        return []
    return [line[3:] for line in out.splitlines() if line[3:] != "BENCHMARKS.md"]


def _flags(a: argparse.Namespace) -> str:
    """The command line's flags that differ from the defaults, for the result's command."""
    d = parse_args([])
    return "".join(f" --{k.replace('_', '-')} {','.join(v) if isinstance(v, list) else v}" for k, v in vars(a).items()
                   if k not in ("client_retries", "run_dir", "no_kill", "quick") and v != getattr(d, k)) + \
        (" --no-kill" if a.no_kill else "")


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    from services.model.tiny import ensure_tiny_checkpoint

    ensure_tiny_checkpoint()
    run_dir = a.run_dir or Path(tempfile.mkdtemp(prefix="bench-rolling-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(a.seed)
    t0 = time.monotonic()
    stack = Stack(run_dir)
    print(f"stack up in {time.monotonic() - t0:.0f} s; log {stack.log_path}", flush=True)
    load = Load(stack.addresses()["rest"], a.client_retries == "refused", a.seed, a.edit_share)
    threads = [threading.Thread(target=load.client, args=(i,), daemon=True) for i in range(a.clients)]
    requeues: dict[str, CounterTrack] = {}
    sampling = threading.Event()

    def sample_requeues() -> None:  # often enough to see every gateway's count before its restart resets it
        while not sampling.wait(0.5):
            for key, value in stack.gateway_requeues().items():
                requeues.setdefault(key, CounterTrack()).see(value)

    sampler = threading.Thread(target=sample_requeues, daemon=True)
    windows: list[Window] = []

    def window(label: str, role: str, how: str, act: Callable[[], str]) -> None:
        w = Window(label, role, how, time.monotonic())
        w.said = act()
        w.end = time.monotonic()
        windows.append(w)
        print(f"{label}: {w.end - w.start:.1f} s: {w.said}", flush=True)
        time.sleep(a.gap)

    try:
        for t in [*threads, sampler]:
            t.start()
        time.sleep(a.quiet)
        quiet_end = time.monotonic()
        for round_ in range(1, a.rounds + 1):
            for word in a.roles:
                window(f"round {round_}: ctl restart {word}", word.rsplit("-", 1)[0] if word[-1].isdigit() else word,
                       "sigterm", lambda word=word: stack.ctl_restart(word))
        if not a.no_kill:
            for role in a.roles:
                name = kill_target(stack.addresses(), role, rng)
                window(f"SIGKILL {name}", role, "sigkill", lambda name=name: stack.sigkill(name))
    finally:
        load.stop.set()
        for t in threads:
            t.join(REQUEST_TIMEOUT_S + 10)
        sampling.set()
        sampler.join(10)
        stack.close()
    summary = summarize(load.snapshot(), windows, quiet_end, resubmitted(stack.log_path.read_text(errors="replace")),
                        sum(c.total for c in requeues.values()))
    summary["setup"] = {"clients": a.clients, "quiet_s": a.quiet, "gap_s": a.gap, "rounds": a.rounds,
                        "roles": a.roles, "sigkill": not a.no_kill, "edit_share": a.edit_share,
                        "client_retries": a.client_retries, "run_dir": str(run_dir), "uncommitted": uncommitted(),
                        "windows": [asdict(w) | {"start": round(w.start - t0, 1), "end": round(w.end - t0, 1)}
                                    for w in windows]}
    print(table(summary))
    problems = verdict(summary)
    for w in summary["windows"]:
        for f in w["failures"]:
            print(f"  {w['label']}: {f}")
        if w["failed"] > len(w["failures"]):
            print(f"  {w['label']}: ... {w['failed'] - len(w['failures'])} more")
    if not a.quick:
        command = ".venv/bin/python -m bench.rolling" + ("" if a.client_retries == "none" else
                                                          f" --client-retries {a.client_retries}")
        # A run with the client's retries is kept beside the default one: BENCHMARKS.md shows both.
        write_result("rolling" if a.client_retries == "none" else "rolling_client_retries",
                     {**summary, "passed": not problems, "problems": problems}, command=command + _flags(a))
    if problems:
        print("FAILED: " + "; ".join(problems) + f" (the stack's log: {stack.log_path})", file=sys.stderr)
        return 1
    print("passed: no request failed in a SIGTERM restart or an AR's or a denoiser's SIGKILL")
    return 0


if __name__ == "__main__":
    sys.exit(main())
