"""Write BENCHMARKS.md from bench/results/*.json, so every figure in it comes from a recorded run.

Run: .venv/bin/python -m bench.report (make bench runs it last).
"""
from __future__ import annotations

import json
from pathlib import Path

from bench.common import RESULTS
from bench.report_sims import lora_sim, multi_gateway_sim, scheduler_sim, tenants_sim
from bench.report_text import num, run_header

OUT = Path(__file__).resolve().parents[1] / "BENCHMARKS.md"


def _load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def ar(d: dict) -> str:
    rows = ["| batch size | s per output | tokens/s |", "|---|---|---|"]
    for b, r in d["service_engine"]["by_batch_size"].items():
        rows.append(f"| {b} | {num(r['per_output_seconds'], 4)} | {num(r['tokens_per_second'], 0)} |")
    pipe = d["diffusers_pipeline"]
    return ("## AR batching (issue 3)\n\n" + run_header(d) + "\nTiny model, 256x256, 2 torch threads, medians of "
            f"{d['setup']['rounds']} interleaved rounds.\n\n" + "\n".join(rows) +
            "\n\nService engine speed-up per output at batch 8 over batch 1: "
            f"**{d['service_engine']['speedup_b8_over_b1']}x**"
            f" (target 4x). The diffusers pipeline's own batched call: {pipe['speedup_b8_over_b1']}x, from a slower "
            f"batch 1 ({num(pipe['by_batch_size']['1']['per_output_seconds'], 3)} s vs "
            f"{num(d['service_engine']['by_batch_size']['1']['per_output_seconds'], 3)} s per output).\n")


def denoiser(d: dict) -> str:
    rows = ["| size | step (median) | VAE decode (median) |", "|---|---|---|"]
    for size, r in d["sizes"].items():
        rows.append(f"| {size} | {num(r['step_seconds_median'] * 1000, 1)} ms | "
                    f"{num(r['vae_decode_seconds_median'] * 1000, 0)} ms |")
    enc = ["| format | tiny-model output | smooth gradient with grain |", "|---|---|---|"]
    a, b = d["encode_1024x1024"]["tiny_model_output"], d["encode_1024x1024"]["gradient_with_grain"]
    for k in a:
        enc.append(f"| {k} | {num(a[k]['seconds_median'] * 1000, 1)} ms, {a[k]['bytes'] // 1024} KiB | "
                   f"{num(b[k]['seconds_median'] * 1000, 1)} ms, {b[k]['bytes'] // 1024} KiB |")
    return ("## Denoiser steps, decode and encoding (issue 4)\n\n" + run_header(d) +
            f"\n{d.get('torch_threads')} torch threads; {d.get('notes', '')}.\n\n" + "\n".join(rows) +
            "\n\nEncoding one 1024x1024 image:\n\n" + "\n".join(enc) + "\n")


