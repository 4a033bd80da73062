"""The Python SDK (`glmimage.Client`, `glmimage.AsyncClient`) against a real gRPC server with a scripted gateway.

The scripted GatewayService (tests/support/fake_gateway.py) records every call with its metadata and can fail the
next calls with chosen status codes, which is what retries, deadlines and auth need; TLS uses certificates made at
test time (tests/support/certs.py).
"""
from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from glmimage import (
    NO_RETRY,
    AsyncClient,
    Client,
    Completed,
    GlmImageError,
    PartialImage,
    Progress,
    RetryPolicy,
    TlsConfig,
)
from glmimage.v1 import common_pb2, gateway_service_pb2
from tests.support.certs import Pki
from tests.support.fake_gateway import FakeServer, fake_image, serve_fake

FAST_RETRY = RetryPolicy(max_attempts=4, initial_backoff=0.01, max_backoff=0.05)


@pytest.fixture(scope="module")
def mtls_server(pki: Pki) -> Iterator[FakeServer]:
    with serve_fake(pki.server_credentials(mutual=True)) as srv:
        yield srv


@pytest.fixture(scope="module")
def tls_server(pki: Pki) -> Iterator[FakeServer]:
    with serve_fake(pki.server_credentials(mutual=False)) as srv:
        yield srv


# --- the blocking client ---------------------------------------------------------------------------------------------


def test_generate_returns_images_in_order_with_usage_and_seeds(fake: FakeServer, tmp_path: Path) -> None:
    with Client(fake.address) as client:
        result = client.generate("a red sign", n=3, size="512x256", seed=7, steps=9, guidance=3.5,
                                 output_format="jpeg", output_compression=80)
    assert result.images == [fake_image("a red sign", i, 7 + i, common_pb2.IMAGE_FORMAT_JPEG) for i in range(3)]
    assert result.seeds == [7, 8, 9]
    assert (result.width, result.height, result.output_format) == (512, 256, "jpeg")
    assert result.usage.completion_tokens == 3 * ((256 // 16) * (512 // 16) + 1)
    assert result.usage.total_tokens == result.usage.prompt_tokens + result.usage.completion_tokens
    assert [u.completion_tokens for u in result.image_usages] == [513] * 3
    (call,) = fake.servicer.calls
    req = call.request
    assert (req.prompt, req.n, req.width, req.height, req.seed) == ("a red sign", 3, 512, 256, 7)
    assert (req.num_inference_steps, req.guidance_scale, req.output_compression) == (9, 3.5, 80)
    assert req.output_format == common_pb2.IMAGE_FORMAT_JPEG
    assert "authorization" not in call.metadata

    paths = result.save(tmp_path / "out", "cat")
    assert [p.name for p in paths] == ["cat-0.jpg", "cat-1.jpg", "cat-2.jpg"]
    assert [p.read_bytes() for p in paths] == result.images


def test_size_as_tuple_and_gateway_defaults(fake: FakeServer) -> None:
    with Client(fake.address) as client:
        client.generate("p", size=(320, 192))
        client.generate("p")
    first, second = (c.request for c in fake.servicer.calls)
    assert (first.width, first.height) == (320, 192)
    assert (second.width, second.height) == (0, 0)
    assert not second.HasField("seed") and not second.HasField("guidance_scale")


@pytest.mark.parametrize("kwargs", [{"size": "512"}, {"size": "axb"}, {"output_format": "gif"}])
def test_bad_arguments_fail_before_any_call(fake: FakeServer, kwargs: dict) -> None:
    with Client(fake.address) as client, pytest.raises(ValueError):
        client.generate("p", **kwargs)
    assert fake.servicer.calls == []


def test_api_key_and_request_id_travel_as_metadata(fake: FakeServer) -> None:
    with Client(fake.address, api_key="sk-test") as client:
        client.generate("p", request_id="my-rid")
        client.status()
    assert [c.metadata.get("authorization") for c in fake.servicer.calls] == ["Bearer sk-test"] * 2
    assert fake.servicer.calls[0].metadata.get("x-request-id") == "my-rid"


def test_status_maps_queues_and_workers(fake: FakeServer) -> None:
    with Client(fake.address) as client:
        status = client.status()
    assert (status.pending_ar_requests, status.pending_ar_outputs, status.pending_denoise_outputs,
            status.active_requests) == (1, 2, 3, 4)
    assert [(w.role, w.state, w.inflight, w.current_job) for w in status.workers] == [
        ("ar", "available", 0, ""), ("denoiser", "busy", 1, "req-1/0#1")]


def test_add_and_remove_worker(fake: FakeServer) -> None:
    with Client(fake.address) as client:
        client.add_worker("10.0.0.3:50061", "denoiser")
        client.remove_worker("10.0.0.3:50061")
    add, remove = fake.servicer.calls
    assert (add.request.address, add.request.role) == ("10.0.0.3:50061", gateway_service_pb2.WORKER_ROLE_DENOISER)
    assert remove.request.address == "10.0.0.3:50061"


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED])
def test_retries_transient_codes_then_succeeds(fake: FakeServer, code: grpc.StatusCode) -> None:
    fake.servicer.fail["GenerateImages"] = [code, code]
    with Client(fake.address, retry=FAST_RETRY) as client:
        result = client.generate("p", n=1)
    assert len(result.images) == 1
    assert fake.servicer.methods() == ["GenerateImages"] * 3


