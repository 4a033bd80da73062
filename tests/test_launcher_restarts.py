"""The self-healing launcher (issue 15): a child that exits is restarted on the same port and rejoins through the
gateway's health watch while the rest keeps serving; one that keeps crashing is given up, loudly; only a signal
stops the stack, with no orphans."""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import json
import logging
import signal
import sys
import urllib.request
from pathlib import Path

import grpc
import psutil
import pytest

from glmimage.v1 import gateway_service_pb2 as pb
from glmimage.v1 import gateway_service_pb2_grpc
from services.supervisor import Child, RestartPolicy, Supervisor
from tests.support.cluster import launcher_child, launcher_children, launcher_tree, running_stack
from tests.support.waiting import until as _until

pytestmark = [pytest.mark.e2e, pytest.mark.chaos]

# A stand-in server: binds --port, writes --port-file atomically, answers /health; while the file named last exists
# it exits 0.2 s after a health check, so every restart passes the gate and then crashes again.
FAKE_SERVER = """
import http.server, os, sys, threading
port, port_file, crash_while = int(sys.argv[2]), sys.argv[4], sys.argv[5]
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
        if os.path.exists(crash_while): threading.Timer(0.2, os._exit, (3,)).start()
    def log_message(self, *args): pass
server = http.server.HTTPServer(("127.0.0.1", port), Health)
open(port_file + ".tmp", "w").write(str(server.server_address[1])); os.replace(port_file + ".tmp", port_file)
server.serve_forever()
"""


def _fake(run_dir: Path, name: str, crash_while: Path) -> Child:
    port_file = run_dir / f"{name}.port"
    argv = [sys.executable, "-c", FAKE_SERVER, "--port", "0", "--port-file", str(port_file), str(crash_while)]
    return Child(name=name, argv=argv, port_file=port_file, health_service=None)


def test_a_crash_loop_is_given_up_and_the_rest_keeps_running(caplog: pytest.LogCaptureFixture) -> None:
    policy = RestartPolicy(initial_backoff=0.05, max_backoff=0.2, max_restarts=3, window=60, startup_timeout=20)

    async def scenario() -> None:
        sup = Supervisor("127.0.0.1", "INFO", policy)
        broken = sup.run_dir / "broken"
        broken.touch()
        steady, crasher = _fake(sup.run_dir, "steady", sup.run_dir / "never"), _fake(sup.run_dir, "crasher", broken)
        sup.children += [steady, crasher]
        rewrites: list[int] = []
        sup.on_restart = lambda: rewrites.append(sup.pids()["crasher"])
        loop = asyncio.get_running_loop()
        await sup.start([steady, crasher], loop.time() + 20)
        steady_pid, crasher_port = steady.process.pid, crasher.port
        supervising = asyncio.ensure_future(sup.supervise())
        try:
            deadline = loop.time() + 30
            while not crasher.given_up:  # bounded polling of the supervisor's own state
                assert loop.time() < deadline and not supervising.done(), "the crasher was never given up"
                await asyncio.sleep(0.05)
            assert len(crasher.restarts) == policy.max_restarts
            assert crasher.port == crasher_port  # every restart bound the port it got the first time
            assert steady.process.returncode is None and steady.process.pid == steady_pid
            status = await asyncio.to_thread(
                lambda: urllib.request.urlopen(f"http://{steady.address}/health", timeout=5).status)
            assert status == 200
            # The way back (the launcher's SIGUSR1): fixed meanwhile, it is restarted with a fresh budget, stays up.
            broken.unlink()
            rewrites.clear()
            assert sup.retry_given_up() == ["crasher"]
            while not (rewrites and crasher.process.returncode is None):
                assert loop.time() < deadline and not crasher.given_up, "the crasher was never retried"
                await asyncio.sleep(0.05)
            assert rewrites == [crasher.process.pid] and crasher.restarts and crasher.port == crasher_port
            assert sup.retry_given_up() == []
        finally:
            supervising.cancel()
            await asyncio.gather(supervising, return_exceptions=True)
            await sup.stop(grace=5)
        assert steady.process.returncode is not None

    with caplog.at_level(logging.INFO, logger="services.supervisor"):
        asyncio.run(scenario())
    restarts = [r for r in caplog.records if "crasher exited unexpectedly" in r.getMessage()]
    assert len(restarts) == policy.max_restarts + 1  # and the retry
    assert any(r.levelno == logging.ERROR and r.getMessage().startswith("GIVING UP on crasher")
               for r in caplog.records)