def speed_modes(d: dict) -> str:
    s = d["setup"]
    rows = ["| size | level | steps computed / total | denoise loop (median) | loop / off (median, range) | "
            "PSNR vs off | max abs diff vs off |", "|---|---|---|---|---|---|---|"]
    for size, levels in d["sizes"].items():
        for level, r in levels.items():
            low, high = r["loop_ratio_to_off_range"]
            rows.append(f"| {size} | {level} | {r['steps_computed']} / {r['steps']} | "
                        f"{num(r['loop_seconds_median'] * 1000, 0)} ms | {num(r['loop_ratio_to_off_median'], 3)} "
                        f"({num(low, 3)}-{num(high, 3)}) | "
                        f"{'-' if r['psnr_db_vs_off'] is None else num(r['psnr_db_vs_off'], 1) + ' dB'} | "
                        f"{r['max_abs_diff_vs_off']} |")
    schedules = ", ".join(f"{level} `{spec}`" for level, spec in s["schedules"].items())
    return ("## Speed modes: the step cache (issue 22)\n\n" + run_header(d) +
            f"\nThe tiny model (**random weights**), torch at {s['torch_threads']} threads, {s['steps']} steps, "
            f"{s['rounds']} rounds alternating the levels' order; the loop time excludes the glyph encoding; ratios "
            f"taken within a round, then the median. Schedules: {schedules}. Fidelity compares the decoded 8-bit "
            "images of one seed with the `off` image.\n\n" + "\n".join(rows) + "\n\n"
            "What these figures are: the step count is the schedule's on any weights; the time ratio is what skipping "
            "the blocks saves on a model whose blocks are a small part of each step (glyph and prior embeddings, "
            "the scheduler and Python overhead stay), so on real weights, where the DiT blocks dominate, the saving "
            "follows the steps computed more closely; the fidelity of random weights says nothing about real "
            "images. Published on real weights: a TeaCache port for GLM-Image reports 114.19 s -> 86.61 s (1.32x) "
            "at 50 steps, 1024x1024 (vllm-omni PR #1458); cache-dit on FLUX.1-dev reports 1.80x at PSNR 33.8 dB and "
            "2.47x at PSNR 31.8 dB against the uncached image. Not measured here on real weights (no GPU and no "
            "weights on this machine).\n\n![speed modes](bench/results/speed_modes.png)\n")


def compile_(d: dict) -> str:
    labels = {"none": "uncompiled", "eager": "`eager` (tracing only)", "inductor": "`inductor`, empty on-disk cache",
              "inductor_cached": "`inductor`, cache of a previous start"}
    sizes = list(next(iter(d["backends"].values()))["sizes"])
    rows = ["| backend | warm-up before SERVING | graphs | " + " | ".join(f"job at {s} (median)" for s in sizes) +
            " |", "|---|---|---|" + "---|" * len(sizes)]
    for name, b in d["backends"].items():
        rows.append(f"| {labels.get(name, name)} | {num(b['warm_up_seconds'], 2)} s | {b['warm_up_graphs']} | " +
                    " | ".join(f"{num(b['sizes'][s]['denoise_seconds_median'] * 1000, 0)} ms" for s in sizes) + " |")
    return ("## Compiled blocks: `--compile` against eager (issue 22)\n\n" + run_header(d) +
            f"\nThe tiny model (**random weights**), float32 on the CPU, torch at {d['torch_threads']} thread, "
            f"{d['steps']} steps a job, medians of {d['repeats']} jobs after the warm-up; each backend in a fresh "
            "process. The warm-up is what the denoiser runs before it says SERVING with `--compile` (here at "
            "256x256 and 512x512, no edits). On this CPU inductor saves a fifth of a job for tens of seconds of "
            "compiling at every start: `--compile` stays off by default; on a GPU with real weights the trade is "
            "to be measured there.\n\n" + "\n".join(rows) + "\n")


def edits(d: dict) -> str:
    rows = [f"| {size} | {num(r['ar_t2i_s'], 3)} | {num(r['ar_edit_s'], 3)} | {num(r['ar_edit_over_t2i'], 2)}x | "
            f"{num(r['denoise_t2i_s'], 3)} | {num(r['denoise_edit_s'], 3)} | {num(r['denoise_edit_over_t2i'], 2)}x |"
            for size, r in d["by_size"].items()]
    s = d["setup"]
    return ("## Edits against text-to-image, per stage (issue 14)\n\n" + run_header(d) +
            f"\nTiny model, torch at {s['torch_threads']} threads, one request, {s['reference']} as the edit's "
            f"reference; denoise = {s['denoise_steps']} steps; medians of {s['repeats']} interleaved rounds. An edit's "
            "AR generates the target grid only (no preview grid) but reads the reference's image tokens; its DiT "
            "VAE-encodes the reference and attends to its cached keys and values at every step.\n\n"
            "| size | AR t2i s | AR edit s | AR edit/t2i | denoise t2i s | denoise edit s | denoise edit/t2i |\n"
            "|---|---|---|---|---|---|---|\n" + "\n".join(rows) +
            f"\n\nAR time of an n=4 edit over an n=1 edit at 256x256 (the n rows share one batch): "
            f"**{num(d['ar_edit_n4_over_n1_256'], 2)}x** (target <= 1.5x).\n")


