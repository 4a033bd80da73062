"""The Grafana dashboard (k8s/glmimage/files/glmimage-dashboard.json): every panel's query evaluated by a real
Prometheus scraping a real stack on loopback, the core panels returning data after some traffic; no hard-coded job
names; its metric names the code's; and the chart's ConfigMap for Grafana's sidecar, off by default."""
from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.chart import CHART, RELEASE, by_kind, render
from tests.support.cluster import reap, running_stack
from tests.support.net import free_port
from tests.support.waiting import until as _until
from tests.test_alerts import SUFFIXES, _exported_names, _rules

DASHBOARD = CHART / "files" / "glmimage-dashboard.json"
# The panels that may show nothing after a short, healthy run: no work was put back in a queue, no tenant went over a
# quota (the stack has no tenants file), and no gateway has a quota store.
QUIET_PANELS = {"Requeues by reason", "Quota refusals by tenant", "Quota store up"}
SCRAPE_S = 1
SCREENSHOT = Path(__file__).resolve().parents[1] / "docs" / "images" / "dashboard.png"


def _targets() -> list[tuple[str, str]]:
    """(panel title, expr) of every query, Grafana's variables set as "All" would set them."""
    out = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"].replace("$__rate_interval", "30s")
            out.append((panel["title"], re.sub(r"\$(gateway|denoiser)\b", ".*", expr)))
    return out