def test_a_killed_denoiser_is_restarted_on_its_port_and_rejoins(tiny_checkpoint: Path, tmp_path: Path) -> None:
    with running_stack(tmp_path, denoisers=2) as run:
        addr, launcher = run.addresses, run.proc.pid
        # The banner and the ready file show every PID, the launcher's for its SIGUSR1.
        pids = {name: launcher_child(launcher, name) for name in ("ar", "denoiser-0", "denoiser-1", "gateway", "rest")}
        assert addr["pids"] == {"launcher": launcher, **pids}
        assert f"  pids: {', '.join(f'{n} {p}' for n, p in addr['pids'].items())}" in run.banner
        assert f"kill -USR1 {launcher} " in run.banner[-1]
        run.proc.send_signal(signal.SIGUSR1)  # nothing is given up: a no-op, and it must not end the launcher
        gateway = gateway_service_pb2_grpc.GatewayServiceStub(grpc.insecure_channel(addr["gateway"]))
        victim = addr["denoiser-1"]
        seen = {p.pid for p in launcher_tree(launcher)}

        def state() -> int:
            st = gateway.GetStatus(pb.GetStatusRequest(), timeout=10)
            return next(w.state for w in st.workers if w.address == victim)

        def generate(seed: int) -> int:
            resp = gateway.GenerateImages(pb.GenerateImagesRequest(prompt="restart", n=1, height=64, width=64,
                                                                   seed=seed), timeout=120)
            return len(resp.images)

        _until(lambda: state() == pb.WORKER_STATE_AVAILABLE, 30, "the victim to be available")
        for round_ in range(2):
            old = launcher_child(launcher, "denoiser-1")
            assert old is not None
            with cf.ThreadPoolExecutor(4) as pool:
                burst = [pool.submit(generate, 100 * round_ + i) for i in range(6)]
                psutil.Process(old).send_signal(signal.SIGKILL)
                assert [f.result() for f in burst] == [1] * 6  # every request succeeded despite the kill
            def replaced(old: int = old) -> bool:
                return launcher_child(launcher, "denoiser-1") not in (None, old)

            _until(lambda: state() != pb.WORKER_STATE_AVAILABLE or replaced(), 30,
                   "the gateway to see the victim go, or its replacement")
            # The launcher's restart backoff and a denoiser's start-up: 11-12 s seen with both cores busy.
            _until(lambda: replaced() and state() == pb.WORKER_STATE_AVAILABLE, 60,
                   f"round {round_}: the victim to be back")
            argv = launcher_children(launcher)[launcher_child(launcher, "denoiser-1")]
            assert argv[argv.index("--port") + 1] == victim.rsplit(":", 1)[1]  # the same port, so the same address
            seen |= {p.pid for p in launcher_tree(launcher)}
            assert generate(1000 + round_) == 1
            _until(lambda: json.loads((tmp_path / "ready.json").read_text())["pids"]["denoiser-1"]
                   == launcher_child(launcher, "denoiser-1"), 30, "the ready file to show the new PID")
        assert run.proc.poll() is None
        run.proc.send_signal(signal.SIGTERM)
        assert run.proc.wait(timeout=60) == 0
    left = [pid for pid in seen if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
    assert not left, f"orphans left behind: {left}"
