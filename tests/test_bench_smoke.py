"""The simulations run end to end in a few seconds. The multi-gateway one (bench/multi_gateway_sim.py): two real
gateway processes over the simulated pool, every request answered, and the busy collisions per dispatch read from the
gateways' own /metrics. The LoRA placement one (bench/lora_sim.py): the pure scheduler in virtual time, every figure
and check there for both policies. The tenants one (bench/tenants_sim.py): the pure scheduler in virtual time, every
scenario and check under both policies. The figures themselves come from `make bench`; this only keeps the code paths
working."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from bench import lora_sim, multi_gateway_sim, tenants_sim


@pytest.mark.e2e
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


def test_lora_placement_for_a_short_window(tmp_path: Path) -> None:
    # A given load cost (no tiny model), one seed, 1,000 virtual seconds: about 1,200 requests per policy and load.
    args = lora_sim.parse_args(["--load-seconds", "3", "--seeds", "1", "--warmup", "200", "--window", "800",
                                "--loads", "0.875,1.1", "--sensitivity", "6", "--plain-extra", "0.25"])
    results = lora_sim.main_run(args)
    assert results["load_cost"] == {"source": "--load-seconds", "load_s": 3.0}
    target = results["target"]["median"]
    assert target["bound"]["throughput_vs_bound"] == 1 and target["bound"]["loads_per_request"] == 0
    for policy in ("affinity", "random"):
        m = target[policy]
        assert m["failed"] == 0 and m["throughput"] > 0 and 0 < m["loads_per_request"] <= 1
        assert set(m["per_adapter"]) == set(lora_sim.adapter_names())
        assert all(a["count"] > 0 and a["p95"] >= a["p50"] > 0 for a in m["per_adapter"].values())
        assert math.isfinite(m["max_p95_over_median_adapter_p95"]) and m["max_p95_over_median_adapter_p95"] >= 1
        assert set(results["checks"][policy]) >= {"throughput_vs_bound >= 0.9",
                                                  "max adapter p95 <= 2 x median adapter p95"}
    # Placement that follows the adapters loads less than placement blind to them.
    assert target["affinity"]["loads_per_request"] < target["random"]["loads_per_request"]
    assert results["target_with_plain"]["median"]["affinity"]["plain"]["count"] > 0
    assert [s["load"] for s in results["sweep"]] == [0.875, 1.1]
    assert {(p["load_s"], p["load"]) for p in results["load_cost_sensitivity"]} == {(6.0, 0.875), (6.0, 1.1)}
    lora_sim.plot(results, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 0


def test_a_simulated_denoiser_loads_what_it_lacks_and_evicts_the_least_recently_used() -> None:
    d = lora_sim.Denoiser(capacity=2)
    assert d.take(frozenset({"a"})) == 1 and d.take(frozenset({"b"})) == 1
    assert d.take(frozenset({"a"})) == 0  # a hit, now the most recently used
    assert d.take(frozenset({"c"})) == 1 and list(d.lru) == ["a", "c"]  # b went


def test_tenants_for_a_short_window(tmp_path: Path) -> None:
    # --quick: 200 s warm-up, 600 s measured, one seed, both pools (a few seconds of wall time).
    results = tenants_sim.main_run(tenants_sim.parse_args(["--quick"]))
    assert set(results["shares"]) == set(results["flood"]) == set(results["batch"]) == set(tenants_sim.POOLS)
    for policy in tenants_sim.POLICIES:
        names = [c["figure"] for c in results["checks"][policy]]
        assert len(names) == len(set(names)) and sum(c["from_issue"] for c in results["checks"][policy]) == 12
        for pool in tenants_sim.POOLS:
            s = results["shares"][pool][policy]
            assert s["failed"] == 0 and not s["rejected"]
            for stage in ("ar", "denoise"):
                assert sum(s[f"{stage}_shares"].values()) == pytest.approx(1, abs=1e-3)
            f = results["flood"][pool][policy]
            assert f["count"] > 0 and f["throughput_vs_bound"] > 0.9  # the flood keeps the pool busy
            assert results["batch"][pool]["idle"][policy]["batch_vs_bound"] > 0.9  # alone, it has the pool
    # Before issue 30 (one tenant, one class): equal closed loops get equal shares, whatever their weights, and the
    # light tenant waits behind the whole flood.
    fifo = results["shares"]["ar_bound"]["fifo"]["denoise_shares"]
    assert all(x == pytest.approx(1 / 3, abs=0.02) for x in fifo.values())
    assert results["flood"]["ar_bound"]["fifo"]["unfinished"] > 0
    assert results["batch"]["ar_bound"]["saturated"]["fifo"]["batch_share"] == pytest.approx(0.5, abs=0.02)
    # With fair share (issue 30): by weight in both stages, and batch work only on capacity nothing else waits for.
    fair = results["shares"]["ar_bound"]["fair"]
    for stage in ("ar", "denoise"):
        assert fair[f"{stage}_shares"]["c"] == pytest.approx(0.5, abs=0.03)
    assert results["batch"]["ar_bound"]["saturated"]["fair"]["batch_share"] == 0
    assert results["flood"]["ar_bound"]["fair"]["unfinished"] == 0
    assert tenants_sim.report_lines(results)[0] == "[fair]"
    tenants_sim.plot(results, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 0


def test_tail_percentile_counts_what_never_ended_as_the_longest() -> None:
    inf = float("inf")
    assert tenants_sim.tail_percentile([1.0, 2.0, 3.0], 0.5) == 2.0
    assert tenants_sim.tail_percentile([1.0, 2.0, 3.0, inf], 0.5) == 2.5
    assert tenants_sim.tail_percentile([1.0, 2.0, 3.0, inf], 0.95) == inf
    assert tenants_sim.quantiles([1.0, inf], points=3) == [1.0, "inf", "inf"]
    assert tenants_sim.jain([1.0, 1.0]) == 1 and tenants_sim.jain([1.0, 0.0]) == 0.5
