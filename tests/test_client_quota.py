"""Priorities and quotas from the clients' side: the SDK, the CLI and the Node client send ``priority``, and the SDK
reads the gateway's rate-limit metadata back (initial when admitted, trailing with a RetryInfo when refused).

Against a real gRPC server holding the scripted tenant gateway of tests/support/quota_gateway.py; the reading of
the metadata itself is pure (glmimage.ratelimits) and tested on its own below.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from glmimage import AsyncClient, Client, Completed, GlmImageError, RateLimits, RetryPolicy
from glmimage.ratelimits import parse_duration, quota_of, retry_after_of
from glmimage.v1 import gateway_service_pb2
from tests.support.fake_gateway import FakeServer
from tests.support.programs import glmimage, run_node
from tests.support.quota_gateway import LIMITS, QuotaGateway, Refusal, sent_priority, serve_quota_fake

PRIORITY = {"interactive": gateway_service_pb2.PRIORITY_INTERACTIVE, "default": gateway_service_pb2.PRIORITY_DEFAULT,
            "batch": gateway_service_pb2.PRIORITY_BATCH}
FAST_RETRY = RetryPolicy(max_attempts=4, initial_backoff=0.01, max_backoff=0.05)
# LIMITS, as the SDK reads them.
EXPECTED = RateLimits(limit_requests=30, remaining_requests=29, reset_requests=59.0, limit_images=60,
                      remaining_images=59, reset_images=60.0, reset_requests_raw="59s", reset_images_raw="1m0s")
REF = b"\x89PNG\r\n\x1a\nref"


@pytest.fixture(scope="module")
def quota_server() -> Iterator[FakeServer]:
    with serve_quota_fake() as srv:
        yield srv


@pytest.fixture()
def gw(quota_server: FakeServer) -> FakeServer:
    quota_server.servicer.reset()
    return quota_server


def servicer(gw: FakeServer) -> QuotaGateway:
    assert isinstance(gw.servicer, QuotaGateway)
    return gw.servicer


def last_result(value: Any) -> Any:
    """A generation's result: the value itself, or a stream's Completed event's."""
    if isinstance(value, list):
        (completed,) = [e for e in value if isinstance(e, Completed)]
        return completed.result
    return value


# Every generation method of the blocking client, each called with ``priority``.
METHODS: dict[str, Callable[[Client, Any], Any]] = {
    "generate": lambda c, p: c.generate("a cat", priority=p),
    "edit": lambda c, p: c.edit([REF], "a hat", size="64x64", priority=p),
    "generate_stream": lambda c, p: list(c.generate_stream("a cat", priority=p)),
    "edit_stream": lambda c, p: list(c.edit_stream(REF, "a hat", size="64x64", priority=p)),
}


# --- priority ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("name", sorted(PRIORITY))
def test_every_method_sends_each_priority(gw: FakeServer, method: str, name: str) -> None:
    with Client(gw.address) as client:
        METHODS[method](client, name)
        assert sent_priority(gw) == PRIORITY[name]
        METHODS[method](client, PRIORITY[name])  # the proto enum value works as well as the name
        assert sent_priority(gw) == PRIORITY[name]
        METHODS[method](client, None)
    assert sent_priority(gw) == gateway_service_pb2.PRIORITY_UNSPECIFIED


@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("bad", ["urgent", "BATCH", "", 7, -1, True, 1.0])
def test_an_unknown_priority_is_refused_before_any_call(gw: FakeServer, method: str, bad: Any) -> None:
    with Client(gw.address) as client, pytest.raises(ValueError, match="^priority must be one of interactive"):
        METHODS[method](client, bad)
    assert gw.servicer.calls == []


