"""The real AR and denoiser gRPC services in this process, on 127.0.0.1:<ephemeral>, SERVING.

The servicers are imported when a server starts, not with this module: they pull in transformers and torch, which
would slow down every test run that imports the fixtures (tests/conftest.py) but starts no model server.
"""
from __future__ import annotations

from typing import Any

from glmimage.v1 import ar_service_pb2_grpc, denoiser_service_pb2_grpc
from runtime.executor import SerialExecutor
from runtime.server import GrpcServer, start_server
from runtime.tls import ServerTls

AR_SERVICE = "glmimage.v1.ArService"
DENOISER_SERVICE = "glmimage.v1.DenoiserService"


async def serve_ar(backend: Any, executor: SerialExecutor, *, tls: ServerTls | None = None) -> GrpcServer:
    """An ArService over `backend` (an engine or a forwarding backend); `.servicer` exposes its admission queue."""
    from services.ar.servicer import ArServicer

    servicer = ArServicer(backend, executor)
    server = await start_server(lambda s: ar_service_pb2_grpc.add_ArServiceServicer_to_server(servicer, s),
                                [AR_SERVICE], "127.0.0.1:0", tls=tls)
    await server.set_serving(True)
    server.servicer = servicer  # type: ignore[attr-defined]
    return server


async def serve_denoiser(engine: Any, executor: SerialExecutor, *, tls: ServerTls | None = None) -> GrpcServer:
    """A DenoiserService over `engine`; `.servicer` exposes its busy flag and executor.

    Two servers on one engine must share its executor: one pipeline never runs two jobs at once."""
    from services.denoiser.servicer import DenoiserServicer

    servicer = DenoiserServicer(engine, executor)
    server = await start_server(
        lambda s: denoiser_service_pb2_grpc.add_DenoiserServiceServicer_to_server(servicer, s),
        [DENOISER_SERVICE], "127.0.0.1:0", tls=tls)
    await server.set_serving(True)
    server.servicer = servicer  # type: ignore[attr-defined]
    return server
