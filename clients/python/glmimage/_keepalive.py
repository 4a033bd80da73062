"""The SDK's channel settings: a copy of services.runtime.keepalive's client side (the SDK is its own package and
does not import the servers'); tests/test_keepalive.py checks that the two agree. The reasoning lives there.

In short: a keepalive ping every 10 s (the gateway accepts one every 5 s, so none is ever early and counted as a
strike), also on an idle connection and without grpc's cap of two pings between our own data frames; reconnects
after a gateway restart from 100 ms, capped at 1 s, instead of gRPC's default that grows to minutes.
"""
from __future__ import annotations

KEEPALIVE_TIME_MS = 10_000
KEEPALIVE_TIMEOUT_MS = 5_000
INITIAL_RECONNECT_BACKOFF_MS = 100
MAX_RECONNECT_BACKOFF_MS = 1_000
MIN_CONNECT_TIMEOUT_MS = 5_000  # grpc.min_reconnect_backoff_ms is the minimum connect timeout of an attempt

CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.initial_reconnect_backoff_ms", INITIAL_RECONNECT_BACKOFF_MS),
    ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
    ("grpc.min_reconnect_backoff_ms", MIN_CONNECT_TIMEOUT_MS),
)
