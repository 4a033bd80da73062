"""Who may do what: user and admin roles on GatewayService, and the REST front's credentials per hop.

Tested as an attacker would try it: no credential, a wrong one, a user key where an admin one is needed. The gateway
is the real one (in-process, with the interceptor `python -m gateway` installs, or as a process); the workers are
the simulated servers of bench/sim_backends.py. The AddWorker allow-list and pool cap are in
tests/test_authz_add_worker.py, the internal token the workers require in tests/test_authz_internal_token.py.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.__main__ import config_from
from gateway.__main__ import parse_args as gateway_args
from gateway.scheduler.types import WorkerState
from gateway.workers import Platform
from glmimage.v1 import gateway_service_pb2 as pb
from glmimage.v1 import gateway_service_pb2_grpc as pb_grpc
from rest import __main__ as rest_main
from rest.app import RestSettings, create_app
from runtime.tenants import TenantsFile, parse_tenants
from runtime.version import PROTO_REVISION
from tests.support.authz import DENIED, UNAUTH, USER, USER_KEY, add, bearer, members, remove, until
from tests.support.cluster import Cluster
from tests.support.sim_gateway import (
    ADMIN,
    ADMIN_KEY,
    AVAILABLE,
    SimCluster,
    request,
    rpc_error,
    running_gateway,
)

# ---- roles ------------------------------------------------------------------------------------------------------


async def test_a_user_key_can_generate_but_not_add_or_remove_workers(sims: SimCluster) -> None:
    ar, d0, d1 = sims.address(sims.ar), sims.address(sims.denoisers[0]), sims.address(
        sims.denoisers[1])
    async with running_gateway([ar], [d0], api_keys=(USER_KEY,)) as gw:
        before = await members(gw)
        for md, code in [(USER, DENIED), ((), UNAUTH), (bearer("guess"), UNAUTH), (bearer(ADMIN_KEY + "x"), UNAUTH),
                         ((("authorization", ADMIN_KEY),), UNAUTH)]:  # no "Bearer": not a credential
            assert (await rpc_error(add(gw, d1, md))).code() == code, md
            assert (await rpc_error(remove(gw, d0, md))).code() == code, md
        err = await rpc_error(add(gw, d1, USER))
        assert "admin" in err.details() and USER_KEY not in err.details()
        assert await members(gw) == before  # nothing added, nothing draining
        # The user key still does what it is for; the admin key may too.
        assert len((await gw.stub.GenerateImages(request(), metadata=USER)).images) == 1
        assert len((await gw.stub.GenerateImages(request(), metadata=ADMIN)).images) == 1
        assert (await gw.stub.GetStatus(pb.GetStatusRequest(), metadata=USER)).workers
        assert (await rpc_error(gw.stub.GenerateImages(request()))).code() == UNAUTH
        # The limits in force are public (/openapi.json shows them): no key needed, even on a keyed gateway.
        assert (await gw.stub.GetLimits(pb.GetLimitsRequest())).limits.max_n >= 1
        # And the admin key administers.
        await add(gw, d1)
        await until(gw, lambda m: list(m.values()).count(AVAILABLE) == 3)


async def test_without_keys_users_are_open_but_admin_needs_its_own_key(sims: SimCluster) -> None:
    ar, d0 = sims.address(sims.ar), sims.address(sims.denoisers[0])
    async with running_gateway([ar], [d0]) as gw:  # no --api-key, one --admin-key
        assert len((await gw.stub.GenerateImages(request())).images) == 1
        assert (await rpc_error(remove(gw, d0, ()))).code() == UNAUTH
        assert (await rpc_error(remove(gw, d0, bearer("anything")))).code() == UNAUTH
        assert d0 in await members(gw)


@pytest.mark.parametrize("api_keys", [(), (USER_KEY,)], ids=["no-keys", "user-keys"])
async def test_admin_rpcs_are_off_for_everyone_without_an_admin_key(sims: SimCluster, dialled: list[str],
                                                                    api_keys: tuple[str, ...]) -> None:
    ar, d0, d1 = (sims.address(s) for s in (sims.ar, *sims.denoisers[:2]))
    async with running_gateway([ar], [d0], api_keys=api_keys, admin_keys=()) as gw:
        dialled_before = list(dialled)
        for md in [(), USER, ADMIN, bearer("admin")]:
            for call in (add(gw, d1, md), remove(gw, d0, md)):
                err = await rpc_error(call)
                assert err.code() == DENIED, md
                assert "--admin-key" in err.details()
        assert dialled == dialled_before
        assert {w.address: w.state for w in gw.driver.snapshot().workers} == {  # d0 not draining
            ar: WorkerState.AVAILABLE, d0: WorkerState.AVAILABLE}


async def test_the_real_gateway_process_keeps_admin_rpcs_off_by_default(tmp_path: Path) -> None:
    """`python -m gateway` with `make run`'s flags (no keys at all): nobody can change the pool."""
    procs = Cluster(tmp_path)
    try:
        gw = procs.start("gateway", "gateway", ["--ar", "127.0.0.1:1", "--denoiser", "127.0.0.1:2"])
        async with grpc.aio.insecure_channel(gw.address) as channel:
            stub = pb_grpc.GatewayServiceStub(channel)
            for md in [(), bearer("admin"), bearer("")]:
                err = await rpc_error(stub.RemoveWorker(pb.RemoveWorkerRequest(address="127.0.0.1:2"), metadata=md))
                assert err.code() == DENIED and "--admin-key" in err.details()
                err = await rpc_error(stub.AddWorker(pb.AddWorkerRequest(address="127.0.0.1:3",
                                                                         role=pb.WORKER_ROLE_DENOISER), metadata=md))
                assert err.code() == DENIED
            status = await stub.GetStatus(pb.GetStatusRequest())  # users stay open, as before
            assert sorted(w.address for w in status.workers) == ["127.0.0.1:1", "127.0.0.1:2"]
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            assert health.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        procs.close()


