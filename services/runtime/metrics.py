"""Prometheus exposition for the gRPC servers: one HTTP /metrics endpoint per process (prometheus-client).

Metrics themselves are declared next to the code they measure, on the default registry; this module only
serves them. The REST front serves its own /metrics route instead.
"""
from __future__ import annotations

import logging

from prometheus_client import start_http_server

log = logging.getLogger(__name__)


def serve_metrics(host: str, port: int | None) -> int | None:
    """Start the /metrics HTTP endpoint on a daemon thread; returns the bound port (None when disabled)."""
    if port is None:
        return None
    server, _thread = start_http_server(port, addr=host)
    bound = server.server_port
    log.info("metrics on http://%s:%d/metrics", host, bound)
    return bound
