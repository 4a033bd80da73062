"""Fixtures of the REST front's tests: the scripted gateway (tests/support/rest_gateway.py) on a real port, reset
before every test, and one app over it for the tests that need no settings of their own."""
from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import httpx
import pytest_asyncio
from fastapi import FastAPI
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from glmimage.v1 import gateway_service_pb2_grpc as gw_grpc
from rest.app import RestSettings, create_app
from tests.support.rest_gateway import Backend, FakeGateway, asgi_client


@pytest_asyncio.fixture(scope="session")
async def backend() -> AsyncIterator[Backend]:
    server = grpc.aio.server()
    servicer = FakeGateway()
    health_servicer = health.aio.HealthServicer()
    gw_grpc.add_GatewayServiceServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield Backend(f"127.0.0.1:{port}", servicer, health_servicer)
    finally:
        await server.stop(grace=None)


@pytest_asyncio.fixture(autouse=True)
async def _reset(backend: Backend) -> None:
    backend.servicer.reset()
    await backend.health.set("", health_pb2.HealthCheckResponse.SERVING)



@pytest_asyncio.fixture(scope="session")
async def app(backend: Backend) -> AsyncIterator[FastAPI]:
    app = create_app(RestSettings(gateway_address=backend.address))
    async with app.router.lifespan_context(app):
        yield app


@pytest_asyncio.fixture(scope="session")
async def client(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    async with asgi_client(app) as c:
        yield c

