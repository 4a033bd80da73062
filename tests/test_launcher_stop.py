"""Stopping one server on purpose (issue 32): a SIGTERM from outside the launcher is logged as a stop (WARNING) and
the server restarted; `python -m services.launcher ctl stop NAME` keeps it down, and `ctl start NAME` brings it back."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import psutil
import pytest

from glmimage.v1 import gateway_service_pb2 as pb
from glmimage.v1 import gateway_service_pb2_grpc
from tests.support.cluster import launcher_child, reap
from tests.support.waiting import until

pytestmark = [pytest.mark.e2e, pytest.mark.chaos]


def _ctl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.launcher", "ctl", *args], capture_output=True, text=True,
                          timeout=120)


def test_a_signalled_server_is_a_stop_and_ctl_stops_and_starts_one(tiny_checkpoint: Path, tmp_path: Path) -> None:
    ready, log_path = tmp_path / "ready.json", tmp_path / "launcher.log"
    with log_path.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "services.launcher", "--rest-port", "0", "--gateway-port", "0",
                                 "--ar-port", "0", "--denoiser-ports", "0,0", "--ready-file", str(ready),
                                 "--log-level", "WARNING"], stdout=out, stderr=subprocess.STDOUT)
    channel = None
    try:
        until(lambda: ready.exists() or proc.poll() is not None, 120, "the launcher's ready file", step=0.1)
        assert proc.poll() is None, log_path.read_text()[-4000:]
        addr = json.loads(ready.read_text())
        launcher, victim = proc.pid, addr["denoiser-1"]
        channel = grpc.insecure_channel(addr["gateway"])
        gateway = gateway_service_pb2_grpc.GatewayServiceStub(channel)

        def available() -> bool:
            st = gateway.GetStatus(pb.GetStatusRequest(), timeout=10)
            return any(w.address == victim and w.state == pb.WORKER_STATE_AVAILABLE for w in st.workers)

        def lines(text: str) -> list[str]:
            return [line for line in log_path.read_text().splitlines() if text in line]

        # 1. An operator's (or a node's) SIGTERM: the server drains and exits 0; a stop, restarted, not a crash.
        old = addr["pids"]["denoiser-1"]
        psutil.Process(old).send_signal(signal.SIGTERM)
        until(lambda: launcher_child(launcher, "denoiser-1") not in (None, old), 60, "the restart")
        [stopped] = lines("denoiser-1 stopped by a signal (exit code 0); restarting it on port")
        assert " WARNING " in stopped
        assert not lines("ERROR"), log_path.read_text()[-4000:]
        until(lambda: json.loads(ready.read_text())["pids"].get("denoiser-1") == launcher_child(launcher, "denoiser-1"),
              60, "the ready file to show the new PID")

        # 2. ctl stop: it stays down, the launcher says so, and the stack serves on the other denoiser.
        done = _ctl("--ready-file", str(ready), "stop", "denoiser-1")
        assert done.returncode == 0 and done.stdout.startswith("denoiser-1 stopped (exit code 0)"), done
        assert launcher_child(launcher, "denoiser-1") is None
        assert "denoiser-1" not in json.loads(ready.read_text())["pids"]
        [parked] = lines("denoiser-1 stopped, as asked (exit code 0); it stays down until")
        assert " WARNING " in parked
        again = _ctl("--ready-file", str(ready), "stop", "denoiser-1")
        assert again.returncode == 0 and "already stopped" in again.stdout, again
        reply = gateway.GenerateImages(pb.GenerateImagesRequest(prompt="one down", n=1, height=64, width=64, seed=1),
                                       timeout=120)
        assert len(reply.images) == 1
        # It served a whole request meanwhile, and the launcher restarted nothing (its restart is 0.5 s off).
        assert launcher_child(launcher, "denoiser-1") is None and len(lines("restarting it")) == 1
        assert not available()
        unknown = _ctl("--socket", json.loads(ready.read_text())["control"], "stop", "denoiser-9")
        assert unknown.returncode == 1 and "no server named 'denoiser-9'" in unknown.stderr, unknown

        # 3. ctl start: back on its port, SERVING (the reply waits for its health gate), and the gateway uses it.
        back = _ctl("--ready-file", str(ready), "start", "denoiser-1")
        assert back.returncode == 0 and back.stdout.startswith(f"denoiser-1 is back on {victim}"), back
        pid = launcher_child(launcher, "denoiser-1")
        assert pid is not None and json.loads(ready.read_text())["pids"]["denoiser-1"] == pid
        until(available, 30, "the gateway to use the restarted denoiser")
        assert not lines("ERROR"), log_path.read_text()[-4000:]
        proc.send_signal(signal.SIGTERM)
        assert reap(proc, 60) == 0
    finally:
        if channel is not None:
            channel.close()
        if proc.poll() is None:
            proc.terminate()
            reap(proc, 60)
