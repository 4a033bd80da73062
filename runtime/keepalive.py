"""Keepalive settings the servers accept, and why they agree with what every client sends.

The client side, one definition for every hop (gateway -> AR and denoisers, REST front -> gateway, Python SDK ->
gateway), is ``glmimage.wire.keepalive``, applied by ``glmimage.wire.channels`` (the protocol package, in the base
install, must not import ``services``, so the servers import it from there); what every server accepts is here
(``runtime.server.start_server``). Torch-free and grpc-free: plain channel arguments.

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

# The client side, re-exported for the reasoning above and the servers' own message sizes.
from glmimage.wire.keepalive import (
    KEEPALIVE_TIME_MS,
    KEEPALIVE_TIMEOUT_MS,
    Options,
    message_size_options,
)

__all__ = ["KEEPALIVE_TIMEOUT_MS", "KEEPALIVE_TIME_MS", "RECONNECT_WAIT_S", "SERVER_MAX_PING_STRIKES",
           "SERVER_MIN_PING_INTERVAL_MS", "SERVER_OPTIONS", "Options", "message_size_options"]

# Server side: the shortest interval between pings it accepts without a strike, and how many strikes it forgives.
# Must stay well below every client's KEEPALIVE_TIME_MS (tests/test_keepalive.py checks every hop).
SERVER_MIN_PING_INTERVAL_MS = 5_000
SERVER_MAX_PING_STRIKES = 2

# REST front: how long a request that finds the gateway channel reconnecting (TRANSIENT_FAILURE) waits for it to
# become ready before the call is made (and then fails with 503 if it is still down): one capped backoff with its
# jitter plus a connect, so a request arriving just after the gateway came back is served, not refused.
RECONNECT_WAIT_S = 2.0

# What every server accepts (AR, denoisers, gateway).
SERVER_OPTIONS: Options = (
    ("grpc.http2.min_ping_interval_without_data_ms", SERVER_MIN_PING_INTERVAL_MS),
    ("grpc.http2.max_ping_strikes", SERVER_MAX_PING_STRIKES),
    # Pings on a connection with no call open are fine: REST and SDK channels between requests are exactly that.
    ("grpc.keepalive_permit_without_calls", 1),
)

