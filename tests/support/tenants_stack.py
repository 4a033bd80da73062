"""The launcher's stack with ``--tenants FILE`` as real processes, for issue 30's done-when tests
(tests/test_tenants_e2e.py, tests/test_tenants_redis_e2e.py, tests/test_tenants_reload.py).

``python -m services.launcher`` on ephemeral ports, its log (every child's too: they inherit its stderr) in a file
the tests read, ready once its --ready-file appears; the tenants file rewritten atomically (a temporary file renamed
over it), as an operator or the chart's Secret update does; gRPC and REST calls with a tenant's key; one sample of a
Prometheus endpoint.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
from prometheus_client.parser import text_string_to_metric_families

from glmimage.v1 import gateway_service_pb2 as pb
from glmimage.v1 import gateway_service_pb2_grpc
from tests.support.cluster import reap
from tests.support.rest_tenants import tenants_toml
from tests.support.waiting import until

# Building nothing (the tiny checkpoint is the session fixture's), but importing torch in five processes at once on
# a loaded 2-core machine: a minute or two.
START_TIMEOUT_S = 240.0
# The smallest useful job of the tiny model: a flood of them takes seconds on 2 cores, not minutes.
# The tiny model's job at its smallest size, with enough denoising steps that the denoise stage (where a flood
# queues) outweighs the AR's share: about half a second alone on a 2-core machine, 48 of them take 15 to 20 s.
SIZE, STEPS = 64, 96
GENERATIONS = "/v1/images/generations"
RATE_LIMIT_HEADERS = tuple(f"x-ratelimit-{what}-{kind}" for kind in ("requests", "images")
                           for what in ("limit", "remaining", "reset"))


def seconds_of_reset(text: str) -> float:
    """An x-ratelimit-reset-* duration in OpenAI's form ("250ms", "12s", "1m0s", "1h0m0s") as seconds."""
    if text.endswith("ms"):
        return int(text[:-2]) / 1000
    m = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(\d+)s", text)
    assert m, f"not a reset duration: {text!r}"
    hours, minutes, secs = (int(g or 0) for g in m.groups())
    return hours * 3600 + minutes * 60 + secs


def write_tenants(path: Path, tenants: dict[str, dict[str, object]]) -> None:
    """The tenants file, replaced in one rename: a reader (a SIGHUP reload) sees the old file or the new, never half."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(tenants_toml(tenants))
    tmp.replace(path)


def bearer(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


def request(prompt: str, seed: int = 0, n: int = 1, steps: int = STEPS) -> pb.GenerateImagesRequest:
    return pb.GenerateImagesRequest(prompt=prompt, n=n, height=SIZE, width=SIZE, num_inference_steps=steps, seed=seed)


def rest_body(prompt: str, seed: int = 0, n: int = 1, steps: int = STEPS) -> dict[str, object]:
    return {"prompt": prompt, "n": n, "size": f"{SIZE}x{SIZE}", "num_inference_steps": steps, "seed": seed}


def sample(url: str, name: str, **labels: str) -> float | None:
    """The value of metric sample ``name`` with ``labels`` on the /metrics at ``url`` (None: no such sample)."""
    for family in text_string_to_metric_families(httpx.get(url, timeout=10).text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None


@dataclass
class TenantStack:
    proc: subprocess.Popen
    addresses: dict  # the --ready-file map: role -> address, "<role>-metrics" -> URL, "pids"
    log: Path
    tenants: Path

    @property
    def gateways(self) -> list[str]:
        """Every gateway's address, in the launcher's order."""
        return self.addresses["gateways"].split(",")

    def stub(self, address: str | None = None) -> gateway_service_pb2_grpc.GatewayServiceStub:
        """A stub on a channel of its own to ``address`` (default: the first gateway), closed with the stack."""
        channel = grpc.insecure_channel(address or self.addresses["gateway"])
        self._channels.append(channel)
        return gateway_service_pb2_grpc.GatewayServiceStub(channel)

    def rest(self, timeout: float = 120) -> httpx.Client:
        return httpx.Client(base_url=f"http://{self.addresses['rest']}", timeout=timeout)

    def hangup(self) -> None:
        """SIGHUP to the launcher: it forwards it to every gateway and the REST front, which reload the file."""
        self.proc.send_signal(signal.SIGHUP)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def __post_init__(self) -> None:
        self._channels: list[grpc.Channel] = []

    def close_channels(self) -> None:
        for channel in self._channels:
            channel.close()


@contextlib.contextmanager
def tenant_stack(run_dir: Path, tenants: Path, *extra: str, denoisers: int = 2, gateways: int = 1
                 ) -> Iterator[TenantStack]:
    """``python -m services.launcher --tenants TENANTS EXTRA`` on ephemeral ports, yielded once its ready file is
    written (every server SERVING); SIGTERM on the way out, which must stop it cleanly."""
    ready, log = run_dir / "ready.json", run_dir / "launcher.log"
    ready.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "services.launcher", "--rest-port", "0", "--gateway-ports",
            ",".join(["0"] * gateways), "--ar-port", "0", "--denoiser-ports", ",".join(["0"] * denoisers),
            "--ready-file", str(ready), "--log-level", "WARNING", "--tenants", str(tenants), *extra]
    env = {k: v for k, v in os.environ.items() if k not in ("GLMIMAGE_API_KEYS", "GLMIMAGE_ADMIN_KEYS")}
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    stack = None
    try:
        until(lambda: ready.exists() or proc.poll() is not None, START_TIMEOUT_S, "the launcher's ready file",
              step=0.1)
        assert proc.poll() is None, f"the launcher exited with {proc.returncode}:\n{log.read_text()[-4000:]}"
        stack = TenantStack(proc, json.loads(ready.read_text()), log, tenants)
        yield stack
        assert proc.poll() is None, f"the launcher exited with {proc.returncode}:\n{log.read_text()[-4000:]}"
        proc.send_signal(signal.SIGTERM)
        assert reap(proc, 60) == 0, log.read_text()[-4000:]
    finally:
        if stack is not None:
            stack.close_channels()
        if proc.poll() is None:
            proc.terminate()
            reap(proc, 60)
