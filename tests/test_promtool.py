"""Every /metrics endpoint passes `promtool check metrics` (classic text format), after real traffic went through.

AR, denoiser and gateway run as real processes with --metrics-port; the REST front serves /metrics on its own port.
promtool comes from the `prometheus` Debian package; this test installs nothing itself.
"""
from __future__ import annotations

import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.support.cluster import SERVICES, reap, wait_serving
from tests.support.net import free_port

pytestmark = pytest.mark.e2e

STARTUP_TIMEOUT = 240.0


@dataclass
class Server:
    name: str
    proc: subprocess.Popen
    port: int
    metrics_url: str


def wait_http(url: str, proc: subprocess.Popen, timeout: float) -> None:
    """The REST front has no push signal: retry its /metrics until it answers, the process dies, or time is up."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError):
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"{url} never answered (exit code {proc.poll()})")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def servers(tiny_checkpoint: Path) -> Iterator[dict[str, Server]]:
    started: list[subprocess.Popen] = []

    def spawn(module: str, *flags: str) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-m", module, "--host", "127.0.0.1", *flags])
        started.append(proc)
        return proc

    try:
        out: dict[str, Server] = {}
        model_flags = ["--log-level", "WARNING", "--device", "cpu", "--torch-threads", "1"]
        for name, module in [("ar", "services.ar"), ("denoiser", "services.denoiser")]:
            port, mport = free_port(), free_port()
            proc = spawn(module, "--port", str(port), "--metrics-port", str(mport), *model_flags)
            out[name] = Server(name, proc, port, f"http://127.0.0.1:{mport}/metrics")
        for name in ("ar", "denoiser"):
            wait_serving(f"127.0.0.1:{out[name].port}", SERVICES[name], STARTUP_TIMEOUT)

        port, mport = free_port(), free_port()
        proc = spawn("gateway", "--port", str(port), "--metrics-port", str(mport), "--log-level", "WARNING",
                     "--ar", f"127.0.0.1:{out['ar'].port}", "--denoiser", f"127.0.0.1:{out['denoiser'].port}")
        out["gateway"] = Server("gateway", proc, port, f"http://127.0.0.1:{mport}/metrics")
        wait_serving(f"127.0.0.1:{port}", SERVICES["gateway"], 60)

        rport = free_port()
        proc = spawn("gateway.rest", "--port", str(rport), "--gateway-address", f"127.0.0.1:{port}",
                     "--log-level", "warning")
        out["rest"] = Server("rest", proc, rport, f"http://127.0.0.1:{rport}/metrics")
        wait_http(out["rest"].metrics_url, proc, 60)

        # Real traffic first, so labelled series and histogram buckets exist when they are linted; one bad request
        # too, for the failure counters.
        ok = httpx.post(f"http://127.0.0.1:{rport}/v1/images/generations", timeout=120,
                        json={"prompt": "a red sign", "n": 2, "size": "64x64", "seed": 1})
        assert ok.status_code == 200, ok.text
        bad = httpx.post(f"http://127.0.0.1:{rport}/v1/images/generations", timeout=60, json={"prompt": "", "n": 1})
        assert bad.status_code == 400, bad.text
        yield out
    finally:
        for proc in reversed(started):
            if proc.poll() is None:
                proc.terminate()
        for proc in started:
            reap(proc, 60)


EXPECTED = {
    "ar": "python_info",  # the AR server has no metrics of its own yet: the process collectors still count
    "denoiser": "glmimage_denoiser_",
    "gateway": 'glmimage_gateway_queue_outputs{stage="denoise"}',  # the denoiser HPA's metric
    "rest": "glmimage_rest_",
}


@pytest.mark.parametrize("name", ["ar", "denoiser", "gateway", "rest"])
def test_metrics_pass_promtool(name: str, servers: dict[str, Server], promtool: str) -> None:
    # No Accept header: the classic text format (0.0.4), which is what is linted.
    with urllib.request.urlopen(servers[name].metrics_url, timeout=10) as resp:
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
