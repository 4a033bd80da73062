"""Who may do what: user and admin roles on GatewayService, the AddWorker allow-list and pool cap, the internal token
the workers require, and the REST front's credentials per hop.

Tested as an attacker would try it: no credential, a wrong one, a user key where an admin one is needed, addresses
meant to make the gateway dial somewhere it should not. The gateway is the real one (in-process, with the
interceptor `python -m gateway` installs, or as a process); the workers are the simulated servers of
bench/sim_backends.py, or the real AR and denoiser processes on the tiny model for the internal token.
"""
from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import httpx
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

import gateway.workers as workers_module
from bench.sim_backends import SimDenoiser, serve_sim_denoiser
from gateway.__main__ import config_from
from gateway.__main__ import parse_args as gateway_args
from gateway.membership import DnsMembership, parse_allow_rule
from gateway.rest import __main__ as rest_main
from gateway.rest.app import RestSettings, create_app
from gateway.scheduler.types import WorkerRole, WorkerState
from glmimage.v1 import ar_service_pb2, ar_service_pb2_grpc, denoiser_service_pb2, denoiser_service_pb2_grpc
from glmimage.v1 import gateway_service_pb2 as pb
from glmimage.v1 import gateway_service_pb2_grpc as pb_grpc
from services.runtime.auth import ENV_INTERNAL_TOKEN, check_token, internal_token_from, internal_tokens_from
from services.runtime.tls import ClientTls, ServerTls
from tests.support.certs import Pki
from tests.support.cluster import Cluster, running_stack
from tests.support.sim_gateway import (
    ADMIN,
    ADMIN_KEY,
    AVAILABLE,
    FAST,
    Gateway,
    SimCluster,
    request,
    rpc_error,
    running_gateway,
    sim_cluster,
)

USER_KEY = "user-key-for-tests"
USER = (("authorization", f"Bearer {USER_KEY}"),)
DENIED, UNAUTH = grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED


def bearer(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


def add(gw: Gateway, address: str, md=ADMIN, role=pb.WORKER_ROLE_DENOISER):
    return gw.stub.AddWorker(pb.AddWorkerRequest(address=address, role=role), metadata=md)


def remove(gw: Gateway, address: str, md=ADMIN):
    return gw.stub.RemoveWorker(pb.RemoveWorkerRequest(address=address), metadata=md)


async def members(gw: Gateway) -> dict[str, int]:
    return {w.address: w.state for w in (await gw.stub.GetStatus(pb.GetStatusRequest(), metadata=ADMIN)).workers}


async def until(gw: Gateway, predicate, timeout: float = 10.0) -> None:
    """Wait until ``predicate(members)`` holds (GetStatus with the admin key, which works whatever keys are set)."""
    async with asyncio.timeout(timeout):
        while not predicate(await members(gw)):
            await asyncio.sleep(0.005)


@pytest.fixture
async def sims() -> AsyncIterator[SimCluster]:
    """Simulated workers (real gRPC servers with health): one AR, three denoisers."""
    async with sim_cluster() as c:
        yield c


@pytest.fixture
def dialled(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every address the gateway creates a worker channel for, from now on (the real make_channel still runs)."""
    seen: list[str] = []
    real = workers_module.make_channel

    def recording(address, *args, **kwargs):
        seen.append(address)
        return real(address, *args, **kwargs)

    monkeypatch.setattr(workers_module, "make_channel", recording)
    return seen


@contextlib.asynccontextmanager
async def listener() -> AsyncIterator[tuple[int, list[object], asyncio.Event]]:
    """A TCP socket on an ephemeral loopback port that records every connection made to it."""
    accepted: list[object] = []
    event = asyncio.Event()

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer.get_extra_info("peername"))
        event.set()
        writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1], accepted, event
    finally:
        server.close()
        await server.wait_closed()


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
    async with running_gateway([ar], [d0], api_keys=(USER_KEY, "another-user-key")) as gw:
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
        assert views["owner"].workers[1].current_job == "mine/0#1"
        assert views["other"].workers[1].current_job == "" and views["other"].workers[1].inflight == 1
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


# ---- AddWorker: allow-list, address checks, pool cap ------------------------------------------------------------


async def test_add_worker_outside_the_allow_list_is_refused_without_dialling(sims: SimCluster,
                                                                            dialled: list[str]) -> None:
    ar, d0 = sims.address(sims.ar), sims.address(sims.denoisers[0])
    async with listener() as (port, accepted, _), listener() as (allowed_port, allowed_accepts, allowed_event):
        allow = (parse_allow_rule("10.0.0.0/8"), parse_allow_rule("*.denoiser.example:*"),
                 parse_allow_rule(f"localhost:{allowed_port}"), parse_allow_rule(f"127.0.0.1:{allowed_port}"))
        async with running_gateway([ar], [d0], worker_allow=allow) as gw:
            before = await members(gw)
            dialled.clear()
            for address in [f"127.0.0.1:{port}", f"localhost:{port}", f"[::ffff:127.0.0.1]:{port}",
                            f"127.0.0.2:{allowed_port}", f"evil.denoiser.example.attacker.net:{port}",
                            f"x.y.denoiser.example:{port}"]:
                err = await rpc_error(add(gw, address))
                assert err.code() == DENIED and err.details().startswith("address:"), address
                assert "--worker-allow" in err.details()
            assert dialled == [] and await members(gw) == before
            # The control: an allowed address is dialled at once (its health watch connects).
            await add(gw, f"127.0.0.1:{allowed_port}")
            await asyncio.wait_for(allowed_event.wait(), 10)
            assert dialled == [f"127.0.0.1:{allowed_port}"] and allowed_accepts
        assert accepted == []  # nothing ever connected to the refused port


async def test_an_empty_allow_list_refuses_every_address(sims: SimCluster, dialled: list[str]) -> None:
    d1 = sims.address(sims.denoisers[1])
    async with listener() as (port, accepted, _):
        async with running_gateway([sims.address(sims.ar)], [], worker_allow=()) as gw:
            dialled.clear()
            for address in (d1, f"127.0.0.1:{port}", f"localhost:{port}"):
                err = await rpc_error(add(gw, address))
                assert err.code() == DENIED and "no address" in err.details() and "--worker-allow" in err.details()
            assert dialled == [] and d1 not in await members(gw)
        assert accepted == []


# Every IP literal: what is refused below is refused for its form, before the allow-list is consulted.
EVERYTHING = (parse_allow_rule("0.0.0.0/0"), parse_allow_rule("[::/0]"), parse_allow_rule("*.svc"))


@pytest.mark.parametrize("address, why", [
    ("a" * 5000 + ":50061", "longer than"),
    ("a" * 254 + ":1", "254 characters"),
    (".".join(["a" * 63] * 4) + ":1", "characters"),  # 255 characters
    ("a" * 64 + ".svc:1", "labels of 1-63"),
    ("0.0.0.0:50061", "unspecified"),
    ("[::]:50061", "unspecified"),
    ("[::ffff:0.0.0.0]:50061", "unspecified"),
    ("224.0.0.1:50061", "multicast"),
    ("255.255.255.255:50061", "broadcast"),
    ("127.0.0.1:22 ", "whitespace"),
    (" 127.0.0.1:22", "whitespace"),
    ("127.0.0.1\t:22", "whitespace"),
    ("host\n:22", "whitespace"),
    ("h\x00:22", "whitespace"),
    ("hôst:22", "ASCII"),
    ("127.0.0.1:0", "port"),
    ("127.0.0.1:65536", "port"),
    ("127.0.0.1:-1", "port"),
    ("127.0.0.1:http", "port"),
    ("127.0.0.1", "HOST:PORT"),
    (":50061", "HOST:PORT"),
    ("127.1:50061", "non-standard"),
    ("2130706433:50061", "non-standard"),
    ("0x7f.0.0.1:50061", "non-standard"),
    ("1.2.3.4.5:50061", "all digits"),
    ("[fe80::1%eth0]:50061", "zone"),
    ("[127.0.0.1]:50061", "IPv6"),
    ("fd00::1:50061", "brackets"),
    ("a..b:1", "labels"),
    ("-a.svc:1", "labels"),
    ("a/b:1", "labels"),
    ("user@host:1", "labels"),
    ("unix:/tmp/sock", "port"),
    ("dns:///x:1", "schemes"),
    ("TLS://127.0.0.1:1", "schemes"),
    ("tls://", "HOST:PORT"),
    ("plaintext://127.1:50061", "non-standard"),
])
async def test_bad_addresses_are_refused_by_name(sims: SimCluster, dialled: list[str], address: str,
                                                 why: str) -> None:
    async with running_gateway([sims.address(sims.ar)], [], worker_allow=EVERYTHING) as gw:
        dialled.clear()
        err = await rpc_error(add(gw, address))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith("address:"), err.details()
        assert why in err.details()
        assert len(err.details()) < 400  # a 5,000-character name is not echoed back whole
        assert dialled == []


async def test_add_worker_lists_an_address_in_its_canonical_form(sims: SimCluster) -> None:
    port = sims.denoisers[1].port
    async with running_gateway([sims.address(sims.ar)], [], worker_allow=EVERYTHING) as gw:
        await add(gw, f"[::FFFF:127.0.0.1]:0{port}")
        await add(gw, f"127.0.0.1:{port}")  # the same worker: nothing new
        assert set(await members(gw)) == {sims.address(sims.ar), f"127.0.0.1:{port}"}
        await remove(gw, f"127.0.0.1:0{port}")
        await until(gw, lambda m: len(m) == 1)


async def test_add_worker_takes_tls_and_plaintext_addresses_as_the_readme_says(sims: SimCluster, pki: Pki) -> None:
    ar, plain = sims.address(sims.ar), sims.denoisers[0].port
    secure = await serve_sim_denoiser(SimDenoiser(FAST), tls=ServerTls(pki.server_cert, pki.server_key))
    try:
        # --tls-ca with --tls-only-marked: bare addresses stay plaintext, tls:// ones dial TLS.
        async with running_gateway([ar], [], client_tls=ClientTls(ca=pki.ca, only_marked=True)) as gw:
            await add(gw, f"tls://127.0.0.1:0{secure.port}")
            await add(gw, f"plaintext://127.0.0.1:{plain}")
            listed = {ar: AVAILABLE, f"tls://127.0.0.1:{secure.port}": AVAILABLE,
                      f"plaintext://127.0.0.1:{plain}": AVAILABLE}
            await until(gw, lambda m: m == listed)  # both reached, the TLS one over TLS
            assert len((await gw.stub.GenerateImages(request(n=2), metadata=ADMIN)).images) == 2
            # The same worker dialled another way would be a second member sending it a second job.
            for again in (f"127.0.0.1:{secure.port}", f"plaintext://127.0.0.1:{secure.port}"):
                err = await rpc_error(add(gw, again))
                assert err.code() == grpc.StatusCode.ALREADY_EXISTS and f"tls://127.0.0.1:{secure.port}" in \
                    err.details()
            await add(gw, f"tls://127.0.0.1:{secure.port}")  # itself again: nothing new
            await remove(gw, f"tls://127.0.0.1:0{secure.port}")  # listed and removed under its canonical form
            await until(gw, lambda m: set(m) == {ar, f"plaintext://127.0.0.1:{plain}"})
    finally:
        await secure.stop(None)


async def test_the_pool_cap_holds_for_add_worker_and_dns(sims: SimCluster, dialled: list[str]) -> None:
    ar, d0, d1, d2 = (sims.address(s) for s in (sims.ar, *sims.denoisers))
    async with running_gateway([ar], [d0, d1], max_workers=3) as gw:
        dialled.clear()
        err = await rpc_error(add(gw, d2))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "--max-workers=3" in err.details()
        err = await rpc_error(add(gw, d2, role=pb.WORKER_ROLE_AR))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION  # both roles count
        await add(gw, d1)  # re-adding a member at the cap is no new member
        assert dialled == []

        async def resolver(host: str, port: int) -> frozenset[str]:
            return frozenset({d2, "127.0.0.9:50061"})

        dns = DnsMembership.from_target("denoisers.glm.svc:50061", WorkerRole.DENOISER, gw.driver.add_worker,
                                        gw.driver.remove_worker, resolver=resolver)
        await dns.refresh()  # logged and skipped
        assert dialled == [] and gw.driver.pool_size() == 3 and dns.known == set()
        assert set(await members(gw)) == {ar, d0, d1}

        await remove(gw, d1)  # a place frees once the removed worker has drained
        await until(gw, lambda m: d1 not in m)
        await add(gw, d2)
        assert dialled == [d2]
        err = await rpc_error(add(gw, d1))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_gateway_flags_for_the_allow_list_and_the_cap(capsys: pytest.CaptureFixture[str]) -> None:
    config = config_from(gateway_args(["--worker-allow", "*.denoiser.ns.svc.cluster.local:50061",
                                       "--worker-allow", "10.0.0.0/8", "--admin-key", "a"]))
    assert [r.text for r in config.worker_allow] == ["*.denoiser.ns.svc.cluster.local:50061", "10.0.0.0/8"]
    assert config.max_workers == 256
    for bad in ("10.0.0.*", "10.0.0.1/8", "*", "host:0", "a b"):
        with pytest.raises(SystemExit):
            gateway_args(["--worker-allow", bad])
        assert "--worker-allow" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="more than --max-workers=1"):
        config_from(gateway_args(["--ar", "h:1", "--denoiser", "h:2", "--max-workers", "1"]))
    with pytest.raises(SystemExit, match="at least 1"):
        config_from(gateway_args(["--max-workers", "0"]))


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
    with running_stack(tmp_path, denoisers=1, extra_args=("--internal-token",)) as run:
        procs = [psutil.Process(run.proc.pid), *psutil.Process(run.proc.pid).children(recursive=True)]
        role = {p.pid: next((m for m in ("services.ar", "services.denoiser", "gateway.rest", "gateway")
                             if m in p.cmdline()), "launcher") for p in procs}
        envs = {role[p.pid]: p.environ() for p in procs}
        token = envs["services.ar"][ENV_INTERNAL_TOKEN]
        check_token(token, "the launcher")
        assert envs["services.denoiser"][ENV_INTERNAL_TOKEN] == envs["gateway"][ENV_INTERNAL_TOKEN] == token
        assert ENV_INTERNAL_TOKEN not in envs["gateway.rest"] and ENV_INTERNAL_TOKEN not in envs["launcher"]
        assert not any(token in " ".join(p.cmdline()) for p in procs)
        with grpc.insecure_channel(run.addresses["ar"]) as channel:
            with pytest.raises(grpc.RpcError) as err:
                ar_service_pb2_grpc.ArServiceStub(channel).Generate(
                    ar_service_pb2.GenerateRequest(prompt="a cat", height=64, width=64), timeout=60)
            assert err.value.code() == UNAUTH
        resp = httpx.post(f"http://{run.addresses['rest']}/v1/images/generations", timeout=120,
                          json={"prompt": "a cat", "size": "64x64"})
        assert resp.status_code == 200, resp.text


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