async def test_the_async_client_sends_priority_and_refuses_a_bad_one(gw: FakeServer) -> None:
    async with AsyncClient(gw.address) as client:
        await client.generate("a cat", priority="batch")
        assert sent_priority(gw) == gateway_service_pb2.PRIORITY_BATCH
        await client.edit([REF], "a hat", size="64x64", priority="interactive")
        assert sent_priority(gw) == gateway_service_pb2.PRIORITY_INTERACTIVE
        events = [e async for e in client.generate_stream("a cat", priority="default")]
        assert sent_priority(gw) == gateway_service_pb2.PRIORITY_DEFAULT
        assert last_result(events).rate_limits == EXPECTED
        [e async for e in client.edit_stream(REF, "a hat", size="64x64", priority="batch")]
        assert sent_priority(gw) == gateway_service_pb2.PRIORITY_BATCH
        with pytest.raises(ValueError, match="priority"):
            await client.generate("a cat", priority="soon")
        with pytest.raises(ValueError, match="priority"):
            client.generate_stream("a cat", priority="soon")
    assert len(gw.servicer.calls) == 4


def test_a_priority_above_the_keys_maximum_is_the_gateways_error_naming_priority(gw: FakeServer) -> None:
    servicer(gw).max_priority = gateway_service_pb2.PRIORITY_DEFAULT
    with Client(gw.address, retry=FAST_RETRY) as client:
        with pytest.raises(GlmImageError) as err:
            client.generate("a cat", priority="interactive")
        assert client.generate("a cat", priority="batch").images
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and err.value.details.startswith("priority: ")
    assert (err.value.quota, err.value.retry_after, err.value.rate_limits.empty) == (None, None, True)
    assert len(gw.servicer.calls) == 2  # not retried


# --- rate limits on success --------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", sorted(METHODS))
def test_a_result_carries_the_rate_limits_of_its_call(gw: FakeServer, method: str) -> None:
    with Client(gw.address) as client:
        assert last_result(METHODS[method](client, None)).rate_limits == EXPECTED
        servicer(gw).rate_limits = ()  # a tenant without quotas: nothing reported
        unlimited = last_result(METHODS[method](client, None)).rate_limits
    assert unlimited == RateLimits() and unlimited.empty


async def test_an_async_result_carries_the_rate_limits(gw: FakeServer) -> None:
    servicer(gw).rate_limits = (("x-ratelimit-limit-images", "60"), ("x-ratelimit-remaining-images", "12"))
    async with AsyncClient(gw.address) as client:
        result = await client.generate("a cat", n=2)
    assert result.rate_limits == RateLimits(limit_images=60, remaining_images=12)
    assert len(result.images) == 2


# --- refusals ------------------------------------------------------------------------------------------------------


def test_a_quota_refusal_says_which_quota_when_and_the_limits(gw: FakeServer) -> None:
    servicer(gw).refusals = [Refusal(retry_delay=2.5, retry_after="3")]
    with Client(gw.address, retry=FAST_RETRY, timeout=1.0) as client, pytest.raises(GlmImageError) as err:
        client.generate("a cat")
    e = err.value
    assert e.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (e.quota, e.retry_after, e.attempts) == ("requests_per_minute", 2.5, 1)  # RetryInfo's, not the header's
    assert e.rate_limits == RateLimits(limit_requests=30, remaining_requests=0, reset_requests=12.0,
                                       reset_requests_raw="12s")
    assert len(gw.servicer.calls) == 1  # 2.5 s is past the 1 s deadline: final at once


def test_without_retry_info_the_retry_after_entry_counts(gw: FakeServer) -> None:
    servicer(gw).refusals = [Refusal(quota="images_per_minute", retry_delay=None, retry_after="7")]
    with Client(gw.address, retry=FAST_RETRY, timeout=2.0) as client, pytest.raises(GlmImageError) as err:
        list(client.generate_stream("a cat"))
    assert (err.value.quota, err.value.retry_after) == ("images_per_minute", 7.0)


def test_a_quota_refusal_is_retried_no_earlier_than_it_asks(gw: FakeServer) -> None:
    servicer(gw).refusals = [Refusal(retry_delay=0.3, retry_after="1")]
    with Client(gw.address, retry=FAST_RETRY, timeout=30) as client:
        result = client.generate("a cat")
    first, second = servicer(gw).arrivals
    assert second - first >= 0.3
    assert result.rate_limits == EXPECTED


