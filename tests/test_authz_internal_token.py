"""The internal token the AR and denoisers require: where it is read from, several for a rotation, and the real
processes on the tiny model refusing a gateway without it.
"""
from __future__ import annotations

import asyncio
import secrets
from pathlib import Path

import grpc
import httpx
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from glmimage.v1 import ar_service_pb2, ar_service_pb2_grpc, denoiser_service_pb2, denoiser_service_pb2_grpc
from glmimage.v1 import gateway_service_pb2 as pb
from glmimage.v1 import gateway_service_pb2_grpc as pb_grpc
from runtime.auth import ENV_INTERNAL_TOKEN, check_token, internal_token_from, internal_tokens_from
from tests.support.authz import UNAUTH, USER_KEY, bearer
from tests.support.cluster import Cluster, running_stack
from tests.support.sim_gateway import (
    AVAILABLE,
    request,
    rpc_error,
    running_gateway,
)

# ---- the internal token on AR and denoisers -------------------------------------------------------------------


def test_internal_token_sources(tmp_path: Path) -> None:
    token = secrets.token_hex(16)
    (tmp_path / "t").write_text(token + "\n")
    assert internal_token_from(tmp_path / "t", {}) == token
    assert internal_token_from(tmp_path / "t", {ENV_INTERNAL_TOKEN: "x" * 20}) == token  # the file wins
    assert internal_token_from(None, {ENV_INTERNAL_TOKEN: f" {token} "}) == token
    assert internal_token_from(None, {}) is None
    for bad in ("short", "has a space in it", "tab\tinside-the-token"):
        with pytest.raises(ValueError):
            check_token(bad, "test")
    with pytest.raises(ValueError, match="--internal-token-file"):
        internal_token_from(tmp_path / "missing", {})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="0 characters"):
        internal_token_from(tmp_path / "empty", {})


def test_several_internal_tokens_one_a_line_for_a_rotation(tmp_path: Path) -> None:
    new, old = secrets.token_hex(16), secrets.token_hex(16)
    (tmp_path / "t").write_text(f"{new}\n\n  {old}  \n{new}\n")
    # A server accepts every one (each once, in order); a gateway presents the first.
    assert internal_tokens_from(tmp_path / "t", {}) == (new, old)
    assert internal_token_from(tmp_path / "t", {}) == new
    assert internal_tokens_from(None, {ENV_INTERNAL_TOKEN: f"{old}\n{new}"}) == (old, new)
    assert internal_tokens_from(None, {}) == ()
    (tmp_path / "bad").write_text(f"{new}\nshort\n")
    with pytest.raises(ValueError, match=r"\(token 2\) is 5 characters"):
        internal_tokens_from(tmp_path / "bad", {})


@pytest.fixture
def token_cluster(tmp_path: Path, tiny_checkpoint: Path):
    """Real AR and denoiser processes (tiny model) requiring an internal token given in a file."""
    token = secrets.token_urlsafe(24)
    token_file = tmp_path / "internal-token"
    token_file.write_text(token)
    procs = Cluster(tmp_path / "procs")
    try:
        env = {ENV_INTERNAL_TOKEN: ""}  # only the file, so nothing leaks in from the test's environment
        procs.start("ar", "ar", ["--internal-token-file", str(token_file)], env=env)
        procs.start("denoiser", "denoiser", ["--internal-token-file", str(token_file), "--default-steps", "2"],
                    env=env)
        yield procs, token
    finally:
        procs.close()