async def test_get_status_shows_addresses_and_other_callers_ids_to_the_admin_role_only(sims: SimCluster) -> None:
    ar, d0 = sims.address(sims.ar), sims.address(sims.denoisers[0])
    other = bearer("another-user-key")
    # Two user tenants and an admin one: "own" is the caller's tenant (two keys of one tenant see each other's).
    tenants = TenantsFile(None, parse_tenants(f"""
        [tenants.alpha]
        keys = ["{USER_KEY}"]
        [tenants.beta]
        keys = ["another-user-key"]
        [tenants.ops]
        keys = ["{ADMIN_KEY}"]
        role = "admin"
        """))
    async with running_gateway([ar], [d0], tenants=tenants) as gw:
        # (The simulated workers say no device: as a GPU denoiser compiled for two sizes would say it.)
        gw.driver.members.platform = lambda address: Platform("cuda:0", ((64, 64), (256, 512)))  # type: ignore
        sims.gate.clear()  # the job holds d0 after its first step
        mine = asyncio.ensure_future(gw.stub.GenerateImages(request(), metadata=USER + (("x-request-id", "mine"),)))
        whole = await gw.until(lambda st: any(w.current_job for w in st.workers))  # the admin's view
        assert [(w.address, w.current_job) for w in whole.workers] == [(ar, ""), (d0, "mine/0#1")]
        views = {name: await gw.stub.GetStatus(pb.GetStatusRequest(), metadata=md)
                 for name, md in (("owner", USER), ("other", other))}
        for name, view in views.items():
            # The pool by position, role, state and health; no address, and only the caller's own job ids.
            assert [w.address for w in view.workers] == ["", ""], name
            assert [(w.role, w.state, w.inflight, w.health) for w in view.workers] == [
                (w.role, w.state, w.inflight, w.health) for w in whole.workers], name
            # Nor the releases (the gateway's and each worker's), nor what each runs on: the admin's to see.
            assert not view.HasField("gateway_build") and not any(w.HasField("build") for w in view.workers), name
            assert not any(w.device or w.compiled_sizes for w in view.workers), name
        assert whole.gateway_build.proto_revision == PROTO_REVISION and whole.gateway_build.version
        assert [(w.device, [(s.width, s.height) for s in w.compiled_sizes]) for w in whole.workers] == [
            ("cuda:0", [(64, 64), (512, 256)])] * 2
        assert views["owner"].workers[1].current_job == "mine/0#1"
        assert views["other"].workers[1].current_job == "" and views["other"].workers[1].inflight == 1
        assert [t.name for t in views["owner"].tenants] == ["alpha"] and views["owner"].tenants[0].active_requests == 1
        assert [t.name for t in views["other"].tenants] == ["beta"]
        assert [t.name for t in whole.tenants] == ["alpha", "beta", "ops"]
        assert (await rpc_error(gw.stub.GetStatus(pb.GetStatusRequest()))).code() == UNAUTH
        sims.gate.set()
        assert len((await mine).images) == 1
    # With no user key at all but an admin key: anonymous callers may generate and read the status, not the
    # addresses; a gateway with no key at all cannot tell callers apart and shows everything (make run).
    async with running_gateway([ar], [d0]) as gw:
        assert [w.address for w in (await gw.stub.GetStatus(pb.GetStatusRequest())).workers] == ["", ""]
        assert [w.address for w in (await gw.status()).workers] == [ar, d0]
    async with running_gateway([ar], [d0], admin_keys=()) as gw:
        assert [w.address for w in (await gw.stub.GetStatus(pb.GetStatusRequest())).workers] == [ar, d0]


