"""Keys, worker membership calls and a connection recorder for the tests/test_authz*.py files."""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc

from glmimage.v1 import gateway_service_pb2 as pb
from tests.support.sim_gateway import ADMIN, Gateway

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