def scheduler_micro(d: dict) -> str:
    s, pools, summary = d["setup"], d["by_pool"], d["summary"]
    base = summary.get("base")
    smallest = pools[str(s["pools"][0])]["ns_per_event"]
    head = "| denoisers | events/s (range) | ns per event | cost over the smallest pool |"
    if base:
        head += f" base `{base['rev']}` events/s | base ns per event | speed-up |"
    rows = []
    for p in pools.values():
        lo, hi = p["events_per_s_range"]
        row = (f"| {p['denoisers']} | {p['events_per_s']:,} ({lo:,}-{hi:,}) | {p['ns_per_event']:,} | "
               f"{num(p['ns_per_event'] / smallest)}x |")
        if base:
            b = p["base"]
            row += f" {b['events_per_s']:,} | {b['ns_per_event']:,} | **{num(p['speedup_over_base'])}x** |"
        rows.append(row)
    met = "\n".join(f"- {k}: {'met' if v else 'MISSED'}" for k, v in d["targets_met"].items())
    base_growth = ""
    if base:
        by = base["ns_per_event_by_pool"]
        base_growth = f" (the base, measured alongside: {num(by[str(s['pools'][-1])] / by[str(s['pools'][0])])}x)"
    compared = (f" Each round also replays the same stream on the scheduler of `{base['rev']}` "
                f"({base['commit'][:10]}), alternating which goes first, so both sides see the same machine load."
                if base else "")
    return ("## Scheduler alone, events per second (issue 15)\n\n" + run_header(d) +
            f"\nThe pure Scheduler, no driver and no I/O: {s['ar_servers']} AR servers, every denoiser busy and "
            f"{s['queued_outputs']:,} outputs queued behind them; a steady stream of DenoiseSucceeded (each frees a "
            f"denoiser for the next output), RequestArrived (n={s['n']}) and ArBatchSucceeded (batches of "
            f"{s['ar_batch_max_outputs']}) keeps the queue there. The stream is recorded once, then replayed on fresh "
            f"twins; medians of {s['rounds']} rounds of {s['events_per_round']:,} events, the range in brackets."
            f"{compared}\n\n" + head + "\n" + "|---" * head.count(" |") + "|\n" + "\n".join(rows) +
            f"\n\nCost curve: {s['pools'][-1]} denoisers over {s['pools'][0]}: "
            f"**{num(summary['cost_growth_max_over_min_pool'])}x** per event (logarithmic growth allows "
            f"{num(summary['log_growth_bound'], 1)}x). No step scans the pool (free denoisers come off a heap, the "
            "ready counts are kept, not counted), so an event runs the same code at every pool size; what growth "
            "there is comes from around it: the pools are measured one after another on a shared machine, and more "
            "jobs in flight touch more memory" + base_growth + ".\n\n"
            "The tuned scheduler's output is pinned, event by event, to digests of the untuned one's (commit "
            "754a6e4) on two fixed event streams (tests/test_scheduler_replay.py), so tuning cannot change a single "
            "action.\n\n" + met + "\n")