def test_gateway_flags_refuse_a_key_that_is_both_user_and_admin() -> None:
    with pytest.raises(SystemExit, match="both as an API key and as an admin key"):
        config_from(gateway_args(["--api-key", "k", "--admin-key", "k"]))
    config = config_from(gateway_args(["--api-key", "k", "--admin-key", "a"]))
    assert config.api_keys == ("k",) and config.admin_keys == ("a",) and config.worker_allow == ()


def test_a_key_that_begins_with_a_dash_is_given_with_an_equals_sign() -> None:
    # About one urlsafe token in 64 begins with "-": as a separate word argparse takes it for a flag.
    config = config_from(gateway_args(["--api-key=-k1", "--admin-key=-a1"]))
    assert config.api_keys == ("-k1",) and config.admin_keys == ("-a1",)
    assert rest_main.parse_args(["--api-key=-r"]).api_key == ["-r"]



# ---- the REST front: credentials per hop ----------------------------------------------------------------------


@contextlib.asynccontextmanager
async def rest(settings: RestSettings) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(settings)
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://rest") as client:
        yield client


def body() -> dict:
    return {"prompt": "a lighthouse", "size": "64x64", "seed": 3}


async def test_rest_own_mode_generates_with_its_own_gateway_key(sims: SimCluster) -> None:
    ar, d0 = sims.address(sims.ar), sims.address(sims.denoisers[0])
    async with running_gateway([ar], [d0], api_keys=("gw-key-only",)) as gw:
        address = f"127.0.0.1:{gw.port}"
        # Before: a front with keys of its own and a separate gateway key forwards the client's key, which the
        # gateway does not know: it can never generate.
        forward = RestSettings(gateway_address=address, api_keys=("rest-key",), gateway_api_key="gw-key-only")
        async with rest(forward) as client:
            resp = await client.post("/v1/images/generations", json=body(),
                                     headers={"Authorization": "Bearer rest-key"})
            assert resp.status_code == 401
        own = RestSettings(gateway_address=address, api_keys=("rest-key",), gateway_api_key="gw-key-only",
                           gateway_auth="own")
        async with rest(own) as client:
            resp = await client.post("/v1/images/generations", json=body(),
                                     headers={"Authorization": "Bearer rest-key"})
            assert resp.status_code == 200, resp.text
            assert len(resp.json()["data"]) == 1
            stream = await client.post("/v1/images/generations", json={**body(), "stream": True},
                                       headers={"Authorization": "Bearer rest-key"})
            assert stream.status_code == 200 and "image_generation.completed" in stream.text
            assert (await client.get("/health")).status_code == 200
            # The front still checks its own clients: no key, or the gateway's key, is not a REST key.
            for headers in ({}, {"Authorization": "Bearer gw-key-only"}, {"Authorization": "Bearer nope"}):
                resp = await client.post("/v1/images/generations", json=body(), headers=headers)
                assert resp.status_code == 401, headers


