"""Prometheus exposition for the gRPC servers: one HTTP /metrics endpoint per process (prometheus-client).

Metrics themselves are declared next to the code they measure, on the default registry; this module only
serves them. The REST front serves its own /metrics route instead.
"""
from __future__ import annotations

import logging
from pathlib import Path

from prometheus_client import start_http_server

from runtime.paths import write_port_file

log = logging.getLogger(__name__)


def serve_metrics(host: str, port: int | None, port_file: Path | None = None) -> int | None:
    """Start the /metrics HTTP endpoint on a daemon thread; returns the bound port (None when disabled).
    ``port_file``: where to write that port (``--metrics-port 0`` picks one; a port chosen by the caller and bound
    later can be taken by another process in between)."""
    if port is None:
        return None
    server, _thread = start_http_server(port, addr=host)
    bound = server.server_port
    log.info("metrics on http://%s:%d/metrics", host, bound)
    if port_file is not None:
        write_port_file(port_file, bound)
    return bound