def gateway(d: dict) -> str:
    c1, c32, p = d["summary"]["c1"], d["summary"]["c32"], d["processes"]
    return ("## Gateway overhead (issue 6)\n\n" + run_header(d) +
            "\nReal gateway and REST processes, zero-cost simulated backends; added latency = REST end-to-end minus "
            "a direct gRPC call to the gateway, measured side by side; medians of rounds.\n\n"
            "| figure | value | target |\n|---|---|---|\n"
            f"| REST added latency p50, concurrency 1 | {num(c1['rest_added_p50_ms'])} ms | <= 5 ms |\n"
            f"| REST added latency p99, concurrency 1 | {num(c1['rest_added_p99_ms'])} ms | |\n"
            f"| REST added latency p50 / p99, concurrency 32 | {num(c32['rest_added_p50_ms'])} / "
            f"{num(c32['rest_added_p99_ms'])} ms | |\n"
            f"| REST requests/s, concurrency 32 | {num(c32['rest_rps'], 0)} | >= 300 |\n"
            f"| gateway peak RSS | {p['gateway']['peak_rss_mb']} MB (torch loaded: {p['gateway']['torch_loaded']}) "
            f"| < 150 MB |\n"
            f"| REST peak RSS | {p['rest']['peak_rss_mb']} MB (torch loaded: {p['rest']['torch_loaded']}) | |\n"
            "\nTo compare a change with an earlier revision on the same machine: `make bench-compare BASE=<rev>` "
            "(bench/compare.py) runs this benchmark for `BASE` and `HEAD` in alternating rounds, each from its own "
            "`git archive` export, and writes the medians and HEAD/base ratios of the REST added latency p50 at "
            "concurrency 1 and the requests/s at concurrency 32 to `bench/results/compare_gateway.json`.\n")


def compare_gateway(d: dict) -> str:
    labels = {"rest_added_p50_ms_c1": ("REST added latency p50, concurrency 1", " ms"),
              "rest_rps_c32": ("REST requests/s, concurrency 32", "")}
    rows = []
    for name, (label, unit) in labels.items():
        f = d["figures"][name]
        rows.append(f"| {label} | {num(f['base']['median'])}{unit} ({num(f['base']['min'])}-{num(f['base']['max'])}) | "
                    f"{num(f['head']['median'])}{unit} ({num(f['head']['min'])}-{num(f['head']['max'])}) | "
                    f"**{num(f['head_over_base'], 3)}** ({'higher' if f['higher_is_better'] else 'lower'} is better) |")
    rounds = len(d["figures"]["rest_rps_c32"]["head"]["rounds"])
    load = [round(x, 1) for x in (*d["config"]["load_average_at_start"][:1], *d["config"]["load_average_at_end"][:1])]
    return ("## Gateway overhead, side by side with an earlier revision\n\n" + run_header(d) +
            f"\n`{d['base']['rev']}` ({d['base']['commit'][:10]}) against `{d['head']['rev']}` "
            f"({d['head']['commit'][:10]}), {rounds} rounds each, alternating; medians (range). Load average (1 min) "
            f"at the start and the end: {load[0]}, {load[1]}.\n\n"
            "| figure | base | head | head / base |\n|---|---|---|---|\n" + "\n".join(rows) + "\n")


def e2e(d: dict) -> str:
    m = d["median"]
    return ("## End to end on the real tiny model (issue 8)\n\n" + run_header(d) +
            f"\n{d['setup']['requests']} requests at {d['setup']['size']}x{d['setup']['size']}, "
            f"{d['setup']['steps']} steps. Ours: {d['setup']['ours']}, {d['setup']['concurrency']} concurrent REST "
            f"clients. Monolithic: {d['setup']['monolithic']}. Medians of {len(d['rounds'])} interleaved rounds; "
            "ratios taken per round.\n\n| setup | images/s |\n|---|---|\n"
            f"| ours | {num(m['ours_img_s'])} |\n"
            f"| monolithic, one call per request | {num(m['monolithic_loop_img_s'])} |\n"
            f"| monolithic, batches of 8 prompts | {num(m['monolithic_batch8_img_s'])} |\n\n"
            f"Ours over the per-request loop: **{num(m['ours_over_loop'])}x** (target 2x). Ours over the batched call: "
            f"**{num(m['ours_over_batch8'])}x**.\n\n"
            "Why the hand-batched call can beat us here: on a 2-core CPU it puts both cores on one batch-8 AR and one "
            "batch-8 DiT call with no RPC, no PNG encoding, no base64/HTTP and no process switching, while our stack "
            "splits the same two cores across three model processes (one thread each), the gateway, the REST front and "
            "the load client, and its AR batches are often smaller than 8 because closed-loop clients arrive "
            "staggered. The split pays off when the AR and the denoisers have their own accelerators (see the "
            "scheduler simulation); against the way the pipeline is documented to be called, one request at a time, "
            "the stack is well ahead.\n")


