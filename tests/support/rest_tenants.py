"""The REST front with ``--tenants``: a tenants file, the scripted gateway of tests/support/fake_gateway.py whose
GetStatus also reports tenants (as the real gateway's does), and the front as a real ``python -m rest``
process on an ephemeral port (for signals, exit statuses and a browser, which a front in the test's loop cannot
serve while selenium blocks it)."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from glmimage.v1 import gateway_service_pb2 as gw
from tests.support.fake_gateway import FakeGateway, FakeServer, serve_fake
from tests.support.waiting import until

START_TIMEOUT_S = 60.0  # importing FastAPI and grpc in a fresh interpreter, on a loaded machine


def tenants_toml(tenants: dict[str, dict[str, object]]) -> str:
    """A tenants file: one ``[tenants.NAME]`` table each, values as TOML (strings quoted, lists of strings)."""
    def value(v: object) -> str:
        if isinstance(v, str):
            return f'"{v}"'
        if isinstance(v, list | tuple):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return str(v)

    return "".join(f"[tenants.{name}]\n" + "".join(f"{k} = {value(v)}\n" for k, v in spec.items()) + "\n"
                   for name, spec in tenants.items())


# What the scripted gateway says of each tenant: one with quotas and work waiting, one without either.
TENANT_STATUS = (
    gw.TenantStatus(name="alpha", weight=1.0, pending_ar_requests=2, pending_denoise_outputs=5, active_requests=3,
                    inflight_images=4, oldest_wait_seconds=7.25, requests_total=41, images_total=97,
                    requests_per_minute=30, images_per_minute=60, max_inflight_images=8, remaining_requests=27,
                    remaining_images=52, max_priority=gw.PRIORITY_INTERACTIVE),
    gw.TenantStatus(name="ops", weight=2.0, requests_total=3, images_total=3, max_priority=gw.PRIORITY_INTERACTIVE),
)


@dataclasses.dataclass
class TenantsGateway(FakeGateway):
    """FakeGateway whose GetStatus carries ``tenants`` too."""

    tenants: tuple[gw.TenantStatus, ...] = TENANT_STATUS

    def GetStatus(self, request, context):
        status = super().GetStatus(request, context)
        status.tenants.extend(self.tenants)
        return status


@contextlib.contextmanager
def serve_tenants_fake() -> Iterator[FakeServer]:
    with serve_fake(servicer=TenantsGateway()) as server:
        yield server


@dataclasses.dataclass
class FrontProcess:
    proc: subprocess.Popen[str]
    port: int
    log: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def signal(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)


def run_front(*flags: str, timeout: float = START_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """``python -m rest FLAGS`` that is expected to stop by itself (a start-up error)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GLMIMAGE_")}
    return subprocess.run([sys.executable, "-m", "rest", "--port", "0", *flags], capture_output=True,
                          text=True, timeout=timeout, env=env)


@contextlib.contextmanager
def front_process(workdir: Path, *flags: str) -> Iterator[FrontProcess]:
    """``python -m rest --port 0 FLAGS``, started once its port file says it listens; SIGTERM on exit (its
    graceful stop must end with status 0)."""
    port_file, log = workdir / "rest.port", workdir / "rest.log"
    port_file.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GLMIMAGE_")}
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "rest", "--port", "0", "--port-file", str(port_file),
                                 *flags], stdout=out, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        until(lambda: port_file.exists() or proc.poll() is not None, START_TIMEOUT_S, "the REST front's port file")
        assert proc.poll() is None, f"the REST front stopped: {log.read_text()}"
        yield FrontProcess(proc, int(port_file.read_text()), log)
        assert proc.poll() is None, f"the REST front stopped: {log.read_text()}"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
