"""Slow clients and open connections: uvicorn's h11 protocol with deadlines on each request's head and body, a bound
on open connections, one framing per request, and a response's head sent with its body.

uvicorn itself bounds only the idle gap between two requests on a kept-alive connection (``timeout_keep_alive``): a
client that sends its head or its body a byte at a time holds its connection, and its buffers, as long as it likes.
Here, per connection:
- the whole request head must arrive within ``header_timeout`` seconds of the connection's start, or of the first
  byte of the next request on a kept-alive connection; past it the client gets 408 (a plain close when nothing of
  a head came) and the connection closes;
- the body must arrive within ``body_timeout`` seconds plus one second per ``body_min_rate`` bytes received, so an
  upload that keeps moving is never cut while a stalled or trickling one is: the app sees the client go away, the
  client gets 408 and the connection closes;
- beyond ``max_connections`` open connections a new one is closed at once, before anything of it is read;
- a request framed both by Content-Length and by Transfer-Encoding gets 400: h11 lets Transfer-Encoding win, and a
  proxy in front that went by Content-Length would read another request out of the same bytes (request smuggling,
  RFC 9112 section 6.1).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import h11
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

from .errors import APIError
from .middleware import OUTCOME_STATUS_KEY

log = logging.getLogger("glmimage.rest")

# h11's own bound on a request head (uvicorn's default too), when uvicorn's config sets none.
_MAX_HEAD_BYTES = 16 * 1024
# A flood of refused connections logs one line per this many seconds, with the count.
_REFUSAL_LOG_EVERY_S = 10.0


@dataclass(frozen=True)
class ConnectionGuards:
    header_timeout: float = 10.0  # seconds for a whole request head
    body_timeout: float = 30.0  # seconds for a body, plus one second per body_min_rate bytes received
    body_min_rate: float = 16 * 1024  # bytes per second
    keep_alive_timeout: float = 5.0  # seconds a kept-alive connection may stay idle between requests
    max_connections: int = 1000  # open connections; a new one beyond is closed at once

    def __post_init__(self) -> None:
        for name in GUARD_HELP:
            value = getattr(self, name)
            if not value > 0:  # also refuses NaN
                raise ValueError(f"--{name.replace('_', '-')} must be positive, not {value}")


# The flag of each guard (--header-timeout ...), in the operator's terms.
GUARD_HELP = {
    "header_timeout": "seconds a whole request head may take, from the connection's start or from the first byte of "
                      "the next request on a kept-alive one; past it 408 and close",
    "body_timeout": "seconds a request body may take, plus one per --body-min-rate bytes received; past it 408 and "
                    "close",
    "body_min_rate": "bytes per second that earn a body one second more than --body-timeout",
    "keep_alive_timeout": "seconds a kept-alive connection may stay idle between requests",
    "max_connections": "open client connections at most; a new one beyond is closed at once",
}


# How long a graceful shutdown leaves an idle kept-alive connection open for a request already on its way.
DRAIN_LINGER_S = 1.0


def protocol_class(guards: ConnectionGuards) -> type[H11Protocol]:
    """uvicorn's ``http`` protocol class applying ``guards``."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"guards": guards})


