"""Slow clients and too many connections on the REST front (rest/connections.py), with raw HTTP/1.1 over
loopback against the front as `python -m rest` serves it (tests/support/rest_front.py), its timeouts set
short by its own flags. Every bound a test waits for is TIMEOUT; the test allows 3x that and more (a loaded 2-core
machine), and never less than the timeout itself (no early cut)."""
from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from rest import __main__ as rest_main
from tests.support.edit_gateway import serve_edit_fake
from tests.support.fake_gateway import FakeServer
from tests.support.rest_front import RestFront, errors_logged, read_until_closed, serving, status_of

TIMEOUT = 1.0  # the head, body and keep-alive timeouts of the front under test
WAIT = 4 * TIMEOUT + 2  # what a test allows for one of them to pass
MAX_CONNECTIONS = 16
FLAGS = ("--header-timeout", str(TIMEOUT), "--body-timeout", str(TIMEOUT), "--keep-alive-timeout", str(TIMEOUT),
         "--max-connections", str(MAX_CONNECTIONS))
REPO = Path(__file__).resolve().parents[1]
GENERATE_HEAD = (b"POST /v1/images/generations HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n")


@pytest.fixture(scope="module")
def gateway() -> Iterator[FakeServer]:
    with serve_edit_fake() as srv:
        yield srv


@pytest_asyncio.fixture()
async def front(gateway: FakeServer) -> AsyncIterator[RestFront]:
    gateway.servicer.reset()
    async with serving(gateway.address, *FLAGS) as front:
        yield front


def error_of(response: bytes) -> dict:
    head, _, body = response.partition(b"\r\n\r\n")
    assert b"connection: close" in head.lower(), head
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return error


async def requests_counted(front: RestFront, status: int) -> float:
    async with httpx.AsyncClient(base_url=front.base_url) as c:
        text = (await c.get("/metrics")).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("glmimage_rest_requests_total{") and f'status="{status}"' in line)


async def test_slow_headers_are_answered_408_and_closed(front: RestFront) -> None:
    """The reported slowloris, scaled down: connections sending one header line at a time, well under the timeout
    apart, are all answered 408 and closed once the head has taken longer than the timeout."""

    async def slowloris() -> tuple[bytes, float]:
        reader, writer = await front.connect()
        t0 = time.monotonic()
        writer.write(GENERATE_HEAD)

        async def trickle() -> None:
            for i in range(1000):
                await asyncio.sleep(TIMEOUT / 4)
                writer.write(b"X-Slow-%d: 1\r\n" % i)

        dripping = asyncio.create_task(trickle())
        try:
            data, _ = await read_until_closed(reader, WAIT)
        finally:
            dripping.cancel()
            writer.close()
        return data, time.monotonic() - t0

    answers = await asyncio.gather(*(slowloris() for _ in range(10)))
    for data, seconds in answers:
        assert status_of(data) == 408, data
        assert error_of(data)["code"] == "request_timeout"
        assert TIMEOUT * 0.9 <= seconds < WAIT
    await front.until_open_connections(0, WAIT)


async def test_a_connection_that_sends_nothing_is_closed_without_an_answer(front: RestFront) -> None:
    reader, writer = await front.connect()
    data, seconds = await read_until_closed(reader, WAIT)
    writer.close()
    assert data == b"" and seconds >= TIMEOUT * 0.9


async def test_a_short_body_is_answered_408_within_the_body_timeout(front: RestFront, gateway: FakeServer) -> None:
    """The reported request: Content-Length 1000, 33 bytes sent, then nothing."""
    before = await requests_counted(front, 408)
    reader, writer = await front.connect()
    writer.write(GENERATE_HEAD + b"Content-Length: 1000\r\n\r\n" + b'{"prompt": "a cat", "n": 1, "x": "')
    data, seconds = await read_until_closed(reader, WAIT)
    writer.close()
    assert status_of(data) == 408, data
    assert error_of(data)["code"] == "request_timeout"
    assert TIMEOUT * 0.9 <= seconds < WAIT
    assert gateway.servicer.calls == []
    assert await requests_counted(front, 408) == before + 1  # the metrics count what the client got


