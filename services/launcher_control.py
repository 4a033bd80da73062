"""The launcher's control socket: `python -m services.launcher ctl stop|start|restart NAME` sends one line to a running
launcher, which stops one server so that it stays down, starts it again, or rolls a server or each of a role in turn
(a worker counts as back once every gateway takes work from it again). The client (`ctl`) and the server
(`serve_control`) of that one-line protocol, and the rolling restart itself.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import socket
import sys
import tempfile
from pathlib import Path

import grpc

from glmimage.v1 import gateway_service_pb2 as gw_pb
from glmimage.v1 import gateway_service_pb2_grpc as gw_grpc
from services.supervisor import Child, Supervisor

log = logging.getLogger("services.launcher")

CONTROL_SOCKET = "control.sock"  # in the supervisor's run directory; its path is in the ready file as "control"
CTL_HELP = ("python -m services.launcher ctl [--socket PATH | --ready-file F] stop|start|restart NAME: stop one "
            "server (drained by SIGTERM) so that it is not restarted, or start it again (a server given up on, too: "
            "with a fresh restart budget) and wait until it is healthy, or restart it (drained, started again, and "
            "for a worker: until every gateway takes work from it again). NAME as in the banner (denoiser-1, "
            "gateway, ...); restart also takes a role (ar, denoiser, gateway, rest): each server of it in turn. "
            "The socket is the ready file's \"control\"; without either flag, the one running stack's.")
ROLES = ("ar", "denoiser", "gateway", "rest")
# How long a restarted worker may take to be taken back by every gateway (their health watches retry within ~1 s).
REJOIN_SECONDS = 60.0


def role_of(name: str) -> str:
    """A child's role from its banner name: denoiser-1 -> denoiser, gateway-2 -> gateway, ar, rest."""
    return name.rsplit("-", 1)[0] if name.rsplit("-", 1)[-1].isdigit() else name


def restart_targets(sup: Supervisor, word: str) -> list[Child]:
    """The servers `restart WORD` rolls, in start order: the one so named, else every one of that role."""
    child = sup.find(word)
    if child is not None:
        return [child]
    return [c for c in sup.children if role_of(c.name) == word] if word in ROLES else []


async def gateways_take(sup: Supervisor, worker: Child, status_key: str | None, timeout: float) -> bool:
    """Whether every serving gateway shows ``worker`` AVAILABLE or BUSY within ``timeout``: a restarted worker
    counts as back only then, or the next restart could drain the last one the gateways use."""
    usable = (gw_pb.WORKER_STATE_AVAILABLE, gw_pb.WORKER_STATE_BUSY)
    metadata = (("authorization", f"Bearer {status_key}"),) if status_key else ()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    for gateway in [c for c in sup.children if role_of(c.name) == "gateway" and c.serving]:
        async with grpc.aio.insecure_channel(gateway.address) as channel:
            stub = gw_grpc.GatewayServiceStub(channel)
            while True:
                try:
                    status = await stub.GetStatus(gw_pb.GetStatusRequest(), timeout=5, metadata=metadata)
                    if any(w.address == worker.address and w.state in usable for w in status.workers):
                        break
                except grpc.aio.AioRpcError as exc:
                    log.info("restart: %s: GetStatus: %s", gateway.name, exc.code().name)
                if loop.time() > deadline:
                    return False
                await asyncio.sleep(0.1)
    return True


async def restart(sup: Supervisor, word: str, status_key: str | None = None) -> str:
    """`ctl restart NAME|ROLE`: each server in turn drained, started again and back (for a worker: taken by
    every gateway) before the next; stops at the first that does not come back. ``ok ...`` or ``error ...``."""
    targets = restart_targets(sup, word)
    if not targets:
        return (f"error no server or role named {word!r}; the servers: {', '.join(c.name for c in sup.children)}; "
                f"the roles: {', '.join(ROLES)}")
    said = []
    for child in targets:
        said.append(await sup.restart_child(child))
        if not child.serving:
            return "error " + "; ".join(said)
        if role_of(child.name) in ("ar", "denoiser") and not await gateways_take(sup, child, status_key,
                                                                                 REJOIN_SECONDS):
            return "error " + "; ".join([*said, f"a gateway did not take {child.name} back in {REJOIN_SECONDS:g}s"])
    return "ok " + "; ".join(said)


async def serve_control(sup: Supervisor, status_key: str | None = None) -> asyncio.AbstractServer | None:
    """The control socket: one line in (`stop NAME`, `start NAME` or `restart NAME|ROLE`), one line out (`ok ...`
    or `error ...`). A Unix socket in the run directory (mode 0700, as mkdtemp makes it): only this user reaches
    it, and a reply can say what happened, which a signal could not. None, logged, if it cannot be made (a path
    too long for AF_UNIX)."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            words = (await asyncio.wait_for(reader.readline(), 10)).decode(errors="replace").split()
            child = sup.find(words[1]) if len(words) == 2 else None
            if len(words) != 2 or words[0] not in ("stop", "start", "restart"):
                reply = "error expected 'stop NAME', 'start NAME' or 'restart NAME|ROLE'"
            elif words[0] == "restart":
                reply = await restart(sup, words[1], status_key)
            elif child is None:
                reply = f"error no server named {words[1]!r}; the servers: {', '.join(c.name for c in sup.children)}"
            else:
                reply = "ok " + await (sup.stop_child(child) if words[0] == "stop" else sup.start_child(child))
            writer.write(reply.encode() + b"\n")
            await writer.drain()
        except (TimeoutError, ConnectionError):
            pass  # a client that said nothing or went away: nothing to answer
        finally:
            writer.close()

    path = sup.run_dir / CONTROL_SOCKET
    try:
        return await asyncio.start_unix_server(handle, path)
    except OSError as exc:
        log.warning("no control socket (%s): `ctl stop|start|restart` will not reach this launcher", exc)
        return None


def ctl(argv: list[str]) -> int:
    """`python -m services.launcher ctl ...`: send one command to a running launcher and print its reply."""
    p = argparse.ArgumentParser(prog="python -m services.launcher ctl", allow_abbrev=False, description=CTL_HELP)
    where = p.add_mutually_exclusive_group()
    where.add_argument("--socket", type=Path, help="the launcher's control socket")
    where.add_argument("--ready-file", type=Path, help="the launcher's --ready-file, which names its socket")
    p.add_argument("command", choices=("stop", "start", "restart"))
    p.add_argument("name", help="the server, as the banner names it (denoiser-1, gateway, ...); for restart also a "
                                f"role ({', '.join(ROLES)}): each of its servers in turn")
    a = p.parse_args(argv)
    if a.ready_file:
        a.socket = Path(json.loads(a.ready_file.read_text())["control"])
    if a.socket is None:
        # Every launcher's run directory is a glmimage-stack-* in the temporary directory; a killed one's socket
        # is left behind but refuses connections.
        live = [path for path in sorted(Path(tempfile.gettempdir()).glob(f"glmimage-stack-*/{CONTROL_SOCKET}"))
                if _reachable(path)]
        if len(live) != 1:
            p.exit(1, f"ctl: {'several stacks run' if live else 'no running launcher found'}: give --socket or "
                      "--ready-file\n")
        a.socket = live[0]
    with socket.socket(socket.AF_UNIX) as sock:
        try:
            sock.connect(str(a.socket))
        except OSError as exc:
            p.exit(1, f"ctl: cannot reach the launcher at {a.socket} ({exc.strerror})\n")
        sock.sendall(f"{a.command} {a.name}\n".encode())
        reply = sock.makefile(encoding="utf-8", errors="replace").readline().rstrip("\n")
    ok, _, text = reply.partition(" ")
    print(text or "no reply: see the launcher's log", file=sys.stdout if ok == "ok" else sys.stderr)
    return 0 if ok == "ok" else 1


def _reachable(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX) as sock:
        try:
            sock.connect(str(path))
        except OSError:
            return False
    return True
