"""The fuzz on the AR and the denoisers themselves, and bytes that are no message at all on every RPC of the gateway,
the AR and the denoisers.
"""
from __future__ import annotations

import grpc
import pytest
from google.protobuf.descriptor import ServiceDescriptor
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gateway.auth import ADMIN as ADMIN_ROLE
from gateway.auth import METHOD_ROLES
from glmimage.v1 import ar_service_pb2 as ar_pb
from glmimage.v1 import common_pb2
from glmimage.v1 import denoiser_service_pb2 as dn_pb
from glmimage.v1 import gateway_service_pb2 as gw_pb
from runtime.limits import round_up
from tests.support.fuzz import (
    AR_BASE,
    AR_BATCHES,
    AR_REQUESTS,
    CALL_TIMEOUT,
    DENOISE_BASE,
    DENOISE_REQUESTS,
    DENOISE_STREAM_REQUESTS,
    FUZZ,
    GARBAGE,
    INVALID,
    OK,
    FuzzGateway,
    Trail,
    Worker,
    assert_ar_recovered,
    assert_denoiser_recovered,
    assert_gateway_recovered,
    bad_utf8,
    check,
    describe,
    examples,
    streamed,
    unary,
)
from tests.support.sim_gateway import ADMIN

# Examples hold 100k-character strings on purpose; hypothesis warns when it builds their repr.
pytestmark = pytest.mark.filterwarnings("ignore:Generating overly large repr")

def check_prior(request: ar_pb.GenerateRequest, response: ar_pb.GenerateResponse) -> None:
    assert len(response.outputs) == (request.n or 1)
    assert (response.height, response.width) == (round_up(request.height), round_up(request.width))
    for out in response.outputs:
        assert len(out.tokens.token_ids) == response.grid_height * response.grid_width
        assert all(0 <= t < 128 for t in out.tokens.token_ids)  # the tiny codebook


@settings(FUZZ, max_examples=examples(5))
@given(batch=st.lists(AR_REQUESTS, min_size=1, max_size=2))
@example(batch=[ar_pb.GenerateRequest(**{**AR_BASE, "prompt": "x" * 8192}),  # the longest prompt
                ar_pb.GenerateRequest(**{**AR_BASE, "n": 16})])  # the most outputs
async def test_fuzz_ar_generate(ar: Worker, batch: list[ar_pb.GenerateRequest]) -> None:
    trail = Trail()
    for request in batch:
        answer = await unary(ar.stub.Generate(request, timeout=CALL_TIMEOUT))
        check(answer, f"Generate({describe(request)})", request.DESCRIPTOR, trail=trail)
        assert not ar.slot_held(), f"Generate({describe(request)}) left the model slot held{trail}"
        if answer.code == OK:
            check_prior(request, answer.replies[0])
    await assert_ar_recovered(ar, trail)


@settings(FUZZ, max_examples=examples(3))
@given(request=AR_BATCHES)
@example(request=ar_pb.GenerateBatchRequest())
@example(request=ar_pb.GenerateBatchRequest(requests=[ar_pb.GenerateRequest(**AR_BASE)] * 32))  # --max-batch-outputs
@example(request=ar_pb.GenerateBatchRequest(requests=[ar_pb.GenerateRequest(**AR_BASE)] * 33))
@example(request=ar_pb.GenerateBatchRequest(requests=[ar_pb.GenerateRequest(**AR_BASE)] * 10_000))
@example(request=ar_pb.GenerateBatchRequest(requests=[ar_pb.GenerateRequest(**AR_BASE),
                                                      ar_pb.GenerateRequest(**{**AR_BASE, "height": 96})]))
async def test_fuzz_ar_generate_batch(ar: Worker, request: ar_pb.GenerateBatchRequest) -> None:
    trail = Trail()
    answer = await unary(ar.stub.GenerateBatch(request, timeout=CALL_TIMEOUT))
    check(answer, f"GenerateBatch({describe(request)})", request.DESCRIPTOR, trail=trail)
    assert not ar.slot_held(), f"GenerateBatch({describe(request)}) left the model slot held{trail}"
    if answer.code == OK:
        assert len(answer.replies[0].responses) == len(request.requests)
        for req, resp in zip(request.requests, answer.replies[0].responses, strict=True):
            check_prior(req, resp)
    await assert_ar_recovered(ar, trail)