def test_gives_up_after_max_attempts(fake: FakeServer) -> None:
    fake.servicer.fail["GetStatus"] = [grpc.StatusCode.UNAVAILABLE] * 10
    retry = RetryPolicy(max_attempts=3, initial_backoff=0.01, max_backoff=0.02)
    with Client(fake.address, retry=retry) as client, pytest.raises(GlmImageError) as err:
        client.status()
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert err.value.attempts == 3
    assert len(fake.servicer.calls) == 3


def test_invalid_argument_is_never_retried(fake: FakeServer) -> None:
    with Client(fake.address, retry=FAST_RETRY) as client, pytest.raises(GlmImageError) as err:
        client.generate("invalid")
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details == "prompt: not allowed"
    assert len(fake.servicer.calls) == 1


def test_other_codes_are_not_retried(fake: FakeServer) -> None:
    fake.servicer.fail["GetStatus"] = [grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAUTHENTICATED]
    with Client(fake.address, retry=FAST_RETRY) as client:
        for expected in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAUTHENTICATED):
            with pytest.raises(GlmImageError) as err:
                client.status()
            assert err.value.code == expected
    assert len(fake.servicer.calls) == 2


def test_deadline_covers_retries(fake: FakeServer) -> None:
    """A backoff that would end after the deadline is not waited for: the caller gets the error at once."""
    fake.servicer.fail["GetStatus"] = [grpc.StatusCode.UNAVAILABLE] * 5
    slow = RetryPolicy(max_attempts=5, initial_backoff=30.0, max_backoff=30.0, jitter=0.0)
    t0 = time.monotonic()
    with Client(fake.address, retry=slow, timeout=5.0) as client, pytest.raises(GlmImageError) as err:
        client.status()
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert len(fake.servicer.calls) == 1
    assert time.monotonic() - t0 < 5.0


def test_timeout_cancels_the_call_on_the_server(fake: FakeServer) -> None:
    with Client(fake.address, retry=FAST_RETRY) as client, pytest.raises(GlmImageError) as err:
        client.generate("block", timeout=0.5)
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert fake.servicer.cancelled.wait(10), "the server never saw the call end"
    assert len(fake.servicer.calls) == 1  # DEADLINE_EXCEEDED is not retried


def test_unreachable_server_is_unavailable_after_retries() -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    retry = RetryPolicy(max_attempts=2, initial_backoff=0.01)
    with Client(address, retry=retry, timeout=10) as client, pytest.raises(GlmImageError) as err:
        client.status()
    assert (err.value.code, err.value.attempts) == (grpc.StatusCode.UNAVAILABLE, 2)


def test_backoff_is_exponential_capped_and_jittered() -> None:
    import random

    exact = RetryPolicy(initial_backoff=0.1, multiplier=2.0, max_backoff=0.5, jitter=0.0)
    assert [exact.backoff(i) for i in range(5)] == pytest.approx([0.1, 0.2, 0.4, 0.5, 0.5])
    jittered = RetryPolicy(initial_backoff=1.0, multiplier=2.0, max_backoff=8.0, jitter=0.5)
    rng = random.Random(0)
    delays = [jittered.backoff(2, rng) for _ in range(200)]
    assert all(2.0 <= d <= 4.0 for d in delays)
    assert max(delays) - min(delays) > 1.0  # actually spread, not a constant


def test_retry_policy_refuses_unsafe_codes() -> None:
    with pytest.raises(ValueError):
        RetryPolicy(codes=frozenset({grpc.StatusCode.INVALID_ARGUMENT}))
    with pytest.raises(ValueError):
        RetryPolicy(max_attempts=0)


# --- streaming -------------------------------------------------------------------------------------------------------


def test_stream_yields_progress_partials_then_completed(fake: FakeServer) -> None:
    with Client(fake.address) as client:
        events = list(client.generate_stream("p", n=2, size="256x256", steps=3, partial_images=2, seed=5))
    progress = [e for e in events if isinstance(e, Progress)]
    partials = [e for e in events if isinstance(e, PartialImage)]
    assert [(p.image_index, p.step, p.total_steps) for p in progress] == [
        (i, s, 3) for i in range(2) for s in (1, 2, 3)]
    assert [(p.image_index, p.partial_image_index) for p in partials] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert isinstance(events[-1], Completed)
    assert events[-1].result.seeds == [5, 6]
    assert sum(isinstance(e, Completed) for e in events) == 1
    req = fake.servicer.calls[0].request
    assert (req.partial_images, req.request.n, req.request.num_inference_steps) == (2, 2, 3)


