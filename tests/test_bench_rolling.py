"""bench/rolling.py (issue 32): its pure parts (arguments, the windows' figures, the verdict, the log and /metrics
readers) on data, and one `--quick` run on the real stack: one `ctl restart` of a denoiser under load, nothing
failed. The figures themselves come from `make bench` (BENCHMARKS.md, "Rolling restarts")."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from bench import rolling
from bench.rolling import CounterTrack, Outcome, Window


def test_arguments_default_to_every_role_twice_and_quick_rolls_one_denoiser() -> None:
    a = rolling.parse_args([])
    assert a.roles == list(rolling.ROLES) and a.rounds == 2 and not a.no_kill and a.clients == 4
    assert a.client_retries == "none"  # every failure shows unless asked
    assert rolling.parse_args(["--client-retries", "refused"]).client_retries == "refused"
    q = rolling.parse_args(["--quick"])
    assert q.roles == ["denoiser-1"] and q.rounds == 1 and q.no_kill
    with pytest.raises(SystemExit):
        rolling.parse_args(["--roles", "ar,model"])
    # The result file's command names what differs from the defaults, so the run can be repeated.
    assert rolling._flags(rolling.parse_args(["--roles", "rest", "--no-kill", "--gap", "3"])) == \
        " --gap 3.0 --roles rest --no-kill"


def _outcome(rid: str, start: float, end: float, error: str | None = None, retries: int = 0) -> Outcome:
    return Outcome(rid, "generate n=1 64", start, end, error, retries)


def test_a_request_counts_in_every_window_its_run_overlaps_and_p95_is_against_the_quiet_one() -> None:
    quiet = [_outcome(f"q{i}", i, i + 1.0) for i in range(20)]  # 1 s each, all before t=21
    during = [_outcome("a", 30, 34), _outcome("b", 33, 35, retries=2), _outcome("c", 36, 38, "HTTP 503: gone")]
    windows = [Window("round 1: ctl restart gateway", "gateway", "sigterm", 32, 37, "ok"),
               Window("SIGKILL rest", "rest", "sigkill", 50, 55, "ok")]
    s = rolling.summarize(quiet + during, windows, 21.0, {"resubmitted": {"a", "x"}, "rerun": {"b"}}, 3.0)
    assert s["requests"] == 23 and s["failed"] == 1 and s["quiet"]["requests"] == 20
    assert s["quiet"]["p95_s"] == pytest.approx(1.0)
    first, second = s["windows"]
    assert first["requests"] == 3 and first["failed"] == 1 and first["failures_by_error"] == {"HTTP 503": 1}
    assert first["failures"] == ["c (generate n=1 64): HTTP 503: gone"]
    assert (first["rest_resubmits"], first["rest_reruns"], first["client_retries"]) == (1, 1, 2)
    assert first["p95_s"] == pytest.approx(3.9) and first["p95_over_quiet"] == pytest.approx(3.9)
    assert second["requests"] == 0 and second["p95_s"] is None and second["p95_over_quiet"] is None
    assert s["retried"] == {"rest_resubmits": 2, "rest_reruns": 1, "gateway_requeues": 3.0, "client_retries": 2}
    assert rolling.verdict(s) == ["round 1: ctl restart gateway: 1 failed"]
    assert "| round 1: ctl restart gateway | 5 | 3 | 1 (HTTP 503 1) | 1 / 1 | 2 | 3.90 s | 3.90 |" in rolling.table(s)


def test_the_verdict_allows_failures_only_in_a_sigkill_of_a_gateway_or_the_rest_front() -> None:
    def verdict(role: str, how: str) -> list[str]:
        s = rolling.summarize([_outcome("x", 1, 2, "ReadError: ")], [Window(f"{how} {role}", role, how, 0, 3, "ok")],
                              0.0, {"resubmitted": set(), "rerun": set()}, 0)
        return rolling.verdict(s)

    assert verdict("rest", "sigkill") == [] and verdict("gateway", "sigkill") == []
    assert verdict("denoiser", "sigkill") and verdict("ar", "sigkill") and verdict("rest", "sigterm")
    # Outside every window (the quiet phase, a gap) nothing may fail; nor may the launcher fail a restart.
    s = rolling.summarize([_outcome("y", 10, 11, "HTTP 500: x")], [Window("w", "ar", "sigterm", 0, 3, "error gone")],
                          0.0, {"resubmitted": set(), "rerun": set()}, 0)
    assert rolling.verdict(s) == ["1 failed outside every restart", "w: error gone"]


def test_the_rest_fronts_retries_are_read_from_its_log_by_request_id() -> None:
    log = ("2026-12-03 19:00:01 WARNING rest.upstream roll-1-7 gateway unavailable before answering; "
           "resubmitting to the next gateway (attempt 2)\n"
           "2026-12-03 19:00:02 WARNING rest.streaming roll-2-3 gateway went away mid-stream; running the "
           "request again from the start on another gateway\n"
           "2026-12-03 19:00:03 INFO rest.dispatch roll-1-8 done: 1 image(s), 10+0 tokens\n")
    assert rolling.resubmitted(log) == {"resubmitted": {"roll-1-7"}, "rerun": {"roll-2-3"}}


def test_a_counter_is_summed_over_the_restarts_of_the_process_serving_it() -> None:
    track = CounterTrack()
    for value in (0, 2, 3, 0, 1, 1, 4):  # the process restarted after 3
        track.see(value)
    assert track.total == 7
    text = ('# HELP glmimage_gateway_requeues Work put back\n# TYPE glmimage_gateway_requeues counter\n'
            'glmimage_gateway_requeues_total{reason="worker_lost"} 2.0\n'
            'glmimage_gateway_requeues_total{reason="draining"} 1.0\nglmimage_gateway_requeues_created 1.7e9\n')
    assert rolling.counter_sum(text, "glmimage_gateway_requeues") == 3.0


def test_the_gateways_usable_workers_and_the_servers_named_in_the_ready_file() -> None:
    text = ('glmimage_gateway_workers{role="denoiser",state="available"} 1.0\n'
            'glmimage_gateway_workers{role="denoiser",state="busy"} 1.0\n'
            'glmimage_gateway_workers{role="denoiser",state="draining"} 1.0\n'
            'glmimage_gateway_workers{role="ar",state="busy"} 1.0\n')
    assert rolling.usable_workers(text, "denoiser") == 2 and rolling.usable_workers(text, "ar") == 1
    ready = {"gateway-1-metrics": "u1", "gateway-2-metrics": "u2", "gateway-metrics": "u1", "ar-metrics": "a",
             "pids": {"launcher": 1, "ar": 2, "denoiser-0": 3, "denoiser-1": 4, "gateway-1": 5, "rest": 6}}
    assert rolling.gateway_metrics(ready) == ["gateway-1-metrics", "gateway-2-metrics"]
    rng = random.Random(0)
    assert rolling.kill_target(ready, "denoiser", rng) in ("denoiser-0", "denoiser-1")
    assert rolling.kill_target(ready, "rest", rng) == "rest" and rolling.kill_target(ready, "ar", rng) == "ar"


@pytest.mark.e2e
@pytest.mark.chaos
def test_quick_run_restarts_a_denoiser_under_load_and_fails_nothing(tiny_checkpoint: Path, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert rolling.main(["--quick", "--run-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| round 1: ctl restart denoiser-1 |" in out and "passed:" in out
    assert "denoiser-1 is back on" in out
