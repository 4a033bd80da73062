"""The one status-code map (runtime.status): pinned as it was when each hop kept its own copy, and
read the same way by a real server raising a domain error and the REST front answering its status."""
from __future__ import annotations

import grpc
import pytest

from gateway.downstream import client_message
from glmimage.v1 import gateway_service_pb2 as pb
from glmimage.v1 import gateway_service_pb2_grpc
from rest.errors import from_rpc_error
from runtime.errors import ErrorKind, error_for
from runtime.server import start_server
from runtime.status import ROWS, code_of, kind_of, row_of

C = grpc.StatusCode
# What REST's GRPC_TO_HTTP said: grpc-gateway's HTTP status and the OpenAI error type, per code.
HTTP = {
    C.INVALID_ARGUMENT: (400, "invalid_request_error"), C.FAILED_PRECONDITION: (400, "invalid_request_error"),
    C.OUT_OF_RANGE: (400, "invalid_request_error"), C.UNAUTHENTICATED: (401, "authentication_error"),
    C.PERMISSION_DENIED: (403, "permission_error"), C.NOT_FOUND: (404, "not_found_error"),
    C.ALREADY_EXISTS: (409, "invalid_request_error"), C.ABORTED: (409, "server_error"),
    C.RESOURCE_EXHAUSTED: (429, "rate_limit_error"), C.CANCELLED: (499, "request_cancelled"),
    C.INTERNAL: (500, "server_error"), C.UNKNOWN: (500, "server_error"), C.DATA_LOSS: (500, "server_error"),
    C.UNIMPLEMENTED: (501, "server_error"), C.UNAVAILABLE: (503, "server_error"),
    C.DEADLINE_EXCEEDED: (504, "timeout_error"),
}
# The server's STATUS_OF: one code per domain error kind, named alike.
KIND_CODES = {kind: C[kind.name] for kind in ErrorKind}
# The gateway's ERROR_CODE_OF keys: a worker answering one of these refused the client's input.
REFUSALS = {C.INVALID_ARGUMENT, C.OUT_OF_RANGE, C.FAILED_PRECONDITION}


def test_the_table_keeps_each_hops_old_mapping() -> None:
    assert {row.code: (row.http, row.openai_type) for row in ROWS} == HTTP
    assert {kind: code_of(kind) for kind in ErrorKind} == KIND_CODES
    assert {row.code for row in ROWS if row.refusal} == REFUSALS
    assert len({row.code for row in ROWS}) == len(ROWS)  # one row per code
    assert row_of(C.OK).http == 500 and row_of(C.OK).openai_code == "ok"  # no row: a server error


@pytest.mark.parametrize("code", list(C), ids=[c.name for c in C])
def test_a_workers_failure_is_the_clients_only_when_it_refused_the_input(code: grpc.StatusCode) -> None:
    expected = ErrorKind.INVALID_ARGUMENT if code in REFUSALS else ErrorKind.UNAVAILABLE
    assert kind_of(code, ErrorKind.UNAVAILABLE) is expected


class _Raising(gateway_service_pb2_grpc.GatewayServiceServicer):
    """Raises, as a domain error, the kind named by the request's prompt."""

    async def GenerateImages(self, request, context):
        raise error_for(ErrorKind[request.prompt], f"{request.prompt.lower()} happened")


@pytest.fixture
async def raising_stub():
    server = await start_server(lambda s: gateway_service_pb2_grpc.add_GatewayServiceServicer_to_server(_Raising(), s),
                                ["glmimage.v1.GatewayService"], "127.0.0.1:0")
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    yield gateway_service_pb2_grpc.GatewayServiceStub(channel)
    await channel.close()
    await server.stop(None)


@pytest.mark.parametrize("kind", list(ErrorKind), ids=[k.name for k in ErrorKind])
async def test_a_domain_error_keeps_its_meaning_over_every_hop(raising_stub, kind: ErrorKind) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await raising_stub.GenerateImages(pb.GenerateImagesRequest(prompt=kind.name), timeout=10)
    err = caught.value
    assert err.code() is KIND_CODES[kind]
    api = from_rpc_error(err)
    assert (api.status, api.type, api.code) == (*HTTP[err.code()], err.code().name.lower())
    # Our server composed the text (and marked it so): REST shows it as is.
    assert api.message == f"{kind.name.lower()} happened"
    # The gateway relaying it from a worker: a refusal keeps the worker's text, anything else is told in its words.
    told = client_message("denoiser", err)
    if kind is ErrorKind.INVALID_ARGUMENT:
        assert told == api.message
    else:
        assert told.startswith("the denoiser ") and "happened" not in told