def reconnect(d: dict) -> str:
    s, r = d["setup"], d["seconds_after_serving"]
    rows = [f"| {label} | **{num(r[key]['median'])} s** ({num(r[key]['min'])}-{num(r[key]['max'])}) | "
            f"{num(r['warm_' + key]['median'])} s ({num(r['warm_' + key]['min'])}-{num(r['warm_' + key]['max'])}) |"
            for label, key in (("REST front", "rest_s"), ("SDK, no retries", "sdk_s"))]
    return ("## Back after a gateway restart\n\n" + run_header(d) +
            f"\nReal processes ({s['processes']}). The gateway is SIGKILLed, stays down {s['outage_s']} s (gRPC's "
            "default reconnect backoff would leave the clients seconds late after that) and is restarted on its "
            f"port; from its SERVING the REST front and the SDK each send one 64x64 generation every "
            f"{num(s['poll_s'] * 1000, 0)} ms until served. Medians (range) over {s['restarts']} restarts, beside the "
            "same request on the live gateway just before each kill (what one generation takes anyway). "
            f"Load average (1 min) before and after: {s['load_average_1m_before_after']}. "
            "tests/test_keepalive.py only checks that both come back.\n\n"
            "| client | served, seconds after SERVING | same request, live gateway |\n|---|---|---|\n"
            + "\n".join(rows) + "\n")


def soak(d: dict) -> str:
    text = ("## Soak\n\n" + run_header(d) +
            f"\n{d['duration_s']:.0f} s, {d['clients']} clients, {d['denoiser_kills']} denoiser kills: "
            f"{d['requests']} requests, {d['successes']} succeeded, failures {d['failures_by_reason'] or 'none'}, "
            f"lost {d['lost']}.\n")
    gap = d.get("after_idle_gap")
    if gap is not None:
        text += (f"\nLoad came in {d['busy_s']:.0f} s stretches separated by {d['idle_gaps']} idle gap(s) of "
                 f"{d['idle_gap_s']:.0f} s; of the {gap['requests']} requests started within {gap['window_s']:.0f} s "
                 f"after a gap, {gap['successes']} succeeded, failures {gap['failures_by_reason'] or 'none'}.\n")
    samples = d.get("rss_mib_over_time") or []
    if not samples:
        return text
    names = [k for k in samples[0] if k != "t"]
    picks = sorted({round(i * (len(samples) - 1) / 4) for i in range(5)})  # start, quarters, end
    rows = [f"| {name} | " + " | ".join(f"{samples[i][name]:.0f}" for i in picks)
            + f" | {max(x[name] for x in samples):.0f} |" for name in names]
    return (text + "\nRSS in MiB over the run (a killed denoiser is a new process after its restart):\n\n"
            "| process | " + " | ".join(f"t={samples[i]['t']:.0f} s" for i in picks) + " | max |\n"
            "|---|" + "---|" * (len(picks) + 1) + "\n" + "\n".join(rows) + "\n")


def _flood_cell(x: dict) -> str:
    return f"{x['peak_mb']} / {x['kept_mb']} MB ({x['message_mb']} MB, {', '.join(x['codes'])})"


def receive_flood(d: dict) -> str:
    before = _load("receive_flood_before")
    rows = []
    for name, scenarios in d["servers"].items():
        for scenario, r in scenarios.items():
            b = (before or {}).get("servers", {}).get(name, {}).get(scenario)
            rows.append(f"| {name} | {scenario} | {_flood_cell(b) if b else '-'} | **{_flood_cell(r)}** |")
    text = ("## A flood of large messages, per server (issue 20)\n\n" + run_header(d) +
            f"\n{d['callers']} concurrent callers, each on its own connection, {d['rounds']} rounds; peak and kept RSS "
            "above the server's idle figure (kept: a second after the flood). unauthenticated: a field claiming 60 MiB "
            "and 60 MiB of bytes, without a credential; admitted: the same from a caller the server admits, just "
            "within its receive limit. `keyed`: a gateway with an API key; `open`: one without any key.\n\n")
    if before:
        text += (f"Before: commit {before['machine'].get('commit', '?')}, the same script from its checkout (there "
                 "each server's second flood starts from what its first kept).\n\n")
    return text + ("| server | flood | before: peak / kept (message, codes) | now |\n|---|---|---|---|\n"
                   + "\n".join(rows) + "\n")


