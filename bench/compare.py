"""The gateway overhead benchmark (bench/gateway.py) for two revisions side by side (`make bench-compare BASE=<rev>`).

Each revision is exported with `git archive` into a temporary directory, so each side runs its own code (gateway,
REST front, SDK, stubs, and its own bench/gateway.py) with this interpreter and PYTHONPATH pointing at its tree,
and neither touches this checkout's bench/results/. Rounds alternate ABBA (base, head, head, base, ...), each one
`python -m bench.gateway --rounds 1` with fresh processes, so drift in the machine's load favours neither side.

Reported: per side the median over rounds of the two figures the issues pin (REST added latency p50 at
concurrency 1, REST requests/s at concurrency 32), with the spread, and HEAD/base ratios of those medians.
Writes bench/results/compare_gateway.json.

    .venv/bin/python -m bench.compare --base cf0d50c [--head HEAD] [--rounds 3] [--bench-arg=--requests-c32=800]
"""
from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import median, write_result

REPO = Path(__file__).resolve().parents[1]
# name -> (path in bench/gateway.py's summary, whether higher is better)
FIGURES: dict[str, tuple[tuple[str, str], bool]] = {
    "rest_added_p50_ms_c1": (("c1", "rest_added_p50_ms"), False),
    "rest_rps_c32": (("c32", "rest_rps"), True),
}
# Packages each side must import from its own tree (checked before any round: an editable install of another
# checkout would otherwise shadow it silently).
OWN_PACKAGES = ("bench", "gateway", "services", "glmimage")


@dataclass
class Side:
    label: str  # "base" or "head"
    rev: str
    commit: str
    tree: Path
    rounds: list[dict[str, float]] = field(default_factory=list)

    def env(self) -> dict[str, str]:
        return {**os.environ, "PYTHONPATH": f"{self.tree}{os.pathsep}{self.tree / 'clients' / 'python'}"}


def _git(*args: str) -> bytes:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, check=True).stdout


def export(label: str, rev: str, parent: Path) -> Side:
    """`git archive` of `rev` unpacked under `parent`: the committed tree only, no .git, no venv."""
    commit = _git("rev-parse", "--verify", f"{rev}^{{commit}}").decode().strip()
    tree = parent / label
    tree.mkdir()
    with tarfile.open(fileobj=io.BytesIO(_git("archive", "--format=tar", commit))) as tar:
        tar.extractall(tree, filter="data")
    return Side(label, rev, commit, tree)


def check_imports(side: Side) -> None:
    code = ("import importlib, json; print(json.dumps({n: importlib.import_module(n).__path__[0] for n in "
            f"{OWN_PACKAGES!r}}}))")
    done = subprocess.run([sys.executable, "-c", code], cwd=side.tree, env=side.env(), capture_output=True,
                          text=True, check=True)
    stray = {n: p for n, p in json.loads(done.stdout).items() if not Path(p).resolve().is_relative_to(side.tree)}
    if stray:
        raise SystemExit(f"{side.label} ({side.rev}) imports these from outside its tree {side.tree}: {stray}")


def run_round(side: Side, bench_args: list[str]) -> dict[str, float]:
    """One `python -m bench.gateway --rounds 1` in the side's tree; its figures from the JSON it wrote there."""
    print(f"== {side.label} ({side.rev}, {side.commit[:10]})", flush=True)
    subprocess.run([sys.executable, "-m", "bench.gateway", "--rounds", "1", *bench_args], cwd=side.tree,
                   env=side.env(), check=True, stdout=subprocess.DEVNULL)
    summary = json.loads((side.tree / "bench" / "results" / "gateway.json").read_text())["summary"]
    figures = {name: float(summary[c][key]) for name, ((c, key), _) in FIGURES.items()}
    print("   " + ", ".join(f"{k} {v:.2f}" for k, v in figures.items()), flush=True)
    return figures


def summarise(base: Side, head: Side) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (_, higher_is_better) in FIGURES.items():
        cell: dict[str, Any] = {}
        for side in (base, head):
            values = [r[name] for r in side.rounds]
            cell[side.label] = {"median": median(values), "min": min(values), "max": max(values), "rounds": values}
        cell["head_over_base"] = cell["head"]["median"] / cell["base"]["median"]
        cell["higher_is_better"] = higher_is_better
        out[name] = cell
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="the revision to compare against (any git rev)")
    p.add_argument("--head", default="HEAD", help="the revision under test (default HEAD: commit your changes)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per side (each a fresh bench.gateway run)")
    p.add_argument("--bench-arg", action="append", default=[],
                   help="extra flag for bench.gateway on both sides, e.g. --bench-arg=--requests-c32=800")
    args = p.parse_args(argv)
    load_at_start = os.getloadavg()  # on a shared machine, what the spread between rounds is to be read against
    with tempfile.TemporaryDirectory(prefix="bench-compare-") as tmp:
        base, head = export("base", args.base, Path(tmp)), export("head", args.head, Path(tmp))
        for side in (base, head):
            check_imports(side)
        for r in range(args.rounds):
            for side in ((base, head) if r % 2 == 0 else (head, base)):
                side.rounds.append(run_round(side, args.bench_arg))
    figures = summarise(base, head)
    for name, cell in figures.items():
        print(f"{name}: base {cell['base']['median']:.2f}, head {cell['head']['median']:.2f}, "
              f"head/base {cell['head_over_base']:.3f} ({'higher' if cell['higher_is_better'] else 'lower'} is "
              "better)")
    write_result("compare_gateway", {
        "config": {"rounds": args.rounds, "bench_args": args.bench_arg, "order": "ABBA, base first",
                   "interpreter": sys.executable, "load_average_at_start": load_at_start,
                   "load_average_at_end": os.getloadavg()},
        "base": {"rev": args.base, "commit": base.commit}, "head": {"rev": args.head, "commit": head.commit},
        "figures": figures,
    }, "python -m bench.compare " + " ".join(argv if argv is not None else sys.argv[1:]))


if __name__ == "__main__":
    main()
