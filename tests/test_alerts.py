"""The alert rules (k8s/glmimage/files/glmimage.rules.yaml): valid for promtool, each alert unit-tested firing and
not firing (tests/alerts/rules_test.yaml), every metric they read exported by the code, every runbook written, and the
chart's PrometheusRule carrying exactly these rules, off by default."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry

from tests.support.chart import CHART, RELEASE, by_kind, render

REPO = Path(__file__).resolve().parents[1]
RULES = CHART / "files" / "glmimage.rules.yaml"
UNIT_TESTS = REPO / "tests" / "alerts" / "rules_test.yaml"
RUNBOOKS = REPO / "docs" / "operating.md"
SUFFIXES = ("_total", "_bucket", "_count", "_sum", "_created")


def _rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def _exported_names() -> set[str]:
    """Every metric family the gateway (its jobs' included), the denoiser and the AR export, as the code defines
    them."""
    from gateway.jobs.metrics import JobMetrics
    from gateway.metrics import GatewayMetrics
    from services.ar import metrics as ar_metrics  # noqa: F401 - registers its metrics on the default registry
    from services.denoiser import metrics as denoiser_metrics  # noqa: F401

    registry, jobs = CollectorRegistry(), CollectorRegistry()
    GatewayMetrics(registry).quota_store(True)  # glmimage_gateway_quota_store_up: exported with --quota-store only
    JobMetrics(jobs)
    from prometheus_client import REGISTRY

    return {family.name for reg in (registry, jobs, REGISTRY) for family in reg.collect()}


def test_promtool_accepts_the_rules_and_every_unit_test_passes(promtool: str) -> None:
    checked = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = subprocess.run([promtool, "test", "rules", UNIT_TESTS.name], cwd=UNIT_TESTS.parent, capture_output=True,
                            text=True)
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_every_alert_has_a_firing_and_a_quiet_unit_test() -> None:
    cases = [case for test in yaml.safe_load(UNIT_TESTS.read_text())["tests"] for case in test["alert_rule_test"]]
    for rule in _rules():
        name = rule["alert"]
        mine = [case for case in cases if case["alertname"] == name]
        assert any(case["exp_alerts"] for case in mine), f"{name}: no test where it fires"
        assert any(not case["exp_alerts"] for case in mine), f"{name}: no test where it stays quiet"


def test_every_metric_the_rules_read_is_one_the_code_exports() -> None:
    exported = _exported_names()
    read = {m for rule in _rules() for m in re.findall(r"\bglmimage_\w+", rule["expr"])}
    assert read, "the rules read no glmimage metric"
    unknown = sorted(m for m in read if m not in exported and m.removesuffix(next(
        (s for s in SUFFIXES if m.endswith(s)), "")) not in exported)
    assert not unknown, f"the rules read metrics the code does not export: {unknown}"


def test_every_alert_has_a_runbook_in_the_docs() -> None:
    text = RUNBOOKS.read_text()
    headings = {re.sub(r"[^a-z0-9 -]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
                for line in text.splitlines() if line.startswith("#")}
    for rule in _rules():
        anchor = rule["annotations"]["runbook"].split("#", 1)[1]
        assert rule["annotations"]["runbook"] == f"docs/operating.md#{anchor}"
        assert anchor in headings, f"{rule['alert']}: no runbook heading for #{anchor} in docs/operating.md"
        assert rule["labels"]["severity"] in ("warning", "critical")


@pytest.fixture(scope="module")
def rule_docs() -> list[dict]:
    return render({"metrics": {"prometheusRule": {"enabled": True, "labels": {"release": "kube-prom"}}}})


def test_the_chart_s_prometheus_rule_is_off_by_default_and_carries_the_rules_file(
        default_docs: list[dict], rule_docs: list[dict]) -> None:
    assert by_kind(default_docs, "PrometheusRule") == {}
    (rule,) = by_kind(rule_docs, "PrometheusRule").values()
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["name"] == f"{RELEASE}-glmimage"
    assert rule["metadata"]["labels"]["release"] == "kube-prom"
    assert rule["spec"] == yaml.safe_load(RULES.read_text())  # the same rules, templates left for Prometheus
