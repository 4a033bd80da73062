"""A worker that refuses the gateway's credential (its internal token) is not serving, and the token can be rotated.

The pool of the issue's repro, on real processes (the tiny model): two denoisers with the gateway's token, one added
with AddWorker that has another. The rotation: workers that accept an old and a new token, gateways presenting
either, a worker restarted with the new one alone, then fixed. The call path (a worker that passes the check when it
joins but refuses the call) and a hung AR, on the simulated workers of bench/sim_backends.py.
"""
from __future__ import annotations

import asyncio
import json
import logging
import secrets
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.sim_backends import SimAr, SimDenoiser
from gateway.auth import ENV_ADMIN_KEYS
from gateway.timeouts import TimeoutPolicy
from gateway.workers import WorkerHealth
from glmimage.v1 import ar_service_pb2_grpc, denoiser_service_pb2_grpc
from glmimage.v1 import gateway_service_pb2 as pb
from glmimage.v1 import gateway_service_pb2_grpc as pb_grpc
from runtime.auth import ENV_INTERNAL_TOKEN, INTERNAL, BearerAuthInterceptor, Role, bearer_metadata
from runtime.server import GrpcServer, start_server
from tests.support.cluster import Cluster, reap
from tests.support.sim_gateway import (
    ADMIN,
    ADMIN_KEY,
    AVAILABLE,
    FAST,
    SimCluster,
    request,
    rpc_error,
    running_gateway,
    wait_for,
)

REFUSES = WorkerHealth.CREDENTIAL_REFUSED.value
UNHEALTHY = pb.WORKER_STATE_UNHEALTHY
AR_SERVICE, DENOISER_SERVICE = "glmimage.v1.ArService", "glmimage.v1.DenoiserService"


def _token_file(path: Path, *tokens: str) -> Path:
    path.write_text("".join(f"{t}\n" for t in tokens))
    return path


def _metric(port: int, name: str, **labels: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == name and s.labels == labels)


async def _until_status(stub: pb_grpc.GatewayServiceStub, predicate, timeout: float = 60.0) -> pb.GetStatusResponse:
    """GetStatus (admin view) until ``predicate`` holds: a condition on the gateway's own view, not a fixed wait."""
    async with asyncio.timeout(timeout):
        while not predicate(status := await stub.GetStatus(pb.GetStatusRequest(), metadata=ADMIN)):
            await asyncio.sleep(0.02)
    return status


def _by_address(status: pb.GetStatusResponse) -> dict[str, pb.WorkerStatus]:
    return {w.address: w for w in status.workers}


async def _burst(stub: pb_grpc.GatewayServiceStub, n: int = 16, timeout: float = 120.0) -> list[object]:
    calls = [stub.GenerateImages(request(), metadata=ADMIN, timeout=timeout) for _ in range(n)]
    return await asyncio.gather(*calls, return_exceptions=True)


# ---- real processes -------------------------------------------------------------------------------------------


@pytest.mark.e2e
async def test_a_denoiser_with_another_token_is_marked_and_a_burst_of_16_never_fails(
        tmp_path: Path, tiny_checkpoint: Path) -> None:
    good = _token_file(tmp_path / "good", secrets.token_urlsafe(24))
    bad = _token_file(tmp_path / "bad", secrets.token_urlsafe(24))
    procs = Cluster(tmp_path / "procs")
    env = {ENV_INTERNAL_TOKEN: ""}  # only the files, so nothing leaks in from the test's environment
    try:
        procs.start("ar", "ar", ["--internal-token-file", str(good)], env=env, wait=False)
        for name, token in (("d1", good), ("d2", good), ("bad", bad)):
            procs.start(name, "denoiser", ["--internal-token-file", str(token), "--default-steps", "2"], env=env,
                        wait=False)
        for name in ("ar", "d1", "d2", "bad"):  # loading in parallel: the slowest part of the test
            procs.wait_ready(name)
        addr = {name: procs.procs[name].address for name in ("ar", "d1", "d2", "bad")}
        gateway = procs.start("gateway", "gateway", [
            "--ar", addr["ar"], "--denoiser", addr["d1"], "--denoiser", addr["d2"], "--worker-allow", "127.0.0.0/8",
            "--internal-token-file", str(good)], env={**env, ENV_ADMIN_KEYS: ADMIN_KEY}, metrics=True)
        async with grpc.aio.insecure_channel(gateway.address) as channel:
            stub = pb_grpc.GatewayServiceStub(channel)
            await _until_status(stub, lambda st: [w.state for w in st.workers] == [AVAILABLE] * 3)
            await stub.AddWorker(pb.AddWorkerRequest(address=addr["bad"], role=pb.WORKER_ROLE_DENOISER),
                                 metadata=ADMIN)
            # Checked with the token when it joins, before it gets any work: not serving, and why.
            status = await _until_status(stub, lambda st: _by_address(st).get(addr["bad"], pb.WorkerStatus()).health
                                         == REFUSES)
            shown = _by_address(status)[addr["bad"]]
            assert shown.state == UNHEALTHY and not shown.stuck
            assert shown.health_detail.startswith("UNAUTHENTICATED: missing or invalid internal token")
            assert _metric(gateway.metrics_port, "glmimage_gateway_workers_refusing_credential", role="denoiser") == 1
            # The repro: 16 at once gave 11 x 500 "refused the gateway's credential". Now none fails.
            results = await _burst(stub)
            assert [r for r in results if isinstance(r, BaseException)] == []
            assert all(len(r.images) == 1 for r in results)  # type: ignore[union-attr]
            after = _by_address(await stub.GetStatus(pb.GetStatusRequest(), metadata=ADMIN))
            assert after[addr["bad"]].state == UNHEALTHY and after[addr["bad"]].health == REFUSES
            assert {after[addr[d]].state for d in ("ar", "d1", "d2")} == {AVAILABLE}
        log = (procs.dir / "gateway.log").read_text()
        assert f"denoiser {addr['bad']} refuses the gateway's credential (UNAUTHENTICATED" in log
        assert log.count("refuses the gateway's credential (") == 1  # said once, not on every recheck
    finally:
        procs.close()


