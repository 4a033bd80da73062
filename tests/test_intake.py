"""Nothing is read before the caller is known, and what is read fits a memory budget (runtime.intake).

The attack: many concurrent calls, each a large message, with no credential (or on a server that needs none).
gRPC Python used to read every message whole before the credential check, so 12 callers of 60 MB held 1.5 GB of
the gateway. Each server is a real process here, and its peak RSS is sampled while the calls run.
"""
from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from bench.receive_flood import AR_BATCH, DENOISE, FLOOD, GENERATE, bearer, flood
from glmimage.v1 import gateway_service_pb2 as pb
from glmimage.v1 import gateway_service_pb2_grpc as pb_grpc
from runtime.auth import ENV_INTERNAL_TOKEN, BearerAuthInterceptor, Role
from runtime.intake import IntakePolicy
from runtime.limits import Limits, max_request_bytes
from runtime.server import start_server
from tests.support.cluster import Cluster

# What the issue allows a server to hold above its idle figure under the flood.
HEADROOM = 300 << 20


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: Path) -> Iterator[dict[str, object]]:
    """A real AR and denoiser requiring an internal token, a gateway with an API key, and one without any key."""
    work = tmp_path_factory.mktemp("intake")
    token, key = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
    (work / "token").write_text(token)
    procs = Cluster(work / "procs")
    env = {ENV_INTERNAL_TOKEN: ""}
    try:
        procs.start("ar", "ar", ["--internal-token-file", str(work / "token")], env=env)
        procs.start("denoiser", "denoiser", ["--internal-token-file", str(work / "token"), "--default-steps", "2"],
                    env=env)
        unreachable = ["--ar", "127.0.0.1:1", "--denoiser", "127.0.0.1:2"]
        procs.start("keyed", "gateway", [*unreachable, f"--api-key={key}"])
        procs.start("open", "gateway", unreachable)
        yield {"procs": procs, "token": token, "key": key}
    finally:
        procs.close()


@pytest.mark.e2e
@pytest.mark.parametrize("name,method", [("keyed", GENERATE), ("ar", AR_BATCH), ("denoiser", DENOISE)])
def test_a_flood_without_credentials_is_refused_unread(servers, name: str, method: str) -> None:
    proc = servers["procs"].procs[name]
    grown, codes = flood(proc.pid, proc.address, method)
    # Malformed bytes too: the credential is checked on the metadata, before anything is decoded.
    assert codes == {grpc.StatusCode.UNAUTHENTICATED}
    assert grown < HEADROOM, f"{name} grew {grown >> 20} MB under the flood"


