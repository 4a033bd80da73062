"""AddWorker as an attacker would use it: addresses outside the allow-list or meant to make the gateway dial
somewhere it should not are refused without dialling, and the pool cap holds for AddWorker and DNS alike.
"""
from __future__ import annotations

import asyncio

import grpc
import pytest

from bench.sim_backends import SimDenoiser, serve_sim_denoiser
from gateway.__main__ import config_from
from gateway.__main__ import parse_args as gateway_args
from gateway.membership import DnsMembership, parse_allow_rule
from gateway.scheduler.types import WorkerRole
from glmimage.v1 import gateway_service_pb2 as pb
from runtime.tls import ClientTls, ServerTls
from tests.support.authz import DENIED, add, listener, members, remove, until
from tests.support.certs import Pki
from tests.support.sim_gateway import (
    ADMIN,
    AVAILABLE,
    FAST,
    SimCluster,
    request,
    rpc_error,
    running_gateway,
)

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
        assert dialled == [] and len(gw.driver.members) == 3 and dns.known == set()
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
