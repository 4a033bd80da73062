"""Every server, as a real process, ends with exit code 0 and no traceback on SIGTERM and on SIGINT: once serving
(after its graceful drain) and while still starting (a model server loading its weights, the REST front before
uvicorn runs). The REST front used to exit 143 on SIGTERM (uvicorn re-raises the signal after its shutdown) and
print a KeyboardInterrupt traceback on SIGINT; the model servers did the same while loading."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.support import forkserver
from tests.support.cluster import MODULES, SERVICES, Cluster, reap, wait_serving

pytestmark = pytest.mark.e2e

DEAD = "127.0.0.1:1"  # nothing listens there: the gateway and the REST front start without their upstreams
FLAGS = {"ar": ["--torch-threads", "1", "--device", "cpu"], "denoiser": ["--torch-threads", "1", "--device", "cpu"],
         "gateway": ["--ar", DEAD], "rest": ["--gateway-address", DEAD]}
STARTING, SERVING = "starting", "serving"
LOADING_LINE = "loading the model"  # services.model.serving logs it once the signals are the server's own


@dataclass
class _Run:
    role: str
    sig: signal.Signals
    phase: str
    popen: subprocess.Popen | forkserver.Forked
    log: Path
    port_file: Path

    @property
    def name(self) -> str:
        return f"{self.role} {self.sig.name} while {self.phase}"

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, what: str, predicate, timeout: float = 120) -> None:
        """Poll the process's own output and port file (its events) until ``predicate``."""
        deadline = time.monotonic() + timeout
        while not predicate():
            if self.popen.poll() is not None:
                pytest.fail(f"{self.name}: exited {self.popen.returncode} before {what}:\n{self.output()[-3000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"{self.name}: no {what} within {timeout}s")
            time.sleep(0.02)

    def address(self) -> str:
        self.wait_for("a port", self.port_file.exists)
        return f"127.0.0.1:{self.port_file.read_text()}"


def _launch(role: str, sig: signal.Signals, phase: str, workdir: Path) -> _Run:
    stem = workdir / f"{role}-{sig.name}-{phase}"
    log, port_file = stem.with_suffix(".log"), stem.with_suffix(".port")
    popen = forkserver.spawn([sys.executable, "-m", MODULES[role], "--host", "127.0.0.1", "--port", "0",
                              "--port-file", str(port_file), *FLAGS[role]], log, dict(os.environ))
    return _Run(role, sig, phase, popen, log, port_file)


def _ready(run: _Run) -> None:
    if run.phase == STARTING:
        if run.role in ("ar", "denoiser"):
            run.wait_for(f"'{LOADING_LINE}'", lambda: LOADING_LINE in run.output())
        else:
            run.address()  # bound, not yet (or only just) serving
        return
    address = run.address()
    if run.role == "rest":
        def up() -> bool:
            try:
                return httpx.get(f"http://{address}/v1/models", timeout=5).status_code == 200
            except httpx.TransportError:
                return False
        run.wait_for("/v1/models", up)
    else:
        wait_serving(address, SERVICES[run.role], timeout=120)


def _check(runs: list[_Run]) -> None:
    for run in runs:  # all started at once: each gets its signal when it reaches its phase
        _ready(run)
        run.popen.send_signal(run.sig)
        reap(run.popen, 60)
    problems = []
    for run in runs:
        out = run.output()
        if run.popen.returncode != 0 or "Traceback" in out or "KeyboardInterrupt" in out:
            problems.append(f"{run.name}: exit code {run.popen.returncode}\n{out[-2000:]}")
        elif run.phase == SERVING:
            drained = "Application shutdown complete" if run.role == "rest" else "shutdown requested: draining"
            if drained not in out:
                problems.append(f"{run.name}: no graceful shutdown in its log\n{out[-2000:]}")
    assert not problems, "\n\n".join(problems)


@pytest.mark.parametrize("role", ["ar", "denoiser", "gateway", "rest"])
def test_sigterm_and_sigint_exit_0_without_traceback(role: str, tiny_checkpoint: Path, tmp_path: Path) -> None:
    phases = (STARTING, SERVING) if role != "gateway" else (SERVING,)  # the gateway has no slow start-up
    runs = [_launch(role, sig, phase, tmp_path) for phase in phases for sig in (signal.SIGTERM, signal.SIGINT)]
    try:
        _check(runs)
    finally:
        for run in runs:
            if run.popen.poll() is None:
                run.popen.kill()
                run.popen.wait()


def test_workers_followed_by_a_gateway_stop_cleanly(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """A gateway holds each worker's health Watch (and a denoiser's occupancy stream) open: SIGTERM ends those
    streams before the server stops, so nothing is logged as an unhandled CancelledError."""
    procs = Cluster(tmp_path)
    try:
        ar, den = procs.start("ar", "ar"), procs.start("denoiser", "denoiser")
        procs.start("gateway", "gateway", ["--ar", ar.address, "--denoiser", den.address])
        for name in ("ar", "denoiser"):
            assert procs.kill(name, signal.SIGTERM) == 0
            log = (tmp_path / f"{name}.log").read_text()
            assert "ERROR" not in log and "Traceback" not in log, procs.tail(name)
    finally:
        procs.close()
