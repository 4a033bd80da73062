"""Every /metrics endpoint passes `promtool check metrics` (classic text format), after real traffic went through.

AR, denoiser and gateway run as real processes with --metrics-port; the REST front serves /metrics on its own port.
promtool comes from the `prometheus` Debian package; this test installs nothing itself.
"""
from __future__ import annotations

import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.cluster import Cluster

pytestmark = pytest.mark.e2e

STARTUP_TIMEOUT = 240.0


@pytest.fixture(scope="module")
def servers(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Each server's /metrics URL. Every process binds port 0 and reports its ports (tests.support.cluster)."""
    cluster = Cluster(tmp_path_factory.mktemp("promtool"))
    try:
        quiet = ["--log-level", "WARNING"]
        for role in ("ar", "denoiser"):
            cluster.start(role, role, quiet, metrics=True, wait=False)
        for role in ("ar", "denoiser"):
            cluster.wait_ready(role, STARTUP_TIMEOUT)
        ar, dn = cluster.procs["ar"], cluster.procs["denoiser"]
        gw = cluster.start("gateway", "gateway", [*quiet, "--ar", ar.address, "--denoiser", dn.address],
                           metrics=True)
        rest = cluster.start("rest", "rest", ["--gateway-address", gw.address, "--log-level", "warning"])
        base = f"http://{rest.address}"
        # Real traffic first, so labelled series and histogram buckets exist when they are linted; one bad request
        # too, for the failure counters.
        ok = httpx.post(f"{base}/v1/images/generations", timeout=120,
                        json={"prompt": "a red sign", "n": 2, "size": "64x64", "seed": 1})
        assert ok.status_code == 200, ok.text
        bad = httpx.post(f"{base}/v1/images/generations", timeout=60, json={"prompt": "", "n": 1})
        assert bad.status_code == 400, bad.text
        urls = {p.name: f"http://127.0.0.1:{p.metrics_port}/metrics" for p in (ar, dn, gw)}
        yield {**urls, "rest": f"{base}/metrics"}
    finally:
        cluster.close()


EXPECTED = {
    "ar": "python_info",  # the AR server has no metrics of its own yet: the process collectors still count
    "denoiser": "glmimage_denoiser_",
    "gateway": 'glmimage_gateway_queue_outputs{stage="denoise"}',  # the denoiser HPA's metric
    "rest": "glmimage_rest_",
}


@pytest.mark.parametrize("name", ["ar", "denoiser", "gateway", "rest"])
def test_metrics_pass_promtool(name: str, servers: dict[str, str], promtool: str) -> None:
    # No Accept header: the classic text format (0.0.4), which is what is linted.
    with urllib.request.urlopen(servers[name], timeout=10) as resp:
        content_type = resp.headers["Content-Type"]
        text = resp.read().decode()
    assert content_type.startswith("text/plain"), content_type
    assert EXPECTED[name] in text, f"{name}: no {EXPECTED[name]} in\n{text[:2000]}"
    done = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and not done.stdout.strip() and not done.stderr.strip(), (
        f"promtool on {name}'s /metrics:\n{done.stdout}{done.stderr}")


def test_promtool_catches_a_bad_metric(promtool: str) -> None:
    """The check can fail: a counter without the _total suffix is reported."""
    bad = "# HELP jobs Jobs done.\n# TYPE jobs counter\njobs 3\n"
    done = subprocess.run([promtool, "check", "metrics"], input=bad, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "_total" in done.stdout + done.stderr