class _OneFraming(h11.Connection):
    """h11's server connection, refusing a request that carries both Content-Length and Transfer-Encoding: uvicorn
    answers its RemoteProtocolError with send_400_response, and closes."""

    refusal = ""  # why the last request was refused, in the client's terms
    status = 400  # and with which status (h11's hint: 431 for a head past the bound)
    closing = False  # the server is shutting down: every response from now on says Connection: close

    def send(self, event: Any) -> Any:
        # uvicorn closes a connection after its last response without saying so in the response, so a client
        # keeping the connection sends its next request into a closed socket (reset). Saying it lets the client
        # open a new connection instead.
        if self.closing and isinstance(event, h11.Response) and not any(
                name == b"connection" for name, _ in event.headers):
            event = h11.Response(status_code=event.status_code, reason=event.reason, http_version=event.http_version,
                                 headers=[*event.headers, (b"connection", b"close")])
        return super().send(event)

    def next_event(self) -> Any:
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as exc:
            self._refuse_head(exc.error_status_hint)
            raise
        if isinstance(event, h11.Request):
            names = {name for name, _ in event.headers}
            if b"content-length" in names and b"transfer-encoding" in names:
                self.refusal = "a request may give Content-Length or Transfer-Encoding, not both"
                raise h11.RemoteProtocolError(self.refusal, error_status_hint=400)
            # h11 bounds a head only while it is incomplete: one that arrived whole in one read is measured here.
            size = len(event.method) + len(event.target) + sum(len(n) + len(v) + 4 for n, v in event.headers)
            if size > self._max_incomplete_event_size:
                self._refuse_head(431)
                raise h11.RemoteProtocolError(self.refusal, error_status_hint=431)
        return event

    def _refuse_head(self, status: int) -> None:
        if status == 431:
            self.status = 431
            self.refusal = (f"the request head (its line and headers) is larger than the "
                            f"{self._max_incomplete_event_size // 1024} KiB this server accepts")


class _Refusals:
    """Connections refused for the bound, logged at most once per _REFUSAL_LOG_EVERY_S with how many."""

    def __init__(self) -> None:
        self.count = 0
        self.logged_at = -_REFUSAL_LOG_EVERY_S

    def note(self, limit: int) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self.logged_at >= _REFUSAL_LOG_EVERY_S:
            log.warning("refused %d connection(s) since the last such line: %d are open, the limit "
                        "(--max-connections)", self.count, limit)
            self.count, self.logged_at = 0, now


_refusals = _Refusals()


