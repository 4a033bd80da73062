"""What every BENCHMARKS.md section is written with (bench/report.py, bench/report_sims.py): a number's form, and the
line naming the run a section's figures come from."""
from __future__ import annotations


def num(x: float, digits: int = 2) -> str:
    return f"{x:.{digits}f}"


def run_header(d: dict) -> str:
    m = d.get("machine", {})
    return (f"Command: `{d.get('command')}` — run {d.get('when')} on {m.get('cpu', '?')}, {m.get('cores')} cores, "
            f"commit {m.get('commit', '?')}.\n")
