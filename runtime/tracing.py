"""OpenTelemetry traces across the hops: REST front -> gateway -> AR and denoisers (docs/operating.md#traces).

Off unless an OTLP endpoint is given (``--otlp-endpoint``, else ``$OTEL_EXPORTER_OTLP_ENDPOINT``): then no SDK
provider is installed, the API's no-op tracer answers every call, and the servers skip their span work entirely
(``enabled()``). On, spans go in batches to an OTLP/gRPC collector. The W3C ``traceparent``/``tracestate`` travel
in gRPC metadata, read and written by the API's own TraceContext propagator.
"""
from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Iterable

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)

ENV_ENDPOINT = "OTEL_EXPORTER_OTLP_ENDPOINT"
TRACE_KEYS = ("traceparent", "tracestate")
_PROPAGATOR = TraceContextTextMapPropagator()
_enabled = False


def add_tracing_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--otlp-endpoint", default=None, metavar="URL",
                   help="send OpenTelemetry traces to this OTLP/gRPC collector (http://host:port or host:port: "
                        f"plaintext; https://: TLS); default ${ENV_ENDPOINT}, else off")


def endpoint_from(flag: str | None) -> str | None:
    """The flag, else the standard variable, else None (off)."""
    return flag or os.environ.get(ENV_ENDPOINT) or None


def enabled() -> bool:
    return _enabled


def setup_tracing(service_name: str, endpoint: str | None) -> bool:
    """Install the SDK provider exporting to ``endpoint``; nothing at all when it is None. True when on.

    The exporter is plaintext unless the endpoint says https:// (a collector on the same host or pod network). The
    SDK is imported only here, so a server with traces off never loads it; its provider flushes at exit."""
    global _enabled
    if not endpoint:
        return False
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    exporter = OTLPSpanExporter(endpoint=endpoint, insecure=not endpoint.startswith("https://"))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _enabled = True
    log.info("traces go to %s as %s", endpoint, service_name)
    return True


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def _text(value: str | bytes) -> str:
    return value if isinstance(value, str) else value.decode("latin-1")


def context_from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> Context:
    """The caller's trace context from gRPC invocation metadata (an empty context when it sent none)."""
    carrier = {key: _text(value) for key, value in metadata or () if key in TRACE_KEYS}
    return _PROPAGATOR.extract(carrier)


def context_from_headers(headers: Iterable[tuple[bytes, bytes]]) -> Context:
    """The caller's trace context from raw ASGI headers."""
    carrier = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in headers}
    return _PROPAGATOR.extract({k: v for k, v in carrier.items() if k in TRACE_KEYS})


def with_trace(metadata: tuple[tuple[str, str], ...], context: Context | None = None
               ) -> tuple[tuple[str, str], ...]:
    """``metadata`` plus the traceparent (and tracestate) of ``context`` (default: the current one); unchanged
    when traces are off or there is no span to carry."""
    if not _enabled:
        return metadata
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=context)
    return metadata + tuple(carrier.items())