@pytest.mark.e2e
def test_a_flood_larger_than_any_request_is_refused_from_its_length(servers) -> None:
    """A gateway that needs no key: the 60 MiB message is beyond its largest legitimate request (one edit's
    references), so gRPC refuses it from its length prefix."""
    proc = servers["procs"].procs["open"]
    grown, codes = flood(proc.pid, proc.address, GENERATE)
    assert codes == {grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert grown < HEADROOM, f"grew {grown >> 20} MB"


@pytest.mark.e2e
@pytest.mark.parametrize("name,method,credential", [("open", GENERATE, None), ("keyed", GENERATE, "key"),
                                                    ("ar", AR_BATCH, "token"), ("denoiser", DENOISE, "token")])
def test_a_flood_of_the_largest_admissible_messages_fits_the_budget(servers, name: str, method: str,
                                                                    credential: str | None) -> None:
    """The same flood from a caller the server admits, each message just within its receive limit: read a few at a
    time, never all at once."""
    proc = servers["procs"].procs[name]
    limits = Limits()
    limit = {"open": max_request_bytes(limits), "keyed": max_request_bytes(limits),
             "ar": max_request_bytes(limits, prompts=limits.max_batch_outputs),
             "denoiser": max_request_bytes(limits, tokens=True)}[name]
    payload = FLOOD[:5] + b"a" * (limit - 5)
    metadata = bearer(servers[credential]) if credential else ()
    grown, codes = flood(proc.pid, proc.address, method, payload, metadata)
    assert codes <= {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
    assert grpc.StatusCode.INVALID_ARGUMENT in codes  # read and refused as malformed, not merely turned away
    assert grown < HEADROOM, f"{name} grew {grown >> 20} MB"


# ---- the intake's bounds, in-process ----------------------------------------------------------------------------


class _Echo(pb_grpc.GatewayServiceServicer):
    async def GetLimits(self, request, context):
        return pb.GetLimitsResponse()


async def _server(policy: IntakePolicy, keys: tuple[str, ...] = ()):
    interceptors = [BearerAuthInterceptor([Role("user", keys)], {"/glmimage.v1.GatewayService/": "user"})]
    return await start_server(lambda s: pb_grpc.add_GatewayServiceServicer_to_server(_Echo(), s),
                              ["glmimage.v1.GatewayService"], "127.0.0.1:0", intake=policy,
                              interceptors=interceptors if keys else ())


def _held_open() -> tuple[Callable[[], object], asyncio.Event]:
    """A request stream that sends nothing until the event is set: a caller whose message never arrives."""
    release = asyncio.Event()

    async def requests():
        await release.wait()
        yield pb.GetLimitsRequest().SerializeToString()

    return requests, release


async def test_malformed_bytes_without_a_key_are_unauthenticated() -> None:
    server = await _server(IntakePolicy(1 << 20), keys=("k" * 16,))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            call = channel.unary_unary("/glmimage.v1.GatewayService/GetLimits")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call(b"\xff\xff\xff")
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call(b"\xff\xff\xff", metadata=bearer("k" * 16))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "not a valid GetLimits request" in err.value.details()
    finally:
        await server.stop(0)


async def test_a_caller_finding_no_permit_is_told_to_retry_and_a_stalled_read_ends() -> None:
    """One permit, held by a caller whose message never comes: the next caller gets RESOURCE_EXHAUSTED once it
    waited its turn, the stalled one DEADLINE_EXCEEDED once its read ran out; then calls go through again."""
    policy = IntakePolicy(1 << 20, budget_bytes=1, wait_seconds=0.5, read_seconds=2.0)
    assert policy.permits == 1
    server = await _server(policy)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            requests, release = _held_open()
            stalled = channel.stream_unary("/glmimage.v1.GatewayService/GetLimits")(requests())
            await asyncio.sleep(0)  # let the stalled call reach the server first
            plain = channel.unary_unary("/glmimage.v1.GatewayService/GetLimits",
                                        request_serializer=pb.GetLimitsRequest.SerializeToString,
                                        response_deserializer=pb.GetLimitsResponse.FromString)
            # Until the stalled call holds the permit, a plain call may still go through: wait for a refusal.
            async with asyncio.timeout(30):
                while True:
                    try:
                        await plain(pb.GetLimitsRequest())
                    except grpc.aio.AioRpcError as err:
                        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                        assert "retry" in err.details() and "--" not in err.details()
                        break
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stalled
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            release.set()
            assert await plain(pb.GetLimitsRequest()) == pb.GetLimitsResponse()
    finally:
        await server.stop(0)


def test_each_role_receives_up_to_its_largest_legitimate_request() -> None:
    limits = Limits()
    edit = limits.max_reference_total_bytes
    assert edit < max_request_bytes(limits) < edit + (1 << 20)
    assert max_request_bytes(limits, prompts=32) - max_request_bytes(limits) == 31 * 4 * limits.max_prompt_chars
    # A denoise job carries every reference's tokens as well (5 bytes per id at most).
    assert max_request_bytes(limits, tokens=True) > max_request_bytes(limits) + 5 * limits.max_pixels // 256
    smaller = Limits(max_reference_total_bytes=1 << 20)
    assert max_request_bytes(smaller) < 2 << 20
    assert IntakePolicy(max_request_bytes(limits)).permits == 2  # 256 MiB over three copies of ~32 MiB


def test_the_gateway_admits_no_more_than_it_can_receive() -> None:
    """Workers that raised their reference bounds do not raise the gateway's: it could not receive such a request."""
    from gateway.__main__ import config_from, parse_args
    from runtime.limits import limits_in_force

    own = dict(config_from(parse_args([])).own_limits)
    raised = {"max_reference_total_bytes": 1 << 30, "max_prompt_chars": 100_000}
    admitted = limits_in_force(own, [raised], [raised])
    assert max_request_bytes(admitted) <= max_request_bytes(Limits(**own)) == max_request_bytes(Limits())
    lowered = limits_in_force(own, [{"max_reference_total_bytes": 1 << 20}], [])
    assert lowered.max_reference_total_bytes == 1 << 20  # a tighter worker still wins