@pytest.mark.e2e
async def test_a_token_rotation_old_and_new_both_accepted_and_a_fixed_worker_comes_back(
        tmp_path: Path, tiny_checkpoint: Path) -> None:
    old, new = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
    shared = _token_file(tmp_path / "shared", old, new)  # step 1 of docs/operating.md's rotation: both accepted
    procs = Cluster(tmp_path / "procs")
    env = {ENV_INTERNAL_TOKEN: ""}
    try:
        procs.start("ar", "ar", ["--internal-token-file", str(shared)], env=env, wait=False)
        procs.start("den", "denoiser", ["--internal-token-file", str(shared), "--default-steps", "2"], env=env,
                    wait=False)
        procs.wait_ready("ar")
        procs.wait_ready("den")
        ar, den = procs.procs["ar"].address, procs.procs["den"].address
        fast_recheck = {"credential_recheck_interval": 0.2}
        fail_fast = {"fail_fast_without_workers": True}  # a request that finds no denoiser fails at once
        # A gateway not yet moved to the new token, and one already moved: the workers serve both.
        async with running_gateway([ar], [den], worker_metadata=bearer_metadata(old), config_fields=fast_recheck,
                                   wait_available=False, **fail_fast) as gw_old, \
                running_gateway([ar], [den], worker_metadata=bearer_metadata(new), config_fields=fast_recheck,
                                wait_available=False, **fail_fast) as gw_new:
            for gw in (gw_old, gw_new):
                await gw.until(lambda st: [w.state for w in st.workers] == [AVAILABLE] * 2, timeout=60)
                assert len((await gw.stub.GenerateImages(request(), timeout=120)).images) == 1
            # Step 3 too early: the denoiser restarted with the new token alone while gw_old presents the old one.
            _token_file(shared, new)
            procs.restart("den")
            status = await gw_old.until(lambda st: (st.workers[1].health == REFUSES), timeout=60)
            assert status.workers[1].state == UNHEALTHY
            err = await rpc_error(gw_old.stub.GenerateImages(request(), timeout=60))
            assert err.code() == grpc.StatusCode.UNAVAILABLE
            assert err.details() == ("no denoiser is available (it refuses the gateway's credential (its internal "
                                     "token)); retry later")
            await gw_new.until(lambda st: [w.state for w in st.workers] == [AVAILABLE] * 2, timeout=60)
            assert len((await gw_new.stub.GenerateImages(request(), timeout=120)).images) == 1
            # Fixed (both tokens again): gw_old's periodic check finds it accepts the token, and it serves.
            _token_file(shared, old, new)
            procs.restart("den")
            await gw_old.until(lambda st: [w.state for w in st.workers] == [AVAILABLE] * 2, timeout=60)
            assert (await gw_old.workers())[den].health_detail == ""
            assert len((await gw_old.stub.GenerateImages(request(), timeout=120)).images) == 1
    finally:
        procs.close()


# ---- the call path and the AR, on simulated workers -------------------------------------------------------------


async def _refusing(add, servicer, service: str, methods: tuple[str, ...], token: str) -> GrpcServer:
    """A simulated worker that refuses ``methods`` without ``token`` and lets the rest through (so it passes the
    gateway's check when it joins, and refuses only the work: the path where a call finds the refusal)."""
    interceptor = BearerAuthInterceptor([Role(INTERNAL, (token,), credential="internal token")],
                                        {f"/{service}/{m}": INTERNAL for m in methods})
    server = await start_server(lambda s: add(servicer, s), [service], "127.0.0.1:0", interceptors=[interceptor])
    server.servicer = servicer  # type: ignore[attr-defined]
    await server.set_serving(True)
    return server