def check_image(job: dn_pb.DenoiseRequest, response: dn_pb.DenoiseResponse) -> None:
    assert (response.height, response.width) == (job.height, job.width) and response.image
    assert response.output_format == (job.output_format or common_pb2.IMAGE_FORMAT_PNG)


@settings(FUZZ, max_examples=examples(25))
@given(batch=st.lists(DENOISE_REQUESTS, min_size=1, max_size=3))
@example(batch=[dn_pb.DenoiseRequest(**{**DENOISE_BASE, "prompt": "x" * 8192},  # the longest prompt
                                     prior_tokens=common_pb2.TokenRow(token_ids=[127] * 16))])
async def test_fuzz_denoise(denoiser: Worker, batch: list[dn_pb.DenoiseRequest]) -> None:
    trail = Trail()
    for request in batch:
        answer = await unary(denoiser.stub.Denoise(request, timeout=CALL_TIMEOUT))
        check(answer, f"Denoise({describe(request)})", request.DESCRIPTOR, trail=trail)
        assert not denoiser.slot_held(), f"Denoise({describe(request)}) left the slot held{trail}"
        if answer.code == OK:
            check_image(request, answer.replies[0])
    await assert_denoiser_recovered(denoiser, trail)


@settings(FUZZ, max_examples=examples(20))
@given(batch=st.lists(DENOISE_STREAM_REQUESTS, min_size=1, max_size=3))
async def test_fuzz_denoise_stream(denoiser: Worker, batch: list[dn_pb.DenoiseStreamRequest]) -> None:
    trail = Trail()
    for request in batch:
        answer = await streamed(denoiser.stub.DenoiseStream(request, timeout=CALL_TIMEOUT))
        check(answer, f"DenoiseStream({describe(request)})", request.DESCRIPTOR, trail=trail)
        assert not denoiser.slot_held(), f"DenoiseStream({describe(request)}) left the slot held{trail}"
        if answer.code == OK:
            *events, last = answer.replies
            assert last.WhichOneof("event") == "result"
            check_image(request.job, last.result)
            partials = [e for e in events if e.WhichOneof("event") == "partial_image"]
            assert len(partials) <= min(request.partial_images, last.result.steps_completed - 1)
    await assert_denoiser_recovered(denoiser, trail)


# ---- bytes that are no message at all -------------------------------------------------------------------------


def services() -> list[ServiceDescriptor]:
    return [ar_pb.DESCRIPTOR.services_by_name["ArService"], dn_pb.DESCRIPTOR.services_by_name["DenoiserService"],
            gw_pb.DESCRIPTOR.services_by_name["GatewayService"]]


async def test_bytes_that_are_not_the_method_s_message_are_invalid_argument_on_every_rpc(
        gateway: FuzzGateway, ar: Worker, denoiser: Worker) -> None:
    trail = Trail()
    channels = {"glmimage.v1.ArService": ar.channel, "glmimage.v1.DenoiserService": denoiser.channel,
                "glmimage.v1.GatewayService": gateway.gw.channel}
    failures = []
    for service in services():
        for method in service.methods:
            channel, path = channels[service.full_name], f"/{service.full_name}/{method.name}"
            make = channel.unary_stream if method.server_streaming else channel.unary_unary
            rpc = make(path, request_serializer=lambda b: b, response_deserializer=lambda b: b)
            utf8 = bad_utf8(method.input_type)
            # The admin RPCs (as the gateway's table says) need the admin key before anything is read: without it,
            # UNAUTHENTICATED.
            needs_key = (service.full_name == "glmimage.v1.GatewayService"
                         and METHOD_ROLES.get(path, ADMIN_ROLE) == ADMIN_ROLE)
            for payload in [*GARBAGE, *([utf8] if utf8 else [])]:
                for metadata in ((), ADMIN) if needs_key else ((),):
                    call = rpc(payload, timeout=CALL_TIMEOUT, metadata=metadata)
                    answer = await (streamed(call) if method.server_streaming else unary(call))
                    allowed = INVALID if metadata or not needs_key else grpc.StatusCode.UNAUTHENTICATED
                    try:
                        check(answer, f"{path}({describe(payload)})", None, allowed=frozenset({allowed}),
                              hidden=gateway.hidden())
                    except AssertionError as exc:
                        failures.append(str(exc).split("\n", 1)[0])
    assert not failures, "\n".join(failures)
    assert not ar.slot_held() and not denoiser.slot_held()
    await assert_gateway_recovered(gateway, trail)