async def test_the_async_client_honours_retry_after_too(gw: FakeServer) -> None:
    servicer(gw).refusals = [Refusal(retry_delay=0.3), Refusal(retry_delay=30.0)]
    async with AsyncClient(gw.address, retry=FAST_RETRY, timeout=10) as client:
        with pytest.raises(GlmImageError) as err:
            await client.generate("a cat")
    first, second = servicer(gw).arrivals
    assert second - first >= 0.3
    assert (err.value.attempts, err.value.retry_after) == (2, 30.0)  # 30 s is past the 10 s deadline


def test_a_wait_past_max_retry_after_is_final_without_a_deadline(gw: FakeServer) -> None:
    servicer(gw).refusals = [Refusal(retry_delay=5.0)]
    patient = RetryPolicy(max_attempts=4, initial_backoff=0.01, max_retry_after=1.0)
    with Client(gw.address, retry=patient) as client, pytest.raises(GlmImageError) as err:
        client.generate("a cat")
    assert (err.value.attempts, err.value.retry_after) == (1, 5.0)
    with pytest.raises(ValueError, match="max_retry_after"):
        RetryPolicy(max_retry_after=-1)


def test_a_full_queue_is_retried_with_the_usual_backoff(gw: FakeServer) -> None:
    # A busy gateway names no quota and no wait: the policy's own short backoff applies, as before quotas.
    servicer(gw).refusals = [Refusal(quota=None, retry_delay=None, retry_after="", rate_limits=())] * 2
    with Client(gw.address, retry=FAST_RETRY, timeout=30) as client:
        assert client.generate("a cat").images
    assert gw.servicer.methods() == ["GenerateImages"] * 3


# --- the metadata, read (pure) -------------------------------------------------------------------------------------


def test_rate_limits_from_metadata_skip_what_does_not_parse() -> None:
    assert RateLimits.from_metadata(LIMITS) == EXPECTED
    assert RateLimits.from_metadata(None).empty
    odd = RateLimits.from_metadata([("x-ratelimit-limit-requests", "many"), ("x-ratelimit-remaining-requests", "-1"),
                                    ("x-ratelimit-reset-requests", "soon"), ("x-ratelimit-limit-images", " 8 "),
                                    ("grpc-status-details-bin", b"\x00"), ("x-ratelimit-limit-images", "9")])
    assert odd == RateLimits(reset_requests_raw="soon", limit_images=8)


@pytest.mark.parametrize(("text", "seconds"), [("1m0s", 60.0), ("12s", 12.0), ("250ms", 0.25), ("0s", 0.0),
                                               ("1h2m3.5s", 3723.5), ("1.5s", 1.5), ("20us", 2e-5), ("3ns", 3e-9)])
def test_openai_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "12", "s", "1m 0s", "1x", "-1s", "1.s", "1m0", "ms1"])
def test_what_is_no_duration(text: str) -> None:
    assert parse_duration(text) is None


@given(st.integers(0, 10), st.integers(0, 59), st.integers(0, 59), st.integers(0, 999))
def test_durations_as_go_writes_them(hours: int, minutes: int, seconds: int, millis: int) -> None:
    text = (f"{hours}h" if hours else "") + (f"{minutes}m" if hours or minutes else "") + f"{seconds}.{millis:03d}s"
    assert parse_duration(text) == pytest.approx(hours * 3600 + minutes * 60 + seconds + millis / 1000)


def test_retry_after_and_quota_from_trailing_metadata() -> None:
    status = Refusal(retry_delay=0.25, retry_after="1").status()
    assert retry_after_of(status.trailing_metadata) == 0.25
    assert quota_of(status.trailing_metadata) == "requests_per_minute"
    assert retry_after_of([("retry-after", "4")]) == 4.0
    assert retry_after_of([("grpc-status-details-bin", b"\xff\xff"), ("retry-after", "x")]) is None
    assert quota_of([("retry-after", "4")]) is None


# --- the CLI -------------------------------------------------------------------------------------------------------