async def test_a_stalled_edit_upload_is_answered_408_and_the_app_logs_no_error(
        front: RestFront, gateway: FakeServer, caplog: pytest.LogCaptureFixture) -> None:
    boundary = b"b0undary"
    part = (b"--" + boundary + b'\r\nContent-Disposition: form-data; name="image"; filename="a.png"\r\n'
            b"Content-Type: image/png\r\n\r\n\x89PNG\r\n")
    reader, writer = await front.connect()
    writer.write(b"POST /v1/images/edits HTTP/1.1\r\nHost: test\r\nContent-Type: multipart/form-data; boundary="
                 + boundary + b"\r\nContent-Length: 100000\r\n\r\n" + part)
    data, _ = await read_until_closed(reader, WAIT)
    writer.close()
    assert status_of(data) == 408, data
    assert gateway.servicer.calls == []
    assert not errors_logged(caplog.records)


async def test_a_body_that_keeps_moving_is_not_cut_but_a_trickle_is(gateway: FakeServer) -> None:
    """The body's clock: TIMEOUT plus one second per --body-min-rate bytes. A body sent at ten times that rate
    takes several timeouts and still goes through; one sent at a fifth of it is cut."""
    rate = 1000  # bytes/s
    flags = (*FLAGS, "--body-min-rate", str(rate))
    body = b'{"prompt": "a cat"' + b" " * (30 * rate) + b"}"  # 30 s at the minimum rate, 3 s at 10x

    async def send(chunk: int, interval: float) -> tuple[bytes, float]:
        reader, writer = await front.connect()
        t0 = time.monotonic()
        writer.write(GENERATE_HEAD + b"Content-Length: %d\r\n\r\n" % len(body))

        async def sending() -> None:
            for i in range(0, len(body), chunk):
                writer.write(body[i:i + chunk])
                await asyncio.sleep(interval)

        task = asyncio.create_task(sending())
        try:
            data, _ = await read_until_closed(reader, 30)
        finally:
            task.cancel()
            writer.close()
        return data, time.monotonic() - t0

    async with serving(gateway.address, *flags) as front:
        moving, seconds = await send(chunk=rate, interval=0.1)  # 10x the minimum rate
        assert status_of(moving) == 200, moving[:300]
        assert seconds > 2 * TIMEOUT  # it took longer than the body timeout alone
        trickle, seconds = await send(chunk=rate // 100, interval=0.05)  # a fifth of the minimum rate
        assert status_of(trickle) == 408, trickle[:300]
        # Cut at about TIMEOUT + a quarter second, far short of the 150 s the whole body would take at that rate:
        # the bound leaves a loaded machine ten times the margin.
        assert seconds < 15 * TIMEOUT


async def test_an_idle_kept_alive_connection_is_closed_and_the_next_head_has_its_own_clock(
        front: RestFront) -> None:
    get = b"GET /v1/models HTTP/1.1\r\nHost: test\r\n\r\n"
    reader, writer = await front.connect()
    for _ in range(2):  # kept alive: a second request on the same connection is served
        writer.write(get)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT)
        assert status_of(head) == 200, head
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:")))
        await asyncio.wait_for(reader.readexactly(length), WAIT)
    data, seconds = await read_until_closed(reader, WAIT)  # then idle: closed after the keep-alive timeout
    writer.close()
    assert data == b"" and TIMEOUT * 0.9 <= seconds < WAIT

    # A request begun on a kept-alive connection but never finished gets 408.
    reader, writer = await front.connect()
    writer.write(get)
    await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT)
    writer.write(b"GET /v1/models HTTP/1.1\r\n")
    data, _ = await read_until_closed(reader, WAIT)
    writer.close()
    assert b"HTTP/1.1 408 " in data, data


