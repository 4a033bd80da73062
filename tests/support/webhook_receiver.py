"""A real webhook receiver for tests: an HTTP(S) server on 127.0.0.1 (an ephemeral port) in a thread, recording
every TCP connection it accepts and every request it reads, programmable to fail the first K requests or to
redirect.

With TLS its certificate comes from a trustme CA (for localhost, 127.0.0.1 and ::1); ``ca_file`` is that CA's PEM,
the bundle a sender is told to trust. ``connections`` counts accepted connections before any TLS or HTTP, so a
test can show a sender never dialled it.
"""
from __future__ import annotations

import http.server
import socket
import ssl
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import trustme


@dataclass(frozen=True)
class Received:
    method: str
    path: str
    headers: dict[str, str]  # names lower-cased
    body: bytes
    local_address: str  # the address the sender connected to
    server_name: str | None  # TLS SNI the sender sent (None without TLS or without SNI)


class WebhookReceiver:
    def __init__(self, tmp: Path, *, tls: bool = True, fail_first: int = 0, fail_status: int = 500,
                 redirect_to: str | None = None) -> None:
        self.fail_first = fail_first
        self.fail_status = fail_status
        self.redirect_to = redirect_to  # every request answered 302 to it
        self.requests: list[Received] = []
        self.connections = 0
        self._lock = threading.Condition()
        self._ctx: ssl.SSLContext | None = None
        self.ca_file: Path | None = None
        self._sni: dict[int, str | None] = {}  # id(SSLSocket) -> the SNI its client sent
        if tls:
            ca = trustme.CA()
            self.ca_file = tmp / f"webhook-ca-{id(self):x}.pem"
            ca.cert_pem.write_to_path(str(self.ca_file))
            self._ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ca.issue_cert("localhost", "127.0.0.1", "::1").configure_cert(self._ctx)
            self._ctx.sni_callback = self._on_sni
        self._server = _Server(self)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), name="webhook-receiver",
                                        daemon=True)

    @property
    def scheme(self) -> str:
        return "https" if self._ctx else "http"

    def url(self, path: str = "/hook", host: str = "127.0.0.1") -> str:
        return f"{self.scheme}://{host}:{self.port}{path}"

    def wait_for_requests(self, n: int, timeout: float) -> list[Received]:
        """Block until ``n`` requests arrived (AssertionError after ``timeout`` s); from async code run it with
        asyncio.to_thread."""
        with self._lock:
            if not self._lock.wait_for(lambda: len(self.requests) >= n, timeout):
                raise AssertionError(f"the receiver got {len(self.requests)} requests, not {n}, in {timeout}s")
            return list(self.requests)

    def _on_sni(self, sslobj: ssl.SSLSocket, name: str | None, _ctx: ssl.SSLContext) -> None:
        with self._lock:
            self._sni[id(sslobj)] = name

    def _record(self, req: Received) -> int:
        """Store a request; returns how many came before it."""
        with self._lock:
            self.requests.append(req)
            self._lock.notify_all()
            return len(self.requests) - 1

    def start(self) -> WebhookReceiver:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, receiver: WebhookReceiver) -> None:
        self.receiver = receiver
        super().__init__(("127.0.0.1", 0), _Handler)

    def get_request(self) -> tuple[socket.socket, object]:
        sock, addr = super().get_request()
        with self.receiver._lock:
            self.receiver.connections += 1
        if self.receiver._ctx is not None:
            # The handshake runs in the connection's own thread, at its first read: a stalled client cannot block
            # accept().
            sock = self.receiver._ctx.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return sock, addr


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        rec = self.server.receiver
        body = self.rfile.read(int(self.headers.get("content-length", "0")))
        sock = self.connection
        with rec._lock:  # popped: a later socket may reuse this one's id
            sni = rec._sni.pop(id(sock), None) if isinstance(sock, ssl.SSLSocket) else None
        before = rec._record(Received(self.command, self.path, {k.lower(): v for k, v in self.headers.items()},
                                      body, sock.getsockname()[0], sni))
        if rec.redirect_to is not None:
            self._answer(302, {"Location": rec.redirect_to})
        elif before < rec.fail_first:
            self._answer(rec.fail_status)
        else:
            self._answer(200)

    do_GET = do_POST

    def _answer(self, status: int, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", "0")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (http.server's signature)
        pass


@contextmanager
def webhook_receiver(tmp: Path, **kwargs: object) -> Iterator[WebhookReceiver]:
    rec = WebhookReceiver(tmp, **kwargs).start()  # type: ignore[arg-type]
    try:
        yield rec
    finally:
        rec.stop()
