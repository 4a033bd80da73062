"""Several gateways under the launcher (`make run GATEWAY_PORTS=50050,50052`): each over the same AR and
denoisers, the REST front over all of them; one SIGKILLed in the middle of a burst costs no request (the REST
front resubmits what it never answered to the other) and is restarted on its port, where it sees every worker."""
from __future__ import annotations

import concurrent.futures as cf
import signal
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import httpx
import psutil
import pytest

from glmimage.v1 import gateway_service_pb2 as pb
from glmimage.v1 import gateway_service_pb2_grpc
from services.launcher import gateway_names, parse_args, port_problem, ready_map
from tests.support.cluster import launcher_child, launcher_child_argv, launcher_tree, running_stack, wait_serving
from tests.support.waiting import until as _until

BURST = 16


def test_gateway_ports_flag_keeps_the_single_port_flag() -> None:
    assert parse_args([]).gateway_ports == [50050]
    assert parse_args(["--gateway-port", "50070"]).gateway_ports == [50070]
    two = parse_args(["--gateway-ports", "50050,0", "--gateway-metrics-port", "51050"])
    assert (two.gateway_ports, two.gateway_metrics_ports) == ([50050, 0], [51050])
    assert parse_args(["--gateway-metrics-ports", "1,2"]).gateway_metrics_ports == [1, 2]
    assert parse_args([]).gateway_metrics_ports is None
    for bad in (["--gateway-port", "1", "--gateway-ports", "2"], ["--gateway-metrics-port", "1",
                "--gateway-metrics-ports", "2"], ["--gateway-ports", "50050,50050"], ["--gateway-ports", "1,x"],
                ["--gateway-ports", ""], ["--gateway-ports", "70000"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
    assert gateway_names(1) == ["gateway"] and gateway_names(2) == ["gateway-1", "gateway-2"]


def test_ready_file_keeps_the_gateway_key_for_the_first() -> None:
    one = ready_map({"ar": "a:1", "gateway": "g:1", "rest": "r:1"}, {"gateway-metrics": "http://g:2/metrics"})
    assert one == {"ar": "a:1", "gateway": "g:1", "rest": "r:1", "gateway-metrics": "http://g:2/metrics",
                   "gateways": "g:1"}
    two = ready_map({"gateway-1": "g:1", "gateway-2": "g:2", "rest": "r:1"},
                    {"gateway-1-metrics": "http://g:3/metrics", "gateway-2-metrics": "http://g:4/metrics"})
    assert two["gateways"] == "g:1,g:2"
    assert two["gateway"] == "g:1" and two["gateway-metrics"] == "http://g:3/metrics"
    assert ready_map({"rest": "r:1"}, {}, {"launcher": 1, "rest": 2})["pids"] == {"launcher": 1, "rest": 2}


def test_a_port_in_use_is_one_line_naming_the_flag(tmp_path: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "services.launcher", "--rest-port", "0", "--gateway-port", "0",
                              "--denoiser-ports", "0,0", "--ar-port", str(port)],
                             capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
    assert f"port {port} " in out.stderr and "--ar-port" in out.stderr and "AR_PORT=" in out.stderr
    twice = parse_args(["--ar-port", "0", "--rest-port", "0", "--gateway-port", "0", "--denoiser-ports", "0,0",
                        "--denoiser-metrics-ports", f"0,{port}", "--gateway-metrics-port", str(port)])
    assert port_problem(twice) == (f"port {port} is given twice (--gateway-metrics-ports and "
                                   "--denoiser-metrics-ports): give each server its own")
    twice.denoiser_metrics_ports = f"0,0,{port}"  # an entry past the denoisers is unused
    assert port_problem(twice) is None


@pytest.mark.e2e
@pytest.mark.chaos
def test_two_gateways_one_killed_mid_burst(tiny_checkpoint: Path, tmp_path: Path) -> None:
    with running_stack(tmp_path, denoisers=2, gateways=2) as run:
        addr, launcher = run.addresses, run.proc.pid
        names = ["gateway-1", "gateway-2"]
        assert [line.split()[0] for line in run.banner[1:7]] == ["ar", "denoiser-0", "denoiser-1", *names, "rest"]
        assert addr["gateway"] == addr["gateway-1"] != addr["gateway-2"]  # the old key: the first gateway
        assert addr["gateways"] == f"{addr['gateway-1']},{addr['gateway-2']}"
        _, rest_argv = launcher_child_argv(launcher, "rest")
        assert rest_argv[rest_argv.index("--gateway-address") + 1] == addr["gateways"]
        seen = {p.pid for p in launcher_tree(launcher)}

        workers = {addr["ar"]: pb.WORKER_ROLE_AR, addr["denoiser-0"]: pb.WORKER_ROLE_DENOISER,
                   addr["denoiser-1"]: pb.WORKER_ROLE_DENOISER}
        channels = {name: grpc.insecure_channel(addr[name]) for name in names}
        stubs = {name: gateway_service_pb2_grpc.GatewayServiceStub(ch) for name, ch in channels.items()}

        def status(name: str) -> pb.GetStatusResponse:
            return stubs[name].GetStatus(pb.GetStatusRequest(), timeout=10)

        def members(name: str) -> dict[str, int]:
            return {w.address: w.role for w in status(name).workers if w.state == pb.WORKER_STATE_AVAILABLE}

        for name in names:
            _until(lambda name=name: members(name) == workers, 30, f"{name} to see every worker available")

        def generate(i: int) -> httpx.Response:
            return httpx.post(f"http://{addr['rest']}/v1/images/generations", timeout=120,
                              json={"prompt": f"burst {i}", "size": "64x64", "num_inference_steps": 2, "seed": i})

        victim = "gateway-2"
        old = launcher_child(launcher, victim)
        assert old is not None
        with cf.ThreadPoolExecutor(BURST) as pool:
            burst = [pool.submit(generate, i) for i in range(BURST)]
            # Mid-burst: some answered already, and the victim holds requests it has not answered yet.
            _until(lambda: sum(f.done() for f in burst) >= 2 and status(victim).active_requests >= 1, 60,
                   f"answers to come back while {victim} has requests in flight")
            psutil.Process(old).send_signal(signal.SIGKILL)
            answers = [f.result() for f in burst]
        failed = [(r.status_code, r.text[:300]) for r in answers if r.status_code != 200]
        assert not failed, f"{len(failed)} of {BURST} requests failed: {failed}"
        for r in answers:
            assert len(r.json()["data"]) == 1

        def replaced() -> bool:
            return launcher_child(launcher, victim) not in (None, old)

        _until(replaced, 30, f"the launcher to restart {victim}")
        wait_serving(addr[victim], "glmimage.v1.GatewayService", timeout=60)  # on the same port
        _, back = launcher_child_argv(launcher, victim)
        assert back[back.index("--port") + 1] == addr[victim].rsplit(":", 1)[1]
        _until(lambda: members(victim) == workers, 30, f"the restarted {victim} to see every worker available")
        again = stubs[victim].GenerateImages(pb.GenerateImagesRequest(prompt="back", n=1, height=64, width=64,
                                                                      num_inference_steps=2, seed=99), timeout=120)
        assert len(again.images) == 1
        assert generate(BURST).status_code == 200
        for ch in channels.values():
            ch.close()
        seen |= {p.pid for p in launcher_tree(launcher)}
        run.proc.send_signal(signal.SIGTERM)
        assert run.proc.wait(timeout=60) == 0
    left = [pid for pid in seen if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
    assert not left, f"orphans left behind: {left}"


async def test_extra_flags_reach_the_ar_and_every_denoiser(monkeypatch: pytest.MonkeyPatch) -> None:
    """`make run STACK_ARGS="--denoiser-arg=--default-steps=50"` (real weights): the flag reaches every denoiser, an
    --ar-arg the AR, and neither the other role. The supervisor is stopped at its first start."""
    from services.launcher import start_suite
    from services.model import tiny
    from services.supervisor import Supervisor

    class Started(Exception):
        pass

    async def first_start(self, children, deadline):
        raise Started

    monkeypatch.setattr(Supervisor, "start", first_start)
    monkeypatch.setattr(tiny, "ensure_tiny_checkpoint", lambda: None)
    sup = Supervisor("127.0.0.1", "INFO")
    args = parse_args(["--denoiser-ports", "0,0", "--ar-arg=--max-queue=7", "--denoiser-arg=--default-steps=50"])
    with pytest.raises(Started):
        await start_suite(sup, args)
    argv = {c.name: c.argv for c in sup.children}
    assert "--max-queue=7" in argv["ar"] and "--default-steps=50" not in argv["ar"]
    for name in ("denoiser-0", "denoiser-1"):
        assert "--default-steps=50" in argv[name] and "--max-queue=7" not in argv[name]
