"""The multi-gateway simulation (bench/multi_gateway_sim.py) runs end to end in a few seconds: two real gateway
processes over the simulated pool, every request answered, and the busy collisions per dispatch read from the
gateways' own /metrics. The figures themselves come from `make bench`; this only keeps the code path working."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from bench import multi_gateway_sim

pytestmark = [pytest.mark.asyncio, pytest.mark.e2e]


async def test_two_gateways_over_the_reference_pool_for_a_short_window(tmp_path: Path) -> None:
    # 0.6 s warm-up and 1.8 s measured (wall), 32 clients: far from saturation, but every figure is there.
    args = multi_gateway_sim.parse_args(["--scenarios", "g2_ar1_d14", "--window-factor", "0.15", "--repeats", "1",
                                         "--clients", "32"])
    results = await multi_gateway_sim.main_async(args)
    scenario = results["scenarios"]["g2_ar1_d14"]
    (run,) = scenario["runs"]
    assert run["errors"] == 0 and run["images"] > 0
    assert run["dispatches"] > 0 and len(run["per_gateway"]["dispatches"]) == 2
    assert math.isfinite(run["collisions_per_dispatch"]) and run["collisions_per_dispatch"] >= 0
    assert len(run["per_gateway"]["share"]) == 2 and sum(run["per_gateway"]["share"]) == pytest.approx(1, abs=1e-3)
    assert run["denoiser_max_jobs_at_once"] == 1
    summary = scenario["summary"]
    assert summary["errors"] == 0 and "collisions_per_dispatch" in summary and summary["throughput"] > 0
    assert results["targets_met"]["no errors"]
    multi_gateway_sim.plot(results, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 0