def test_cli_sends_priority_and_prints_the_rate_limits(gw: FakeServer, tmp_path: Path) -> None:
    done = glmimage("generate", "a cat", "--priority", "batch", "-o", "out", "--address", gw.address, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert sent_priority(gw) == gateway_service_pb2.PRIORITY_BATCH
    assert "rate limits: 29/30 requests left, resets in 59s; 59/60 images left, resets in 1m0s" in done.stdout
    (tmp_path / "ref.png").write_bytes(REF)
    done = glmimage("edit", "ref.png", "-p", "a hat", "--size", "64x64", "--priority", "interactive", "--stream",
                    "--json", "-o", "e", "--address", gw.address, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert sent_priority(gw) == gateway_service_pb2.PRIORITY_INTERACTIVE
    assert json.loads(done.stdout)["rate_limits"]["remaining_images"] == 59
    servicer(gw).rate_limits = ()
    done = glmimage("generate", "a cat", "-o", "plain", "--address", gw.address, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert sent_priority(gw) == gateway_service_pb2.PRIORITY_UNSPECIFIED
    assert "rate limits" not in done.stdout and "usage: " in done.stdout


def test_cli_refuses_an_unknown_priority(gw: FakeServer, tmp_path: Path) -> None:
    for command in (["generate", "a cat"], ["edit", "ref.png", "-p", "a hat"]):
        done = glmimage(*command, "--priority", "urgent", "--address", gw.address, cwd=tmp_path)
        assert done.returncode == 2 and "argument --priority: invalid choice: 'urgent'" in done.stderr
    assert gw.servicer.calls == []


def test_cli_reports_a_quota_refusal(gw: FakeServer, tmp_path: Path) -> None:
    servicer(gw).refusals = [Refusal(retry_delay=12.0)]
    done = glmimage("generate", "a cat", "--timeout", "5", "-o", "out", "--address", gw.address, cwd=tmp_path)
    assert done.returncode == 1
    lines = done.stderr.splitlines()
    assert "glmimage: error: RESOURCE_EXHAUSTED: rate limit reached: requests_per_minute" in lines
    assert "glmimage: quota requests_per_minute reached; retry after 12s" in lines
    assert "glmimage: rate limits: 0/30 requests left, resets in 12s" in lines
    assert len(gw.servicer.calls) == 1


def test_cli_says_when_it_waits_out_a_quota(gw: FakeServer, tmp_path: Path) -> None:
    servicer(gw).refusals = [Refusal(quota="images_per_minute", retry_delay=0.2)]
    done = glmimage("generate", "a cat", "-o", "out", "--address", gw.address, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "RESOURCE_EXHAUSTED (rate limit reached: images_per_minute), quota images_per_minute, retry 1/3 in" \
        in done.stderr
    assert len(gw.servicer.calls) == 2 and (tmp_path / "out" / "image-0.png").exists()


# --- the Node client -----------------------------------------------------------------------------------------------


def test_node_sends_priority_and_reports_the_rate_limits(node: str, gw: FakeServer, tmp_path: Path) -> None:
    done = run_node(node, "--address", gw.address, "--prompt", "a cat", "--priority", "batch",
                    "--out", str(tmp_path / "cat.png"))
    assert done.returncode == 0, done.stderr
    assert sent_priority(gw) == gateway_service_pb2.PRIORITY_BATCH
    assert json.loads(done.stdout)["rate_limits"] == dict(LIMITS)
    servicer(gw).rate_limits = ()
    done = run_node(node, "--address", gw.address, "--prompt", "a cat", "--out", str(tmp_path / "plain.png"))
    assert done.returncode == 0, done.stderr
    assert sent_priority(gw) == gateway_service_pb2.PRIORITY_UNSPECIFIED
    assert "rate_limits" not in json.loads(done.stdout)


def test_node_refuses_an_unknown_priority(node: str, gw: FakeServer) -> None:
    done = run_node(node, "--address", gw.address, "--prompt", "a cat", "--priority", "urgent")
    assert done.returncode == 2
    assert "--priority must be one of interactive, default, batch, got urgent" in done.stderr
    assert gw.servicer.calls == []
