"""Traces across the hops (runtime/tracing.py): the spans of one n=2 request, received over real OTLP from
every process of the stack, form one tree under the caller's traceparent; and with no endpoint nothing is set up."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from runtime import tracing
from tests.support.cluster import running_stack

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"


@dataclass
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent: str
    start: int
    end: int
    attributes: dict[str, object]
    links: list[str]


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC collector that keeps every span it is sent."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.lock = threading.Lock()

    def Export(self, request, context):
        for resource_spans in request.resource_spans:
            service = next((a.value.string_value for a in resource_spans.resource.attributes
                            if a.key == "service.name"), "")
            for scope in resource_spans.scope_spans:
                for s in scope.spans:
                    attributes = {a.key: _value(a.value) for a in s.attributes}
                    span = Span(service, s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                                s.start_time_unix_nano, s.end_time_unix_nano, attributes,
                                [link.span_id.hex() for link in s.links])
                    with self.lock:
                        self.spans.append(span)
        return trace_service_pb2.ExportTraceServiceResponse()


def _value(v) -> object:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


@pytest.fixture
def receiver() -> Iterator[tuple[Receiver, int]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    collector = Receiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield collector, port
    finally:
        server.stop(0)


def _one(spans: list[Span], service: str, name: str) -> Span:
    found = [s for s in spans if s.service == service and s.name == name]
    assert len(found) == 1, (service, name, [(s.service, s.name) for s in spans])
    return found[0]


def _within(child: Span, parent: Span) -> None:
    # Clocks of one host; a little slack for the rounding of the monotonic-to-wall conversion.
    slack = 5_000_000
    assert parent.start - slack <= child.start <= child.end <= parent.end + slack, (child, parent)


@pytest.mark.e2e
def test_one_n2_request_is_one_tree(tiny_checkpoint: Path, tmp_path: Path, receiver,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    collector, port = receiver
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # every child exports within a tenth of a second
    args = ("--otlp-endpoint", f"http://127.0.0.1:{port}")
    with running_stack(tmp_path, extra_args=args) as run:
        reply = httpx.post(f"http://{run.addresses['rest']}/v1/images/generations", timeout=120,
                           headers={"traceparent": f"00-{TRACE_ID}-{CALLER_SPAN}-01"},
                           json={"prompt": "a red sign", "n": 2, "size": "64x64", "seed": 3})
        assert reply.status_code == 200, reply.text
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with collector.lock:
                spans = [s for s in collector.spans if s.trace_id == TRACE_ID]
            if len([s for s in spans if s.service == "glmimage-denoiser"]) >= 2 \
                    and any(s.service == "glmimage-rest" for s in spans):
                break
            time.sleep(0.1)
    with collector.lock:
        spans = list(collector.spans)
    ours = [s for s in spans if s.trace_id == TRACE_ID]
    # Nothing of this request went to another trace (health checks and polls make no spans of their own).
    assert not [s for s in spans if s.trace_id != TRACE_ID], [(s.service, s.name) for s in spans]

    rest = _one(ours, "glmimage-rest", "POST /v1/images/generations")
    assert rest.parent == CALLER_SPAN
    assert rest.attributes["http.response.status_code"] == 200
    request = _one(ours, "glmimage-gateway", "glmimage.v1.GatewayService/GenerateImages")
    assert request.parent == rest.span_id
    ar_queue = _one(ours, "glmimage-gateway", "ar queue")
    ar_call = _one(ours, "glmimage-gateway", "ar call")
    ar_server = _one(ours, "glmimage-ar", "glmimage.v1.ArService/GenerateBatch")
    assert ar_queue.parent == ar_call.parent == request.span_id
    assert ar_server.parent == ar_call.span_id
    assert ar_server.attributes["glmimage.ar.outputs"] == 2
    assert ar_server.attributes["glmimage.ar.compute_seconds"] > 0
    assert ar_server.attributes["glmimage.ar.queue_seconds"] >= 0
    for child, parent in ((request, rest), (ar_queue, request), (ar_call, request), (ar_server, ar_call)):
        _within(child, parent)
    assert ar_queue.end <= ar_call.start + 5_000_000

    calls = sorted((s for s in ours if s.name == "denoise call"), key=lambda s: s.attributes["glmimage.output_index"])
    waits = [s for s in ours if s.name == "denoise queue"]
    servers = [s for s in ours if s.service == "glmimage-denoiser"]
    assert [c.attributes["glmimage.output_index"] for c in calls] == [0, 1]
    assert all(c.attributes["glmimage.attempt"] == 1 for c in calls), [c.attributes for c in calls]
    assert len(waits) == 2 and len(servers) == 2
    for call in calls:
        assert call.parent == request.span_id
        _within(call, request)
        assert call.start >= ar_call.end - 5_000_000  # the AR answered before any denoise began
        (server,) = [s for s in servers if s.parent == call.span_id]
        assert server.name == "glmimage.v1.DenoiserService/Denoise"
        _within(server, call)
        timings = [server.attributes[f"glmimage.denoise.{stage}_seconds"]
                   for stage in ("prepare", "denoise", "decode", "encode")]
        assert all(t > 0 for t in timings), server.attributes
        # Stage timings are perf_counter seconds, span stamps wall-clock ones: they may drift apart a little, so
        # the stages are bounded by the whole request's span, with room to spare.
        assert sum(timings) <= (rest.end - rest.start) / 1e9 * 1.5 + 0.05, (server.attributes, rest)
    for wait in waits:
        assert wait.parent == request.span_id
        _within(wait, request)
    # No prompt in any attribute.
    assert not [s for s in ours if any("a red sign" in str(v) for v in s.attributes.values())]


def test_no_endpoint_installs_nothing() -> None:
    # In a fresh interpreter: the global provider stays the API's proxy, the SDK is never imported, and the
    # metadata helpers add nothing.
    code = """
import sys
from opentelemetry import trace
from runtime import tracing
assert tracing.setup_tracing("x", tracing.endpoint_from(None)) is False
assert not tracing.enabled()
assert type(trace.get_tracer_provider()).__name__ == "ProxyTracerProvider"
assert not [m for m in sys.modules if m.startswith(("opentelemetry.sdk", "opentelemetry.exporter"))]
with tracing.tracer("t").start_as_current_span("s") as span:
    assert not span.is_recording()
    assert tracing.with_trace((("x-request-id", "r"),)) == (("x-request-id", "r"),)
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60,
                          cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_metadata_round_trip() -> None:
    # The propagator reads what it wrote; a malformed traceparent gives an empty context, never an error.
    parent = f"00-{TRACE_ID}-{CALLER_SPAN}-01"
    context = tracing.context_from_metadata([("traceparent", parent), ("x-request-id", "r")])
    from opentelemetry import trace

    assert format(trace.get_current_span(context).get_span_context().trace_id, "032x") == TRACE_ID
    bad = tracing.context_from_metadata([("traceparent", b"00-nonsense")])
    assert not trace.get_current_span(bad).get_span_context().is_valid
    headers = tracing.context_from_headers([(b"Traceparent", parent.encode())])
    assert trace.get_current_span(headers).get_span_context().span_id == int(CALLER_SPAN, 16)
