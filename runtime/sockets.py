"""Listening TCP sockets for the HTTP servers (the REST front binds one itself, or inherits the one the launcher's
supervisor holds over its restarts)."""
from __future__ import annotations

import socket


def listen_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket created with an explicit IPPROTO_TCP (port 0: a free one, bound now).

    socket.create_server leaves proto at 0, and asyncio only sets TCP_NODELAY on accepted sockets whose proto
    is IPPROTO_TCP: without it, Nagle's algorithm meets the client's delayed ACK and every response after the
    first on a keep-alive connection waits ~40 ms.
    """
    family, type_, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, type_, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock
