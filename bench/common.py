"""What every benchmark shares: the machine description, medians, and writing results."""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict[str, Any]:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info: dict[str, Any] = {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
                            "platform": platform.platform()}
    try:
        info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                        check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return info


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def timed(fn: Callable[[], Any], repeats: int) -> list[float]:
    """Wall seconds of `repeats` calls of fn (after the caller's own warm-up)."""
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def write_result(name: str, data: dict[str, Any], command: str) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    payload = {"name": name, "command": command, "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "machine": machine(), **data}
    path.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
    print(f"wrote {path}")  # bench output is for people: print is the interface here
    return path