async def test_content_length_with_chunked_transfer_encoding_is_refused(front: RestFront,
                                                                        gateway: FakeServer) -> None:
    """h11 alone lets Transfer-Encoding win; a proxy going by Content-Length would see a second request."""
    body = b'{"prompt": "a cat"}'
    for headers in (b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n" % len(body),
                    b"Transfer-Encoding: chunked\r\nContent-Length: 5\r\n"):
        reader, writer = await front.connect()
        writer.write(GENERATE_HEAD + headers + b"\r\n" + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
        data, _ = await read_until_closed(reader, WAIT)
        writer.close()
        assert status_of(data) == 400, data
        assert "Content-Length" in error_of(data)["message"]
    assert gateway.servicer.calls == []
    # Either alone is fine.
    for headers, payload in ((b"Content-Length: %d\r\n" % len(body), body),
                             (b"Transfer-Encoding: chunked\r\n", b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))):
        reader, writer = await front.connect()
        writer.write(GENERATE_HEAD + headers + b"Connection: close\r\n\r\n" + payload)
        data, _ = await read_until_closed(reader, WAIT)
        writer.close()
        assert status_of(data) == 200, data[:300]


async def test_malformed_http_is_an_openai_shaped_400(front: RestFront) -> None:
    reader, writer = await front.connect()
    writer.write(b"NOT HTTP AT ALL\r\n\r\n")
    data, _ = await read_until_closed(reader, WAIT)
    writer.close()
    assert status_of(data) == 400 and error_of(data)["code"] == "invalid_request"


async def test_connections_beyond_the_bound_are_closed_at_once(gateway: FakeServer) -> None:
    patient = 30.0  # the head timeout here: the connections held open must stay so, and a refusal must be the bound
    async with serving(gateway.address, *FLAGS, "--header-timeout", str(patient)) as front:
        held = [await front.connect() for _ in range(MAX_CONNECTIONS)]
        await front.until_open_connections(MAX_CONNECTIONS, WAIT)
        reader, writer = await front.connect()
        data, seconds = await read_until_closed(reader, WAIT)
        writer.close()
        assert data == b"" and seconds < patient / 3
        assert front.open_connections() == MAX_CONNECTIONS
        # One place frees: the next connection is served.
        held.pop()[1].close()
        await front.until_open_connections(MAX_CONNECTIONS - 1, WAIT)
        reader, writer = await front.connect()
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n")
        data, _ = await read_until_closed(reader, WAIT)
        writer.close()
        assert status_of(data) == 200, data
        for _, w in held:
            w.close()


async def test_the_front_s_own_process_applies_its_flags(gateway: FakeServer, tmp_path: Path) -> None:
    """`python -m rest` itself: a slow head gets 408 after --header-timeout; SIGTERM exits 0."""
    port_file = tmp_path / "port"
    with (tmp_path / "rest.log").open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "rest", "--port", "0", "--port-file", str(port_file),
                                 "--gateway-address", gateway.address, *FLAGS], cwd=REPO, stdout=out,
                                 stderr=subprocess.STDOUT)
    try:
        async with asyncio.timeout(60):  # imports and the lifespan, on a loaded machine
            while not port_file.exists():
                assert proc.poll() is None, (tmp_path / "rest.log").read_text()
                await asyncio.sleep(0.05)
        reader, writer = await asyncio.open_connection("127.0.0.1", int(port_file.read_text()))
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: test\r\n")
        data, seconds = await read_until_closed(reader, 60)  # the accept waits for uvicorn's own start
        writer.close()
        assert status_of(data) == 408, data
        assert seconds >= TIMEOUT * 0.9
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_connection_flags() -> None:
    guards = rest_main.guards_from_args(rest_main.parse_args([]))
    assert (guards.header_timeout, guards.body_timeout, guards.keep_alive_timeout, guards.max_connections) == (
        10.0, 30.0, 5.0, 1000)
    guards = rest_main.guards_from_args(rest_main.parse_args(list(FLAGS) + ["--body-min-rate", "100"]))
    assert (guards.header_timeout, guards.body_timeout, guards.body_min_rate, guards.max_connections) == (
        TIMEOUT, TIMEOUT, 100.0, MAX_CONNECTIONS)
    for flag in ("--header-timeout", "--body-timeout", "--body-min-rate", "--keep-alive-timeout",
                 "--max-connections"):
        for bad in ("0", "-1", "nan"):
            if flag == "--max-connections" and bad == "nan":
                continue
            with pytest.raises(SystemExit):
                rest_main.parse_args([flag, bad])