def test_the_dashboard_picks_its_data_source_and_names_no_job() -> None:
    doc = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in doc["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    panels = [p for p in doc["panels"] if p["type"] != "row"]
    assert len(panels) >= 15 and len({p["id"] for p in doc["panels"]}) == len(doc["panels"])
    for panel in panels:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert all(t["datasource"]["uid"] == "${datasource}" for t in panel["targets"]), panel["title"]
    for title, expr in _targets():
        assert not re.search(r"\bjob\s*=", expr), f"{title}: a hard-coded job name: {expr}"


def test_every_metric_the_dashboard_reads_is_one_the_code_exports() -> None:
    from rest.metrics import RestMetrics

    exported = _exported_names() | {family.name for family in RestMetrics().registry.collect()}
    read = {m for _, expr in _targets() for m in re.findall(r"\bglmimage_\w+", expr)}
    unknown = sorted(m for m in read if m not in exported and m.removesuffix(next(
        (s for s in SUFFIXES if m.endswith(s)), "")) not in exported)
    assert not unknown, f"the dashboard reads metrics the code does not export: {unknown}"


def test_the_chart_s_dashboard_config_map_is_off_by_default_and_carries_the_file(default_docs: list[dict]) -> None:
    assert not any(name.endswith("-dashboard") for name in by_kind(default_docs, "ConfigMap"))
    docs = render({"metrics": {"grafanaDashboard": {"enabled": True, "folder": "GLM-Image"}}})
    cm = by_kind(docs, "ConfigMap")[f"{RELEASE}-glmimage-dashboard"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"]["grafana_folder"] == "GLM-Image"
    assert json.loads(cm["data"]["glmimage-dashboard.json"]) == json.loads(DASHBOARD.read_text())


# ---- the Tenants row on synthetic series (promtool) ----------------------------------------------------------------

# Two gateways, tenants alpha and beta, 1-minute samples: what each panel of the Tenants row must compute from them
# (rates over 5m, summed or maxed over the gateways as the panel's title says).
TENANT_SERIES = {
    'glmimage_gateway_tenant_requests_total{tenant="alpha", outcome="ok", instance="gw-a"}': "0+60x10",
    'glmimage_gateway_tenant_requests_total{tenant="alpha", outcome="ok", instance="gw-b"}': "0+120x10",
    'glmimage_gateway_tenant_requests_total{tenant="beta", outcome="rate_limited", instance="gw-a"}': "0+30x10",
    'glmimage_gateway_tenant_images_total{tenant="alpha", instance="gw-a"}': "0+120x10",
    'glmimage_gateway_tenant_images_total{tenant="alpha", instance="gw-b"}': "0+60x10",
    'glmimage_gateway_tenant_images_total{tenant="beta", instance="gw-a"}': "0+6x10",
    'glmimage_gateway_tenant_queue_depth{tenant="alpha", stage="ar", instance="gw-a"}': "3x10",
    'glmimage_gateway_tenant_queue_depth{tenant="alpha", stage="ar", instance="gw-b"}': "2x10",
    'glmimage_gateway_tenant_queue_depth{tenant="alpha", stage="denoise", instance="gw-a"}': "4x10",
    'glmimage_gateway_tenant_queue_depth{tenant="beta", stage="ar", instance="gw-a"}': "0x10",
    'glmimage_gateway_tenant_oldest_wait_seconds{tenant="alpha", instance="gw-a"}': "30x10",
    'glmimage_gateway_tenant_oldest_wait_seconds{tenant="alpha", instance="gw-b"}': "90x10",
    'glmimage_gateway_tenant_oldest_wait_seconds{tenant="beta", instance="gw-a"}': "5x10",
    # alpha: 100 waits a minute on each gateway, all between 1 and 21 s; beta: 60 a minute, all under 1 s.
    'glmimage_gateway_tenant_queue_wait_seconds_bucket{tenant="alpha", le="1", instance="gw-a"}': "0x10",
    'glmimage_gateway_tenant_queue_wait_seconds_bucket{tenant="alpha", le="21", instance="gw-a"}': "0+100x10",
    'glmimage_gateway_tenant_queue_wait_seconds_bucket{tenant="alpha", le="+Inf", instance="gw-a"}': "0+100x10",
    'glmimage_gateway_tenant_queue_wait_seconds_bucket{tenant="alpha", le="1", instance="gw-b"}': "0x10",
    'glmimage_gateway_tenant_queue_wait_seconds_bucket{tenant="alpha", le="21", instance="gw-b"}': "0+100x10",
    'glmimage_gateway_tenant_queue_wait_seconds_bucket{tenant="alpha", le="+Inf", instance="gw-b"}': "0+100x10",
    'glmimage_gateway_tenant_queue_wait_seconds_bucket{tenant="beta", le="1", instance="gw-a"}': "0+60x10",
    'glmimage_gateway_tenant_queue_wait_seconds_bucket{tenant="beta", le="21", instance="gw-a"}': "0+60x10",
    'glmimage_gateway_tenant_queue_wait_seconds_bucket{tenant="beta", le="+Inf", instance="gw-a"}': "0+60x10",
    'glmimage_gateway_tenant_quota_refusals_total{tenant="beta", quota="requests_per_minute", instance="gw-a"}':
        "0+30x10",
    # 64x64 images of 2 steps, two a second.
    'glmimage_gateway_tenant_usage_pixel_steps_total{tenant="alpha", instance="gw-a"}': f"0+{64 * 64 * 2 * 120}x10",
    'glmimage_gateway_quota_store_up{instance="gw-a"}': "1x10",
    'glmimage_gateway_quota_store_up{instance="gw-b"}': "1 1 1 0x7",
}
TENANT_PANELS = {
    "Requests by tenant and outcome": {'{tenant="alpha", outcome="ok"}': 3,
                                       '{tenant="beta", outcome="rate_limited"}': 0.5},
    "Images by tenant": {'{tenant="alpha"}': 3, '{tenant="beta"}': 0.1},
    "Queue depth by tenant and stage": {'{tenant="alpha", stage="ar"}': 5, '{tenant="alpha", stage="denoise"}': 4,
                                        '{tenant="beta", stage="ar"}': 0},
    "Oldest wait by tenant": {'{tenant="alpha"}': 90, '{tenant="beta"}': 5},
    # Linear within the (1, 21] bucket: 1 + 20 x 0.95 (a width that keeps it exact in floating point); beta's waits
    # are all in the first bucket, (0, 1].
    "Queue wait p95 by tenant": {'{tenant="alpha"}': 20, '{tenant="beta"}': 0.95},
    "Quota refusals by tenant": {'{tenant="beta", quota="requests_per_minute"}': 0.5},
    "Usage: pixel-steps by tenant": {'{tenant="alpha"}': 64 * 64 * 2 * 2},
    "Quota store up": {'{instance="gw-a"}': 1, '{instance="gw-b"}': 0},
}


def _row(doc: dict, title: str) -> list[dict]:
    """The panels of a row: those after its row panel, up to the next row."""
    panels = doc["panels"]
    start = next(i for i, p in enumerate(panels) if p["type"] == "row" and p["title"] == title) + 1
    end = next((i for i in range(start, len(panels)) if panels[i]["type"] == "row"), len(panels))
    return panels[start:end]


def _check_on_synthetic_series(promtool: str, tmp_path: Path, series: dict[str, str],
                               cases: list[tuple[str, dict[str, float]]]) -> None:
    """promtool evaluates each (panel query, Grafana's variables set as "All" would set them; expected samples) at
    minute 10 of the series, one sample a minute, rates over 5m."""
    tests = [{"expr": re.sub(r"\$(gateway|denoiser)\b", ".*", expr.replace("$__rate_interval", "5m")),
              "eval_time": "10m", "exp_samples": [{"labels": labels, "value": value} for labels, value in want.items()]}
             for expr, want in cases]
    spec = {"rule_files": [], "evaluation_interval": "1m", "tests": [{
        "interval": "1m", "input_series": [{"series": k, "values": v} for k, v in series.items()],
        "promql_expr_test": tests}]}
    (tmp_path / "row_test.yaml").write_text(json.dumps(spec))  # JSON is YAML
    done = subprocess.run([promtool, "test", "rules", "row_test.yaml"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def _alert_bound(name: str) -> float:
    (rule,) = [r for r in _rules() if r["alert"] == name]
    return float(re.fullmatch(r".*> (\d+)", rule["expr"].strip()).group(1))


def _draws_bound_as_a_line(panel: dict, bound: float) -> None:
    defaults = panel["fieldConfig"]["defaults"]
    assert defaults["thresholds"]["steps"][-1]["value"] == bound
    assert defaults["custom"]["thresholdsStyle"]["mode"] == "line"


def test_the_tenants_row_computes_what_its_titles_say_on_synthetic_series(promtool: str, tmp_path: Path) -> None:
    """Each Tenants panel's query evaluated by promtool over series of two gateways and two tenants; a new panel in
    the row needs a case here."""
    panels = _row(json.loads(DASHBOARD.read_text()), "Tenants")
    assert {p["title"] for p in panels} == set(TENANT_PANELS)
    cases = []
    for panel in panels:
        (target,) = panel["targets"]
        cases.append((target["expr"], TENANT_PANELS[panel["title"]]))
    _check_on_synthetic_series(promtool, tmp_path, TENANT_SERIES, cases)
    # The oldest-wait panel draws the starvation alert's bound as a line.
    (oldest,) = [p for p in panels if p["title"] == "Oldest wait by tenant"]
    _draws_bound_as_a_line(oldest, _alert_bound("GlmImageTenantStarved"))


# ---- the Jobs row on synthetic series (promtool) -------------------------------------------------------------------

# Two gateways on one job store, 1-minute samples. Store-wide gauges (jobs by status, the oldest queued, the store's
# leases, pending webhooks) come from every gateway, read a few seconds apart: the panels take the largest report.
# Counters and the runner's leases are each gateway's own: the panels sum them.
JOB_SERIES = {
    'glmimage_jobs{status="queued", instance="gw-a"}': "5x10",
    'glmimage_jobs{status="queued", instance="gw-b"}': "4x10",
    'glmimage_jobs{status="in_progress", instance="gw-a"}': "3x10",
    'glmimage_jobs{status="in_progress", instance="gw-b"}': "3x10",
    'glmimage_jobs{status="completed", instance="gw-a"}': "40x10",
    'glmimage_jobs{status="completed", instance="gw-b"}': "41x10",
    'glmimage_jobs_oldest_queued_seconds{instance="gw-a"}': "120x10",
    'glmimage_jobs_oldest_queued_seconds{instance="gw-b"}': "115x10",
    'glmimage_jobs_submitted_total{tenant="alpha", instance="gw-a"}': "0+60x10",
    'glmimage_jobs_submitted_total{tenant="alpha", instance="gw-b"}': "0+30x10",
    'glmimage_jobs_submitted_total{tenant="beta", instance="gw-a"}': "0+6x10",
    'glmimage_jobs_finished_total{status="completed", instance="gw-a"}': "0+60x10",
    'glmimage_jobs_finished_total{status="completed", instance="gw-b"}': "0+60x10",
    'glmimage_jobs_finished_total{status="failed", instance="gw-a"}': "0+6x10",
    'glmimage_jobs_finished_total{status="cancelled", instance="gw-a"}': "0x10",
    # The runners hold 3 leases, the store counts 4: one of a runner that stopped reporting.
    'glmimage_job_leases{scope="runner", instance="gw-a"}': "2x10",
    'glmimage_job_leases{scope="runner", instance="gw-b"}': "1x10",
    'glmimage_job_leases{scope="store", instance="gw-a"}': "4x10",
    'glmimage_job_leases{scope="store", instance="gw-b"}': "4x10",
    'glmimage_job_takeovers_total{instance="gw-a"}': "0+12x10",
    'glmimage_job_takeovers_total{instance="gw-b"}': "0x10",
    'glmimage_job_lease_lost_total{instance="gw-a"}': "0x10",
    'glmimage_job_lease_lost_total{instance="gw-b"}': "0+6x10",
    'glmimage_webhook_deliveries_total{outcome="delivered", instance="gw-a"}': "0+60x10",
    'glmimage_webhook_deliveries_total{outcome="retry", instance="gw-b"}': "0+30x10",
    'glmimage_webhook_deliveries_total{outcome="failed", instance="gw-a"}': "0x10",
    'glmimage_webhook_deliveries_total{outcome="refused", instance="gw-b"}': "0+6x10",
    'glmimage_webhook_pending{instance="gw-a"}': "7x10",
    'glmimage_webhook_pending{instance="gw-b"}': "6x10",
}
# Panel title -> the legend of each of its queries -> what that query must compute.
JOB_PANELS = {
    "Jobs by status": {"{{status}}": {'{status="queued"}': 5, '{status="in_progress"}': 3,
                                      '{status="completed"}': 41}},
    "Oldest queued job": {"oldest queued": {"{}": 120}},
    "Jobs submitted by tenant": {"{{tenant}}": {'{tenant="alpha"}': 1.5, '{tenant="beta"}': 0.1}},
    "Jobs finished by status": {"{{status}}": {'{status="completed"}': 2, '{status="failed"}': 0.1,
                                               '{status="cancelled"}': 0}},
    "Job leases: runners and store": {"runners (sum)": {"{}": 3}, "store": {"{}": 4}},
    "Takeovers and lost leases": {"takeovers": {"{}": 0.2}, "leases lost": {"{}": 0.1}},
    "Webhook deliveries by outcome": {"{{outcome}}": {'{outcome="delivered"}': 1, '{outcome="retry"}': 0.5,
                                                      '{outcome="failed"}': 0, '{outcome="refused"}': 0.1}},
    "Webhooks pending": {"pending": {"{}": 7}},
}


def test_the_jobs_row_computes_what_its_titles_say_on_synthetic_series(promtool: str, tmp_path: Path) -> None:
    """Each Jobs panel's queries evaluated by promtool over series of two gateways sharing a job store; a new panel
    or query in the row needs a case here."""
    panels = _row(json.loads(DASHBOARD.read_text()), "Jobs")
    assert {p["title"] for p in panels} == set(JOB_PANELS)
    cases = []
    for panel in panels:
        by_legend = {t["legendFormat"]: t["expr"] for t in panel["targets"]}
        assert set(by_legend) == set(JOB_PANELS[panel["title"]]), panel["title"]
        cases += [(by_legend[legend], want) for legend, want in JOB_PANELS[panel["title"]].items()]
    _check_on_synthetic_series(promtool, tmp_path, JOB_SERIES, cases)
    # The row reads every job metric the gateway exports.
    from prometheus_client import CollectorRegistry

    from gateway.jobs.metrics import JobMetrics

    registry = CollectorRegistry()
    JobMetrics(registry)
    read = {m for p in panels for t in p["targets"] for m in re.findall(r"\bglmimage_\w+", t["expr"])}
    assert {m.removesuffix("_total") for m in read} == {family.name for family in registry.collect()}
    (oldest,) = [p for p in panels if p["title"] == "Oldest queued job"]
    _draws_bound_as_a_line(oldest, _alert_bound("GlmImageJobsBacklogged"))


# ---- a real Prometheus over a real stack --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prometheus(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("prometheus not found. It comes from the Debian package `prometheus`, which `make tools` "
                    "installs")
    work = tmp_path_factory.mktemp("prometheus")
    metrics = ("--ar-metrics-port", "0", "--denoiser-metrics-ports", "0,0", "--gateway-metrics-port", "0")
    (work / "stack").mkdir()
    with running_stack(work / "stack", extra_args=metrics) as run:
        addr = run.addresses
        targets = [urllib.parse.urlsplit(addr[f"{n}-metrics"]).netloc
                   for n in ("ar", "denoiser-0", "denoiser-1", "gateway", "rest")]
        config = work / "prometheus.yml"
        config.write_text(json.dumps({  # JSON is YAML
            "global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": f"{SCRAPE_S}s"},
            "scrape_configs": [{"job_name": "glmimage", "static_configs": [{"targets": targets}]}]}))
        port = free_port()
        proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={work / 'data'}",
                                 f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=subprocess.DEVNULL, stderr=(work / "prometheus.log").open("wb"))
        url = f"http://127.0.0.1:{port}"
        try:
            _until(lambda: _ready(url, proc), 90, "Prometheus ready", step=0.2)
            _until(lambda: _value(url, "count(up == 1)") == len(targets), 90, "every target scraped", step=0.2)
            _traffic(addr["rest"], addr["gateway"])
            yield url
        finally:
            proc.terminate()
            reap(proc, 30)


def _ready(url: str, proc: subprocess.Popen) -> bool:
    assert proc.poll() is None, "prometheus exited"
    try:
        return httpx.get(f"{url}/-/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _query(url: str, expr: str) -> dict:
    return httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10).json()


def _value(url: str, expr: str) -> float | None:
    result = _query(url, expr).get("data", {}).get("result", [])
    return float(result[0]["value"][1]) if result else None


def _traffic(rest: str, gateway: str) -> None:
    """Requests of each kind a panel shows: n=2 (a batch, two denoise jobs), a cached one, a streamed one, a bad one,
    two naming the tiny model's demo adapter over gRPC (a load, then a hit) and a job (JobService, run to its end),
    twice over a few scrapes so the rates have two samples."""
    import grpc

    from glmimage.v1 import common_pb2, gateway_service_pb2_grpc, job_service_pb2, job_service_pb2_grpc
    from glmimage.v1 import gateway_service_pb2 as pb
    from services.model.tiny import TINY_LORA

    body = {"prompt": 'a red "STOP" sign', "size": "64x64", "seed": 5}
    styled = pb.GenerateImagesRequest(prompt='a "lora" sign', height=64, width=64, seed=5, num_inference_steps=2,
                                      loras=[common_pb2.LoraRef(name=TINY_LORA)])
    job = job_service_pb2.SubmitJobRequest(request=pb.GenerateImagesRequest(
        prompt='a "job" sign', height=64, width=64, seed=5, num_inference_steps=2))
    with httpx.Client(base_url=f"http://{rest}", timeout=120) as http, grpc.insecure_channel(gateway) as channel:
        stub = gateway_service_pb2_grpc.GatewayServiceStub(channel)
        jobs = job_service_pb2_grpc.JobServiceStub(channel)
        for _ in range(2):
            submitted = jobs.SubmitJob(job, timeout=30).job
            *_, last = jobs.WatchJob(job_service_pb2.WatchJobRequest(id=submitted.id), timeout=120)
            assert last.job.status == job_service_pb2.JOB_STATUS_COMPLETED, last.job
            for _ in range(2):
                assert stub.GenerateImages(styled, timeout=120).images[0].image.startswith(b"\x89PNG")
            assert http.post("/v1/images/generations", json={**body, "n": 2}).status_code == 200
            cached = {**body, "num_inference_steps": 8, "step_cache": "aggressive"}
            assert http.post("/v1/images/generations", json=cached).status_code == 200
            assert http.post("/v1/images/generations", json={**body, "n": 0}).status_code == 400
            png = http.post("/v1/images/generations", json={**body, "response_format": "b64_json"}).json()
            assert base64.b64decode(png["data"][0]["b64_json"]).startswith(b"\x89PNG")
            time.sleep(3 * SCRAPE_S)  # scrapes between the rounds are the point: a rate needs two samples


def test_every_panel_query_parses_and_the_core_panels_show_data(prometheus: str) -> None:
    def answers() -> list[tuple[str, str, dict]]:
        return [(title, expr, _query(prometheus, expr)) for title, expr in _targets()]

    for title, expr, reply in answers():
        assert reply["status"] == "success", f"{title}: {expr}: {reply.get('error')}"
    empty: list[str] = []

    def all_core_have_data() -> bool:
        empty[:] = [f"{title}: {expr}" for title, expr, reply in answers()
                    if title not in QUIET_PANELS and not reply["data"]["result"]]
        return not empty

    try:
        _until(all_core_have_data, 60, "data in every core panel", step=0.2)
    except AssertionError:
        raise AssertionError("panels without data: " + "; ".join(empty)) from None


def test_the_lora_panels_show_the_adapter_traffic(prometheus: str) -> None:
    """The demo adapter's requests: the pool-wide hit rate is hits / (hits + misses) of them (a miss that loaded it,
    then hits), and a denoiser holds it loaded."""
    panels = {p["title"]: p for p in json.loads(DASHBOARD.read_text())["panels"]}
    pool = next(t["expr"] for t in panels["LoRA adapter hit rate"]["targets"] if t["legendFormat"] == "pool")
    pool = re.sub(r"\$denoiser\b", ".*", pool.replace("$__rate_interval", "10m"))
    _until(lambda: (_value(prometheus, "sum(glmimage_denoiser_lora_hits_total)") or 0) >= 1, 30, "a hit", step=0.2)
    rate = _value(prometheus, pool)
    assert rate is not None and 0 < rate < 1, rate
    (loaded,) = [t["expr"] for t in panels["LoRA adapters loaded"]["targets"]]
    assert _value(prometheus, f'sum({loaded.replace("$denoiser", ".*")})') >= 1


def test_a_picture_of_the_dashboard_is_drawn_from_its_queries(prometheus: str, tmp_path: Path) -> None:
    """The docs' picture (docs/images/dashboard.png with GLMIMAGE_SCREENSHOTS=1, `make screenshots`), drawn from the
    dashboard's own queries over the traffic above; on every run, so the picture cannot drift from the dashboard."""
    from tests.support.dashboard_preview import draw

    out = tmp_path / "dashboard.png"
    panels = [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["type"] != "row"]
    lines = draw(prometheus, json.loads(DASHBOARD.read_text()), out, window_s=15)
    assert lines >= len(panels) - len(QUIET_PANELS)  # at least a line in every panel that has data
    assert out.read_bytes().startswith(b"\x89PNG")
    if os.environ.get("GLMIMAGE_SCREENSHOTS"):
        shutil.copy(out, SCREENSHOT)