async def test_rest_forward_mode_is_unchanged(sims: SimCluster) -> None:
    ar, d0 = sims.address(sims.ar), sims.address(sims.denoisers[0])
    async with running_gateway([ar], [d0], api_keys=("shared-1", "shared-2")) as gw:
        settings = RestSettings(gateway_address=f"127.0.0.1:{gw.port}", api_keys=("shared-1", "shared-2"),
                                gateway_api_key="shared-1")
        async with rest(settings) as client:
            resp = await client.post("/v1/images/generations", json=body(),
                                     headers={"Authorization": "Bearer shared-2"})
            assert resp.status_code == 200, resp.text
            assert (await client.get("/health")).status_code == 200
            assert (await client.post("/v1/images/generations", json=body())).status_code == 401
        # A front without keys forwards whatever the client sends, and the gateway decides.
        async with rest(RestSettings(gateway_address=f"127.0.0.1:{gw.port}", gateway_api_key="shared-1")) as client:
            ok = await client.post("/v1/images/generations", json=body(), headers={"Authorization": "Bearer shared-1"})
            assert ok.status_code == 200
            bad = await client.post("/v1/images/generations", json=body(), headers={"Authorization": "Bearer x"})
            assert bad.status_code == 401


def test_rest_flag_combinations_are_checked_at_start_up(monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("GLMIMAGE_API_KEYS", "GLMIMAGE_GATEWAY_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    for argv, why in [(["--gateway-auth", "own"], "--gateway-api-key"),
                      (["--gateway-auth", "own", "--api-key", "r"], "--gateway-api-key"),  # no fallback on r
                      (["--gateway-auth", "own", "--gateway-api-key", "g"], "--api-key"),
                      (["--gateway-auth", "mine"], "invalid choice")]:
        with pytest.raises(SystemExit):
            rest_main.parse_args(argv)
        assert why in capsys.readouterr().err, argv
    args = rest_main.parse_args(["--gateway-auth", "own", "--api-key", "r", "--gateway-api-key", "g"])
    settings = rest_main.settings_from_args(args)
    assert (settings.gateway_auth, settings.api_keys, settings.gateway_api_key) == ("own", ("r",), "g")
    monkeypatch.setenv("GLMIMAGE_GATEWAY_API_KEY", "g-env")
    assert rest_main.settings_from_args(rest_main.parse_args(["--gateway-auth", "own", "--api-key", "r"])
                                        ).gateway_api_key == "g-env"
    forward = rest_main.settings_from_args(rest_main.parse_args(["--api-key", "r"]))
    assert forward.gateway_auth == "forward" and forward.gateway_api_key == "g-env"



@pytest.mark.parametrize("module", ["gateway.__main__", "services.ar.__main__", "services.denoiser.__main__"])
def test_an_abbreviated_flag_never_swallows_a_secret(module: str, capsys: pytest.CaptureFixture[str]) -> None:
    # argparse would read "--internal-token S" as --internal-token-file S: S read as a path, and a file of that
    # name (or an error quoting it as one) in play. Abbreviations are off, so it is an unknown flag at once.
    import importlib

    with pytest.raises(SystemExit):
        importlib.import_module(module).parse_args(["--internal-token", "s3cret-value-123456"])
    err = capsys.readouterr().err
    assert "unrecognized arguments: --internal-token" in err and "No such file" not in err
