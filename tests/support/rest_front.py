"""The REST front as `python -m rest` serves it (its own flags, its uvicorn server and protocol), in the
test's event loop on an ephemeral loopback port, and raw HTTP/1.1 over asyncio streams for what clients do badly."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from rest import __main__ as rest_main

STARTUP_TIMEOUT = 30.0  # the lifespan reads the gateway's limits first: generous on a loaded machine


@dataclass
class RestFront:
    server: rest_main.RestServer
    port: int
    clients: list[asyncio.StreamWriter] = field(default_factory=list)  # closed before the server stops

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def open_connections(self) -> int:
        return len(self.server.server_state.connections)

    async def until_open_connections(self, count: int, timeout: float) -> None:
        """Wait until the server holds ``count`` client connections (it accepts asynchronously)."""
        async with asyncio.timeout(timeout):
            while self.open_connections() != count:
                await asyncio.sleep(0.01)

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A raw connection; one a failed test leaves open is closed before the server stops (which waits for
        its connections)."""
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        self.clients.append(writer)
        return reader, writer


@contextlib.asynccontextmanager
async def serving(gateway_address: str, *flags: str) -> AsyncIterator[RestFront]:
    """The front over ``gateway_address`` with ``flags`` (the command line's), stopped on exit; uvicorn's own log
    lines reach pytest's log capture too."""
    args = rest_main.parse_args(["--gateway-address", gateway_address, "--log-level", "warning", *flags])
    server = rest_main.build_server(args)
    sock = rest_main.listen_socket("127.0.0.1", 0)
    uvicorn_log = logging.getLogger("uvicorn")
    propagate, uvicorn_log.propagate = uvicorn_log.propagate, True
    front = RestFront(server, sock.getsockname()[1])
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        async with asyncio.timeout(STARTUP_TIMEOUT):
            while not server.started:
                if task.done():
                    task.result()  # raises what stopped it
                    raise RuntimeError("the REST front stopped while starting")
                await asyncio.sleep(0.01)
        yield front
    finally:
        for writer in front.clients:
            writer.close()
        server.should_exit = True
        await task
        sock.close()
        uvicorn_log.propagate = propagate


async def read_until_closed(reader: asyncio.StreamReader, timeout: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and how long that took."""
    t0, data = time.monotonic(), b""
    async with asyncio.timeout(timeout):
        with contextlib.suppress(ConnectionResetError):  # a reset is a close too (what was read before stands)
            while chunk := await reader.read(65536):
                data += chunk
    return data, time.monotonic() - t0


def status_of(response: bytes) -> int:
    """The status code of a raw HTTP/1.1 response ("HTTP/1.1 408 Request Timeout ...")."""
    return int(response.split(b" ", 2)[1]) if response.startswith(b"HTTP/1.1 ") else 0


def errors_logged(records: list[logging.LogRecord]) -> list[logging.LogRecord]:
    """The ERROR records of the REST front and its uvicorn server among ``records`` (the servers of other test
    modules may log meanwhile)."""
    return [r for r in records if r.levelno >= logging.ERROR and r.name.startswith(("glmimage", "uvicorn"))]