async def test_a_denoiser_refusing_the_call_gives_its_jobs_to_the_others_without_using_their_one_attempt(
        sims: SimCluster, caplog: pytest.LogCaptureFixture) -> None:
    refusing = await _refusing(denoiser_service_pb2_grpc.add_DenoiserServiceServicer_to_server, SimDenoiser(FAST),
                               DENOISER_SERVICE, ("Denoise", "DenoiseStream"), "the-denoisers-own-token")
    pool = [sims.address(d) for d in sims.denoisers[:2]] + [sims.address(refusing)]
    caplog.set_level(logging.WARNING, "gateway.driver")
    try:
        # max_attempts=1: a refusal that used an attempt would fail its request. A fast recheck lets the refusing
        # denoiser back in (it passes the check) again and again during the burst: the worst case.
        async with running_gateway([sims.address(sims.ar)], pool, max_attempts=1,
                                   worker_metadata=bearer_metadata("the-gateways-token"),
                                   config_fields={"credential_recheck_interval": 0.05}) as gw:
            results = await _burst(gw.stub)
            assert [r for r in results if isinstance(r, BaseException)] == []
            assert refusing.servicer.completed == 0
            assert f"denoiser {pool[2]} refuses the gateway's credential (UNAUTHENTICATED" in caplog.text
    finally:
        await refusing.stop(None)


async def test_an_ar_refusing_its_batch_sends_it_to_another_ar_or_fails_with_a_503_that_says_why(
        sims: SimCluster) -> None:
    refusing = await _refusing(ar_service_pb2_grpc.add_ArServiceServicer_to_server, SimAr(FAST), AR_SERVICE,
                               ("GenerateBatch", "Generate"), "the-ars-own-token")
    ars = [sims.address(refusing), sims.address(sims.ar)]
    dns = [sims.address(d) for d in sims.denoisers]
    token = bearer_metadata("the-gateways-token")
    try:
        # No AR retry to spend; and no recheck during the test, so the refusing AR stays marked.
        async with running_gateway(ars, dns, ar_retries=0, worker_metadata=token,
                                   config_fields={"credential_recheck_interval": 600.0}) as gw:
            results = await _burst(gw.stub)
            assert [r for r in results if isinstance(r, BaseException)] == []
            assert (await gw.workers())[ars[0]].health == REFUSES
        async with running_gateway(ars[:1], dns, worker_metadata=token, fail_fast_without_workers=True) as gw:
            err = await rpc_error(gw.stub.GenerateImages(request(), timeout=30))
            assert err.code() == grpc.StatusCode.UNAVAILABLE
            assert err.details() == ("no AR server is available (it refuses the gateway's credential (its internal "
                                     "token)); retry later")
    finally:
        await refusing.stop(None)


async def test_a_hung_ar_is_reported_as_not_answering_not_as_gone(sims: SimCluster, tmp_path: Path) -> None:
    ready = tmp_path / "ready.json"
    ar = subprocess.Popen([sys.executable, "-m", "bench.sim_backends", "--ar", "1", "--denoisers", "0",
                           "--scale", "0.001", "--ready-file", str(ready)])
    try:
        await wait_for(lambda: ready.exists() or ar.poll() is not None, timeout=60)
        assert ar.poll() is None
        address = json.loads(ready.read_text())["ar"][0]
        # Only the probes may notice (a fixed, long AR timeout): ~2.6 s of unanswered probes make it hung.
        probes = {"health_probe_interval": 0.3, "health_probe_timeout": 1.0, "health_probe_failures": 2,
                  "ar_timeout": TimeoutPolicy(fixed=60.0)}
        async with running_gateway([address], [sims.address(sims.denoisers[0])], fail_fast_without_workers=True,
                                   config_fields=probes) as gw:
            assert len((await gw.stub.GenerateImages(request(), timeout=30)).images) == 1
            ar.send_signal(signal.SIGSTOP)  # its connection and health Watch stay open; only probes notice
            call = gw.stub.GenerateImages(request(), timeout=60)
            err = await rpc_error(call)
            assert err.code() == grpc.StatusCode.UNAVAILABLE
            assert "went away" not in err.details() and "not answering (hung)" in err.details(), err.details()
            assert (await gw.workers())[address].health == WorkerHealth.HUNG.value
    finally:
        ar.send_signal(signal.SIGCONT)
        ar.terminate()
        reap(ar, 30)


def test_gateway_credential_recheck_flag() -> None:
    from gateway.__main__ import config_from, parse_args

    assert config_from(parse_args(["--credential-recheck-interval", "2"])).credential_recheck_interval == 2
    with pytest.raises(SystemExit, match="--credential-recheck-interval"):
        config_from(parse_args(["--credential-recheck-interval", "0"]))