class _HeadWithBody:
    """A connection's transport that sends a response's head together with what follows it in the same turn of
    the event loop: uvicorn writes the head and the body apart, which costs a system call and a segment more per
    response, and the client a wake-up more. A write is held only until the next one or the end of the turn."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None

    def write(self, data: bytes) -> None:
        if not data:
            return
        if self._held is None:
            self._held = data
            self._loop.call_soon(self.flush)
            return
        data, self._held = self._held + data, None
        self._transport.write(data)

    def flush(self) -> None:
        if self._held is not None:
            data, self._held = self._held, None
            if not self._transport.is_closing():
                self._transport.write(data)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class GuardedH11Protocol(H11Protocol):
    """One client connection: uvicorn's h11 protocol with the clocks and the bound of ``guards``."""

    guards: ClassVar[ConnectionGuards] = ConnectionGuards()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        size = self.config.h11_max_incomplete_event_size
        self.conn = _OneFraming(h11.SERVER, _MAX_HEAD_BYTES if size is None else size)
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._body_since = 0.0  # when the body's clock started
        self._body_bytes = 0
        self._refused = False
        self._idle_since = self.loop.time()  # since its last response ended (or it connected)
        self._draining = False  # the server is shutting down: answer what comes with Connection: close

    # ---- asyncio.Protocol ----------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.guards.max_connections:
            self.transport, self._refused = transport, True
            _refusals.note(self.guards.max_connections)
            transport.close()
            return
        super().connection_made(_HeadWithBody(transport, self.loop))  # type: ignore[arg-type]
        self._arm_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head()
        self._cancel_body()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        state = self.conn.their_state
        if state is h11.IDLE and self._head_timer is None:
            self._arm_head()  # the first byte of the next request on a kept-alive connection
        elif state is h11.SEND_BODY:
            self._body_bytes += len(data)
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        self._idle_since = self.loop.time()
        super().on_response_complete()  # may go on to a pipelined request
        self._follow()

    def handle_events(self) -> None:
        super().handle_events()
        if self._draining and self.cycle is not None and not self.cycle.response_complete:
            self.cycle.keep_alive = False  # answered with Connection: close, then closed

    def shutdown(self) -> None:
        """The graceful shutdown of this connection. One busy with a request answers it with Connection: close
        (uvicorn's own way). One idle on keep-alive is closed only once it has been idle DRAIN_LINGER_S: a client
        sending back to back has its next request on the wire already, and closing under it resets that request (a
        client error for a request never seen); within the linger that request is served, with Connection: close."""
        self._draining = self.conn.closing = True
        if self._refused or self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:  # busy: answered, then closed
            super().shutdown()
            return
        # Idle, or a request's head on its way (closed with it, if it is still not whole past the head's clock).
        idle_for = self.loop.time() - self._idle_since
        if self.conn.their_state is h11.IDLE and idle_for >= DRAIN_LINGER_S:
            super().shutdown()
            return
        self.loop.call_later(max(0.0, DRAIN_LINGER_S - idle_for), self._close_if_idle)

    def _close_if_idle(self) -> None:
        if self.transport.is_closing():
            return
        if (self.cycle is None or self.cycle.response_complete) and self.conn.their_state is h11.IDLE:
            super().shutdown()

    def send_400_response(self, msg: str) -> None:
        """Malformed HTTP, answered in OpenAI's error shape like every other refusal."""
        status = getattr(self.conn, "status", 400)
        self._answer(status, self.conn.refusal or "the request is not valid HTTP/1.1",
                     "request_header_fields_too_large" if status == 431 else "invalid_request")

    # ---- the clocks ----------------------------------------------------------------------------------------

    def _follow(self) -> None:
        """Start or stop the head's and the body's clocks for the state h11 now has the client in."""
        state = self.conn.their_state
        if state is not h11.IDLE:
            self._cancel_head()
        elif self._head_timer is None and self.conn.trailing_data[0]:  # part of a pipelined head is here
            self._arm_head()
        if state is not h11.SEND_BODY:
            self._cancel_body()
        elif self._body_timer is None:
            self._body_since, self._body_bytes = self.loop.time(), 0
            self._body_timer = self.loop.call_later(self.guards.body_timeout, self._body_expired)

    def _arm_head(self) -> None:
        self._cancel_head()
        self._head_timer = self.loop.call_later(self.guards.header_timeout, self._head_expired)

    def _cancel_head(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _cancel_body(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _head_expired(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if not self.conn.trailing_data[0]:  # nothing of a request came: there is no one to answer
            self.transport.close()
            return
        log.info("%s: the request head took longer than %gs; answered 408", self._peer(), self.guards.header_timeout)
        self._answer(408, f"the request head did not arrive within {self.guards.header_timeout:g} s",
                     "request_timeout")

    def _body_expired(self) -> None:
        self._body_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.SEND_BODY:
            return
        g, now = self.guards, self.loop.time()
        if self.flow.read_paused:  # the app has not taken what came yet: the wait is the server's, not the client's
            self._body_since = now
        deadline = self._body_since + g.body_timeout + self._body_bytes / g.body_min_rate
        if now < deadline:
            self._body_timer = self.loop.call_later(deadline - now, self._body_expired)
            return
        log.info("%s: the request body took longer than %gs (%d bytes came); answered 408", self._peer(),
                 now - self._body_since, self._body_bytes)
        cycle = self.cycle
        if cycle is None or cycle.response_started:  # answered already (a refusal that did not wait for the body)
            self.transport.close()
            return
        cycle.scope["state"][OUTCOME_STATUS_KEY] = 408  # the metrics count what the client got
        cycle.disconnected = True  # the app's receive() now says the client left, and what it sends is dropped
        cycle.message_event.set()
        self._answer(408, f"the request body did not arrive within {g.body_timeout:g} s (and then at "
                     f"{g.body_min_rate:g} bytes/s)", "request_timeout")

    def _answer(self, status: int, message: str, code: str) -> None:
        """An OpenAI-shaped error in place of the app's answer, then close."""
        body = json.dumps(APIError(status, message, code=code).body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        try:
            for event in (h11.Response(status_code=status, headers=headers, reason=STATUS_PHRASES[status]),
                          h11.Data(data=body), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
        except h11.LocalProtocolError:  # h11 cannot answer in this state: close without an answer
            pass
        self.transport.close()

    def _peer(self) -> str:
        return f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
