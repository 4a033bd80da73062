"""The scheduler core stays readable top to bottom: under 800 lines (issue 30). What grows beside it goes to a module
of its own, as the fair share (fairness.py) and the LoRA placement (placement.py) did."""
from __future__ import annotations

from pathlib import Path

CORE = Path(__file__).resolve().parent.parent / "gateway/scheduler/core.py"
LIMIT = 800


def test_the_scheduler_core_stays_under_800_lines() -> None:
    lines = len(CORE.read_text().splitlines())
    assert lines < LIMIT, f"{CORE.name} has {lines} lines (limit {LIMIT}): move a part into a module of its own"
