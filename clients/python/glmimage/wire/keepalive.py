"""Client-side connection settings of every gRPC hop of the suite: the SDK -> gateway, the REST front -> gateway
and the gateway -> AR and denoisers all dial with these (through glmimage.wire.channels).

What the servers accept, and the reasoning behind both ends (how grpc core polices pings, and what went wrong
before), is in runtime.keepalive, which imports these numbers; tests/test_keepalive.py checks that the
servers accept what the clients send. In short: a keepalive ping every 10 s (the servers accept one every 5 s, so
none is ever early and counted as a strike), also on an idle connection and without grpc's cap of two pings
between our own data frames; reconnects from 100 ms, capped at 1 s, instead of gRPC's default that grows to minutes.
"""
from __future__ import annotations

# 10 s + 5 s: a peer whose node vanished without closing the connection is noticed within ~15 s even while idle
# (the gateway then marks the worker unhealthy instead of sending it the next burst).
KEEPALIVE_TIME_MS = 10_000
KEEPALIVE_TIMEOUT_MS = 5_000

# gRPC's default starts at 1 s and grows by 1.6x to 120 s, so a peer restarted after a few seconds' outage was
# retried only 8-13 s later. From 100 ms, growing 1.6x, capped at 1 s (+-20% jitter): a restarted peer is reached
# within about a second of it listening again.
INITIAL_RECONNECT_BACKOFF_MS = 100
MAX_RECONNECT_BACKOFF_MS = 1_000
# grpc.min_reconnect_backoff_ms is, despite its name, the minimum *connect timeout* of an attempt (TCP connect plus
# TLS and HTTP/2 handshakes; default 20 s). At 100 ms a TLS handshake on a loaded node or across a WAN failed
# every early attempt. 5 s: ample for a handshake, short enough that an attempt stuck on a vanished address (no
# RST) is soon retried. A refused connection (the peer's process is down) fails at once and only backs off.
MIN_CONNECT_TIMEOUT_MS = 5_000

Options = tuple[tuple[str, int], ...]

# Every client channel of the suite, whatever its hop.
CLIENT_OPTIONS: Options = (
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),  # ping idle connections too: that is when nobody else would notice
    ("grpc.http2.max_pings_without_data", 0),  # keep the 10 s period on an idle connection (default: 1/min after 2)
    ("grpc.initial_reconnect_backoff_ms", INITIAL_RECONNECT_BACKOFF_MS),
    ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
    ("grpc.min_reconnect_backoff_ms", MIN_CONNECT_TIMEOUT_MS),
)


def message_size_options(receive_bytes: int, send_bytes: int) -> Options:
    return (("grpc.max_receive_message_length", receive_bytes), ("grpc.max_send_message_length", send_bytes))
