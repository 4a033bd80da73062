"""Fixtures of the fuzz tests: the real AR and denoisers on the tiny model (tests/conftest.py) as the fuzz sees
them, and a gateway of its own over them per test."""
from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from glmimage.v1 import ar_service_pb2_grpc, denoiser_service_pb2_grpc
from tests.support.fuzz import FuzzGateway, Worker, Workers, address, fresh_gateway


@pytest.fixture
def workers(ar_server, denoiser_server, second_denoiser_server) -> Workers:
    return [address(ar_server)], [address(denoiser_server), address(second_denoiser_server)]



@pytest.fixture
async def gateway(workers: Workers) -> AsyncIterator[FuzzGateway]:
    async with fresh_gateway(workers) as gateway:
        yield gateway



@pytest.fixture
async def ar(ar_server) -> AsyncIterator[Worker]:
    async with grpc.aio.insecure_channel(address(ar_server)) as channel:
        yield Worker(ar_service_pb2_grpc.ArServiceStub(channel), channel, ar_server)



@pytest.fixture
async def denoiser(denoiser_server) -> AsyncIterator[Worker]:
    async with grpc.aio.insecure_channel(address(denoiser_server)) as channel:
        yield Worker(denoiser_service_pb2_grpc.DenoiserServiceStub(channel), channel, denoiser_server)

