"""A picture of the Grafana dashboard (k8s/glmimage/files/glmimage-dashboard.json) drawn from a real Prometheus: each
panel at its grid position, its title, its queries over a time range as lines with their legends, in its unit.

Grafana itself is not packaged by Debian or any registry the project installs from, so the docs' picture of the
dashboard is drawn here, from the very queries Grafana would send (query_range, with Grafana's variables set as "All"
sets them), by matplotlib. tests/test_dashboard.py draws it on every run; with GLMIMAGE_SCREENSHOTS=1 (`make
screenshots`) it goes to docs/images/dashboard.png.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import httpx

GRID_COLUMNS = 24
_UNITS = {"percentunit": ("{:.0%}", 1.0), "s": ("{:.2g} s", 1.0), "reqps": ("{:.2g}/s", 1.0), "ops": ("{:.2g}/s", 1.0)}


def _expr(expr: str, rate_interval: str) -> str:
    expr = expr.replace("$__rate_interval", rate_interval)
    return re.sub(r"\$(gateway|denoiser)\b", ".*", expr)


def _legend(template: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template or "") or str(labels)


def series(prometheus: str, expr: str, start: float, end: float, step: float) -> list[tuple[dict, list, list]]:
    """(labels, times relative to ``end``, values) of each series ``expr`` gives over [start, end]."""
    reply = httpx.get(f"{prometheus}/api/v1/query_range",
                      params={"query": expr, "start": start, "end": end, "step": step}, timeout=30).json()
    if reply.get("status") != "success":
        raise AssertionError(f"{expr}: {reply.get('error')}")
    out = []
    for result in reply["data"]["result"]:
        times = [float(t) - end for t, _ in result["values"]]
        values = [float(v) for _, v in result["values"]]
        out.append((result["metric"], times, values))
    return out


def draw(prometheus: str, dashboard: dict[str, Any], out: Path, *, window_s: float = 120.0,
         rate_interval: str = "30s") -> int:
    """Draw the dashboard's panels over the last ``window_s`` seconds into ``out`` (PNG); the number of lines drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in dashboard["panels"] if p.get("type") != "row"]
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in dashboard["panels"])
    scale = 0.42  # inches per grid row
    fig = plt.figure(figsize=(18, rows * scale), dpi=90)
    fig.suptitle(dashboard.get("title", "dashboard"), fontsize=14, y=0.999)
    end = time.time()
    start, step = end - window_s, max(window_s / 120, 1.0)
    lines = 0
    for row in (p for p in dashboard["panels"] if p.get("type") == "row"):  # the section headings
        fig.text(0.01, 1 - (row["gridPos"]["y"] + 0.6) / rows, row["title"], fontsize=11, weight="bold")
    for panel in panels:
        grid = panel["gridPos"]
        # Grid units to figure fractions (y grows downwards in Grafana).
        left, width = grid["x"] / GRID_COLUMNS, grid["w"] / GRID_COLUMNS
        bottom, height = 1 - (grid["y"] + grid["h"]) / rows, grid["h"] / rows
        ax = fig.add_axes((left + 0.035, bottom + 0.25 / rows * 2, width - 0.05, height - 1.6 / rows))
        ax.set_title(panel["title"], fontsize=9, loc="left")
        ax.tick_params(labelsize=7)
        unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "short")
        for target in panel.get("targets", []):
            for labels, times, values in series(prometheus, _expr(target["expr"], rate_interval), start, end, step):
                ax.plot(times, values, linewidth=1.2, label=_legend(target.get("legendFormat", ""), labels)[:40])
                lines += 1
        if unit in _UNITS:
            fmt, _ = _UNITS[unit]
            ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _p, f=fmt: f.format(v)))
        ax.set_xlim(-window_s, 0)
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _p: f"{v:.0f} s"))
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=6, loc="upper left", ncol=2, framealpha=0.6)
        else:
            ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center", color="grey")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return lines
