"""Keepalive and connection settings for every gRPC hop of the suite, in one place so both ends of a hop agree.

The hops: gateway -> AR and denoisers (``gateway.driver.CHANNEL_OPTIONS``), REST front -> gateway
(``gateway.rest.upstream``), Python SDK -> gateway (``glmimage._keepalive``: a copy, since the SDK must not import
``services``; tests/test_keepalive.py checks that it agrees), and what every server accepts
(``services.runtime.server.start_server``). Torch-free and grpc-free: plain channel arguments.

How grpc core (chttp2, grpcio 1.85) polices pings, which is what the numbers below must respect:

- A server counts a *strike* for every ping that arrives sooner than
  ``grpc.http2.min_ping_interval_without_data_ms`` (default 5 minutes) after the previous one. Strikes (and that
  clock) reset only when the server itself sends headers or data. After ``grpc.http2.max_ping_strikes`` strikes
  (default 2) the next early ping is answered with GOAWAY ENHANCE_YOUR_CALM "too_many_pings": the connection
  closes with every call on it, and the client doubles its keepalive time for that channel.
- The gateway keeps a health Watch open on every worker for days. Between bursts the worker sends nothing on that
  connection, so the strikes never reset there: only the interval decides.
- A client sends at most ``grpc.http2.max_pings_without_data`` pings (default 2) before it must send data itself;
  after that grpc throttles its pings to one a minute, so a keepalive of 10 s silently became a ping a minute on an
  idle connection. BDP pings go out when the client reads data, i.e. right after the server sent some, which
  resets the strikes: they never count.
- A server with ``grpc.keepalive_permit_without_calls`` 0 treats a connection with no call open as idle and then
  allows one ping per 2 hours.

What went wrong before this module: the servers set ``grpc.http2.min_recv_ping_interval_without_data_ms``, which
is the C macro's name (GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS), not the argument's string. grpc
ignores unknown arguments silently, so the 5-minute default stood, every 10-second keepalive ping of the gateway
was a strike, and the third one since a worker last answered anything (an idle gap of about 30 s or more, then a
burst) got GOAWAY: the worker's connection closed under the burst's AR batch, the gateway marked the worker
unreachable, and fail-fast answered 503 to everything queued. (Seen with GRPC_TRACE=http2_ping on the workers:
``received ping ... next_allowed_ping=@<last ping + 300000>ms ping_strikes=2``, then the gateway logged
``Received a GOAWAY with error code ENHANCE_YOUR_CALM and debug data equal to "too_many_pings"``.)

How the numbers agree: every client pings every KEEPALIVE_TIME_MS (10 s) and the servers accept a ping every
SERVER_MIN_PING_INTERVAL_MS (5 s), half of that, so a keepalive ping is never early even when a loaded node fires
its timer seconds late or a BDP ping came just before; no strike is ever counted in normal operation, and
SERVER_MAX_PING_STRIKES keeps grpc's default of 2 so that a client pinging faster than every 5 s (misconfigured
or hostile) is still cut off. Clients lift the pings-without-data cap (0 = unlimited) so the keepalive keeps its
period on an idle connection, which is when a vanished peer would otherwise go unnoticed.
"""
from __future__ import annotations

# ---- the numbers ------------------------------------------------------------------------------------------------

# Client keepalive, every hop. 10 s + 5 s: a peer whose node vanished without closing the connection is noticed
# within ~15 s even while idle (the gateway then marks the worker unhealthy instead of sending it the next burst).
KEEPALIVE_TIME_MS = 10_000
KEEPALIVE_TIMEOUT_MS = 5_000

# Server side: the shortest interval between pings it accepts without a strike, and how many strikes it forgives.
# Must stay well below every client's KEEPALIVE_TIME_MS (tests/test_keepalive.py checks every hop).
SERVER_MIN_PING_INTERVAL_MS = 5_000
SERVER_MAX_PING_STRIKES = 2

# Reconnect backoff, every hop: gRPC's default starts at 1 s and grows by 1.6x to 120 s, so a peer restarted after a
# few seconds' outage was retried only 8-13 s later. From 100 ms, growing 1.6x, capped at 1 s (+-20% jitter): a
# restarted peer is reached within about a second of it listening again.
INITIAL_RECONNECT_BACKOFF_MS = 100
MAX_RECONNECT_BACKOFF_MS = 1_000
# grpc.min_reconnect_backoff_ms is, despite its name, the minimum *connect timeout* of an attempt (TCP connect plus
# TLS and HTTP/2 handshakes; default 20 s). At 100 ms a TLS handshake on a loaded node or across a WAN failed
# every early attempt. 5 s: ample for a handshake, short enough that an attempt stuck on a vanished address (no
# RST) is soon retried. A refused connection (the peer's process is down) fails at once and only backs off.
MIN_CONNECT_TIMEOUT_MS = 5_000

# REST front: how long a request that finds the gateway channel reconnecting (TRANSIENT_FAILURE) waits for it to
# become ready before the call is made (and then fails with 503 if it is still down): one capped backoff with its
# jitter plus a connect, so a request arriving just after the gateway came back is served, not refused.
RECONNECT_WAIT_S = 2.0

# ---- channel arguments ------------------------------------------------------------------------------------------

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

# Per hop, so that a hop can diverge later with its reason written here.
WORKER_CHANNEL_OPTIONS: Options = CLIENT_OPTIONS  # gateway -> AR, denoisers
GATEWAY_CHANNEL_OPTIONS: Options = CLIENT_OPTIONS  # REST front -> gateway, and the Python SDK's copy

# What every server accepts (AR, denoisers, gateway).
SERVER_OPTIONS: Options = (
    ("grpc.http2.min_ping_interval_without_data_ms", SERVER_MIN_PING_INTERVAL_MS),
    ("grpc.http2.max_ping_strikes", SERVER_MAX_PING_STRIKES),
    # Pings on a connection with no call open are fine: REST and SDK channels between requests are exactly that.
    ("grpc.keepalive_permit_without_calls", 1),
)


def message_size_options(receive_bytes: int, send_bytes: int) -> Options:
    return (("grpc.max_receive_message_length", receive_bytes), ("grpc.max_send_message_length", send_bytes))