def edit_soak(d: dict) -> str:
    rows = [f"| {refs} | {r['requests']} | {r['ok']} | {r['median_s']} s |" for refs, r in d["by_references"].items()]
    return ("## Heavy edits mixed with text-to-image, default timeouts (issue 20)\n\n" + run_header(d) +
            f"\n{d['requests']} requests from {d['clients']} clients in {d['seconds']} s: **{d['ok']} succeeded**; "
            f"workers marked suspect: **{d['suspect_lines']}**, calls past their timeout: {d['overruns']}. References "
            "are 4096x4096 PNGs of about 58 KB; 64x64 outputs, 2 steps, the tiny model.\n\n"
            "| references | requests | succeeded | median latency |\n|---|---|---|---|\n" + "\n".join(rows) + "\n")


def jobs(d: dict) -> str:
    st, store = d["stack"], d["store"]
    rows = [f"| {label} | {num(st[key]['median_s'], 3)} s | {num(st[key]['p95_s'], 3)} s |"
            for label, key in (("synchronous call", "sync"), ("job: POST to completed (polled every "
                                                             f"{num(st['poll_s'] * 1000, 0)} ms)", "job"),
                               ("job: the 202 (written to the store)", "accepted_202"))]
    srows = []
    for name in ("sqlite", "postgres"):
        r = store.get(name, {})
        if "skipped" in r or not r:
            srows.append(f"| {name} | skipped: {r.get('skipped', 'not run')} | | | |")
            continue
        srows.append(f"| {name} | {num(r['inserts_per_s'], 0)} | {num(r['claim_renew_finish_per_s'], 0)} | "
                     f"{num(r['insert']['median_s'] * 1000, 2)} / {num(r['insert']['p95_s'] * 1000, 2)} ms | "
                     f"{num(r['claim']['median_s'] * 1000, 2)} / {num(r['claim']['p95_s'] * 1000, 2)} ms |")
    runners = store.get("sqlite", {}).get("runners", "?")
    return ("## Jobs\n\n" + run_header(d) +
            "\nThe tiny stack (an AR, two denoisers, a gateway, the REST front, the embedded SQLite store): the same "
            f"256x256 requests alternately synchronous and as jobs, {st['sync']['n']} of each, side by side. "
            f"**Job over synchronous, median of the ratios: {num(st['job_over_sync_median_ratio'], 3)}**.\n\n"
            "| | median | p95 |\n|---|---|---|\n" + "\n".join(rows) +
            f"\n\nThe store alone ({runners} runners, each its own connection, claim + renew + finish until none is "
            "left; every job ended exactly once):\n\n"
            "| store | inserts/s | jobs/s through runners | insert median / p95 | claim median / p95 |\n"
            "|---|---|---|---|---|\n" + "\n".join(srows) + "\n")


def _rolling_rows(d: dict) -> str:
    rows = []
    for w in d["windows"]:
        p95 = "-" if w["p95_s"] is None else f"{num(w['p95_s'])} s"
        ratio = "-" if w["p95_over_quiet"] is None else num(w["p95_over_quiet"])
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(w["failures_by_error"].items()))
        rows.append(f"| {w['label']} | {w['seconds']:.0f} s | {w['requests']} | **{w['failed']}**"
                    f"{f' ({kinds})' if kinds else ''} | {w['rest_resubmits']} / {w['rest_reruns']} | "
                    f"{w['client_retries']} | {p95} | {ratio} |")
    return ("| window | length | requests | failed | REST resubmits / reruns | client retries | p95 | p95 / quiet |\n"
            "|---|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n")


def rolling(d: dict) -> str:
    """bench/rolling.py: every role restarted under load, twice by `ctl restart`, then once SIGKILLed; beside it
    the run with the client retrying refused connections, when there is one."""
    s, r, q = d["setup"], d["retried"], d["quiet"]
    text = ("## Rolling restarts (issue 32)\n\n" + run_header(d) +
            "\n`python -m services.launcher` on the tiny model: one AR, two denoisers, two gateways "
            "(the launcher's --queue-without-workers: requests wait for the lone AR), the REST front over both. "
            f"{s['clients']} clients send back-to-back requests through the REST front (generations n=1..3 and "
            f"{s['edit_share']:.0%} edits, 64x64 or 128x128). After {s['quiet_s']:.0f} s of quiet, `ctl restart ROLE` "
            f"rolls {', '.join(s['roles'])} in turn, {s['rounds']} times, then one server of each role is SIGKILLed; "
            f"{s['gap_s']:.0f} s of load between windows. A request counts in every window its run overlaps. "
            + ("The client retries nothing: every failure shows.\n\n" if s["client_retries"] == "none" else
               "The client retries a connection refused (nothing was sent), and only that.\n\n") +
            f"**{d['requests']} requests, {d['failed']} failed** ({'passed' if d['passed'] else 'FAILED: '}"
            f"{'; '.join(d['problems'])}). Retried: the REST front resubmitted {r['rest_resubmits']} to another "
            f"gateway and ran {r['rest_reruns']} cut streams again; the gateways requeued {r['gateway_requeues']:g} "
            f"jobs; the client retried {r['client_retries']} refused connections. Quiet: {q['requests']} requests, "
            f"median {num(q['median_s'])} s, p95 {num(q['p95_s'])} s."
            + (f" The tree had uncommitted changes to {', '.join(s['uncommitted'])}." if s.get("uncommitted") else "")
            + "\n\n" + _rolling_rows(d))
    failures = [f"- {w['label']}: {f}" for w in d["windows"] for f in w["failures"]]
    if failures:
        text += ("\nThe failed requests (the first of each window; in a SIGKILL of the REST front or a gateway, what "
                 "was inside the killed process is lost, as the issue allows; nothing may fail elsewhere):\n\n"
                 + "\n".join(failures) + "\n")
    other = _load("rolling_client_retries")
    if other:
        text += ("\nWith the client retrying refused connections (`" + other["command"] + f"`, run {other['when']}, "
                 f"commit {other['machine'].get('commit', '?')}): {other['requests']} requests, {other['failed']} "
                 f"failed, {other['retried']['client_retries']} refused connections retried.\n\n"
                 + _rolling_rows(other))
    return text


def main() -> None:
    parts = ["# Benchmarks\n\nGenerated by `python -m bench.report` from `bench/results/*.json` (`make bench` writes "
             "them). The machine is a shared 2-core CPU box, so absolute figures are noisy; ratios are measured side "
             "by side in one run and figures are medians.\n"]
    for name, fn in (("ar", ar), ("denoiser", denoiser), ("speed_modes", speed_modes), ("compile", compile_),
                     ("edits", edits),
                     ("scheduler_sim", scheduler_sim),
                     ("multi_gateway_sim", multi_gateway_sim), ("lora_sim", lora_sim), ("tenants_sim", tenants_sim),
                     ("scheduler_micro", scheduler_micro),
                     ("gateway", gateway), ("compare_gateway", compare_gateway), ("e2e", e2e), ("reconnect", reconnect),
                     ("soak", soak), ("receive_flood", receive_flood), ("edit_soak", edit_soak), ("jobs", jobs),
                     ("rolling", rolling)):
        d = _load(name)
        parts.append(fn(d) if d else f"## {name}\n\nNot run yet: `.venv/bin/python -m bench.{name}`.\n")
    OUT.write_text("\n".join(parts))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