def test_stream_retries_before_the_first_event(fake: FakeServer) -> None:
    fake.servicer.fail["GenerateImagesStream"] = [grpc.StatusCode.RESOURCE_EXHAUSTED]
    with Client(fake.address, retry=FAST_RETRY) as client:
        events = list(client.generate_stream("p"))
    assert isinstance(events[-1], Completed)
    assert fake.servicer.methods() == ["GenerateImagesStream"] * 2


def test_stream_is_not_retried_after_events_were_seen(fake: FakeServer) -> None:
    seen = []
    with Client(fake.address, retry=FAST_RETRY) as client, pytest.raises(GlmImageError) as err:
        for event in client.generate_stream("midstream"):
            seen.append(event)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert len(seen) == 1 and isinstance(seen[0], Progress)
    assert len(fake.servicer.calls) == 1


def test_leaving_the_stream_early_cancels_it(fake: FakeServer) -> None:
    with Client(fake.address) as client:
        stream = client.generate_stream("block")
        assert isinstance(next(stream), Progress)
        stream.close()
        assert fake.servicer.cancelled.wait(10), "the server never saw the cancellation"


# --- TLS -------------------------------------------------------------------------------------------------------------


def test_tls_with_the_right_ca(tls_server: FakeServer, pki: Pki) -> None:
    with Client(tls_server.address, tls=TlsConfig(root_ca=pki.ca.read_bytes()), api_key="k", retry=NO_RETRY) as client:
        assert client.status().active_requests == 4
    assert tls_server.servicer.calls[-1].metadata["authorization"] == "Bearer k"


def test_tls_rejects_an_unknown_ca(tls_server: FakeServer, pki: Pki) -> None:
    tls = TlsConfig(root_ca=pki.other_ca.read_bytes())
    with Client(tls_server.address, tls=tls, retry=NO_RETRY, timeout=10) as client:
        with pytest.raises(GlmImageError) as err:
            client.status()
    assert err.value.code == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_needs_the_client_certificate(mtls_server: FakeServer, pki: Pki) -> None:
    tls = TlsConfig.from_files(pki.ca, pki.client_cert, pki.client_key)
    with Client(mtls_server.address, tls=tls, retry=NO_RETRY) as client:
        result = client.generate("over mtls", n=2)
    assert len(result.images) == 2
    with Client(mtls_server.address, tls=TlsConfig(root_ca=pki.ca.read_bytes()), retry=NO_RETRY, timeout=10) as client:
        with pytest.raises(GlmImageError) as err:
            client.status()
    assert err.value.code == grpc.StatusCode.UNAVAILABLE


def test_tls_config_needs_cert_and_key_together(pki: Pki) -> None:
    with pytest.raises(ValueError):
        TlsConfig(root_ca=pki.ca.read_bytes(), client_cert=pki.client_cert.read_bytes())


# --- the asyncio client ----------------------------------------------------------------------------------------------


async def test_async_generate_status_and_api_key(fake: FakeServer) -> None:
    async with AsyncClient(fake.address, api_key="sk-async") as client:
        result = await client.generate("a cat", n=2, size=(256, 128), seed=3)
        status = await client.status()
        await client.add_worker("10.0.0.9:50051", "ar")
    assert result.seeds == [3, 4] and (result.width, result.height) == (256, 128)
    assert result.images == [fake_image("a cat", i, 3 + i) for i in range(2)]
    assert status.workers[1].state == "busy"
    assert {c.metadata["authorization"] for c in fake.servicer.calls} == {"Bearer sk-async"}


async def test_async_retries_and_no_retry(fake: FakeServer) -> None:
    fake.servicer.fail["GenerateImages"] = [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED]
    async with AsyncClient(fake.address, retry=FAST_RETRY) as client:
        await client.generate("p")
        assert len(fake.servicer.calls) == 3
        with pytest.raises(GlmImageError) as err:
            await client.generate("invalid")
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert len(fake.servicer.calls) == 4


async def test_async_stream(fake: FakeServer) -> None:
    fake.servicer.fail["GenerateImagesStream"] = [grpc.StatusCode.UNAVAILABLE]
    async with AsyncClient(fake.address, retry=FAST_RETRY) as client:
        events = [e async for e in client.generate_stream("p", n=1, steps=2, partial_images=1)]
    assert [type(e) for e in events] == [Progress, Progress, PartialImage, Completed]
    assert len(fake.servicer.calls) == 2


async def test_async_tls(mtls_server: FakeServer, pki: Pki) -> None:
    tls = TlsConfig(root_ca=pki.ca.read_bytes(), client_cert=pki.client_cert.read_bytes(),
                    client_key=pki.client_key.read_bytes())
    async with AsyncClient(mtls_server.address, tls=tls, retry=NO_RETRY) as client:
        assert (await client.status()).pending_denoise_outputs == 3


# --- packaging -------------------------------------------------------------------------------------------------------


def test_sdk_and_cli_import_without_server_dependencies() -> None:
    heavy = ["torch", "transformers", "diffusers", "fastapi", "numpy", "PIL", "services", "gateway", "rest", "runtime"]
    code = ("import sys, glmimage, glmimage.client, glmimage.cli; "
            f"print([m for m in {heavy!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"