@pytest.mark.e2e
async def test_workers_require_the_internal_token_and_the_gateway_presents_it(token_cluster) -> None:
    procs, token = token_cluster
    ar, den = procs.procs["ar"].address, procs.procs["denoiser"].address
    generate = ar_service_pb2.GenerateRequest(prompt="a cat", n=1, height=64, width=64, seed=1)
    denoise = denoiser_service_pb2.DenoiseRequest(prompt="a cat", height=64, width=64, seed=1)
    denoise.prior_tokens.token_ids.extend(range(1, 17))
    async with grpc.aio.insecure_channel(ar) as ar_ch, grpc.aio.insecure_channel(den) as den_ch:
        ar_stub, den_stub = ar_service_pb2_grpc.ArServiceStub(ar_ch), denoiser_service_pb2_grpc.DenoiserServiceStub(
            den_ch)
        for md in [(), bearer("wrong-" + token), bearer(token[:-1]), (("authorization", token),),
                   bearer(USER_KEY)]:
            for call in (ar_stub.Generate(generate, metadata=md),
                         ar_stub.GenerateBatch(ar_service_pb2.GenerateBatchRequest(requests=[generate]), metadata=md),
                         den_stub.Denoise(denoise, metadata=md),
                         den_stub.DenoiseStream(denoiser_service_pb2.DenoiseStreamRequest(job=denoise),
                                                metadata=md).read(),
                         # Who holds the slot is the gateways' to know, not any caller's.
                         den_stub.WatchOccupancy(denoiser_service_pb2.WatchOccupancyRequest(), metadata=md).read()):
                err = await rpc_error(call)
                assert err.code() == UNAUTH and "internal token" in err.details(), md
        # Health and reflection stay open: probes and grpcurl discovery need no token.
        for channel, service in ((ar_ch, "glmimage.v1.ArService"), (den_ch, "glmimage.v1.DenoiserService")):
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service))
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            reflection = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
            assert service in [s.name async for r in reflection for s in r.list_services_response.service]
        # With the token the worker serves.
        reply = await den_stub.Denoise(denoise, metadata=bearer(token), timeout=120)
        assert reply.image.startswith(b"\x89PNG")

    # A gateway without the token gets nothing done: the workers' health is open, but the check with the token when
    # they join is refused, so they are not serving, and a request is told why.
    async with running_gateway([ar], [den], wait_available=False, fail_fast_without_workers=True) as gw:
        status = await gw.until(lambda st: {w.health for w in st.workers} == {"refuses the gateway's credential"},
                                timeout=30)
        assert {w.state for w in status.workers} == {pb.WORKER_STATE_UNHEALTHY}
        err = await rpc_error(gw.stub.GenerateImages(request(), timeout=60))
        assert err.code() == grpc.StatusCode.UNAVAILABLE and "internal token" in err.details()

    # `python -m gateway` with the token in its environment generates end to end.
    procs.start("gateway", "gateway", ["--ar", ar, "--denoiser", den], env={ENV_INTERNAL_TOKEN: token})
    async with grpc.aio.insecure_channel(procs.procs["gateway"].address) as channel:
        stub = pb_grpc.GatewayServiceStub(channel)
        await wait_for_ready_workers(stub)
        reply = await stub.GenerateImages(request(), timeout=120)
        assert len(reply.images) == 1 and reply.images[0].image.startswith(b"\x89PNG")


async def wait_for_ready_workers(stub: pb_grpc.GatewayServiceStub, timeout: float = 30.0) -> None:
    async with asyncio.timeout(timeout):
        while True:
            status = await stub.GetStatus(pb.GetStatusRequest())
            if status.workers and all(w.state == AVAILABLE for w in status.workers):
                return
            await asyncio.sleep(0.02)


@pytest.mark.e2e
def test_make_run_can_turn_the_internal_token_on_without_showing_it(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """`python -m services.launcher --internal-token`: AR and denoisers require a per-run token that only the gateway
    has, handed over in the environment; it is in no process's command line."""
    # Plain processes: what ps shows of a forked server is the fork server's command line and environment.
    with running_stack(tmp_path, denoisers=1, extra_args=("--internal-token",), forked=False) as run:
        procs = [psutil.Process(run.proc.pid), *psutil.Process(run.proc.pid).children(recursive=True)]
        role = {p.pid: next((m for m in ("services.ar", "services.denoiser", "rest", "gateway")
                             if m in p.cmdline()), "launcher") for p in procs}
        envs = {role[p.pid]: p.environ() for p in procs}
        token = envs["services.ar"][ENV_INTERNAL_TOKEN]
        check_token(token, "the launcher")
        assert envs["services.denoiser"][ENV_INTERNAL_TOKEN] == envs["gateway"][ENV_INTERNAL_TOKEN] == token
        assert ENV_INTERNAL_TOKEN not in envs["rest"] and ENV_INTERNAL_TOKEN not in envs["launcher"]
        assert not any(token in " ".join(p.cmdline()) for p in procs)
        with grpc.insecure_channel(run.addresses["ar"]) as channel:
            with pytest.raises(grpc.RpcError) as err:
                ar_service_pb2_grpc.ArServiceStub(channel).Generate(
                    ar_service_pb2.GenerateRequest(prompt="a cat", height=64, width=64), timeout=60)
            assert err.value.code() == UNAUTH
        resp = httpx.post(f"http://{run.addresses['rest']}/v1/images/generations", timeout=120,
                          json={"prompt": "a cat", "size": "64x64"})
        assert resp.status_code == 200, resp.text
