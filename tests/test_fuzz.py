"""Every request field at its extremes, on every RPC of the gateway, the AR and the denoisers.

Real servers on loopback with the tiny model (tests/conftest.py) and a real gateway over them. Whatever a request
holds, its answer must come promptly and be OK or a refusal that names the field (INVALID_ARGUMENT; for the admin
RPCs also their documented refusals): never UNKNOWN, INTERNAL or DEADLINE_EXCEEDED, and never with a Python class
name, a traceback or a worker's address in the message. Nothing may be left behind: after every example no slot is
held without a request, and a normal request succeeds at once.

The strategies start from a valid, cheap request (64x64, one step) and set one to three of its fields to boundary
values (0, 1, max, max+1, undeclared enum values, NaN/inf/denormal floats, empty/huge/control/non-BMP strings), so
every check runs with the rest of the request valid and the valid extremes go all the way through both stages.
Besides these samples, a table sends every numeric field of GenerateImages and GenerateImagesStream at each of its
type's extremes (and, on the wire, as varints too long for its type), one field at a time.
Each gateway example gets a gateway of its own, so a broken one cannot fail the next example. Shrinking is off: a
request that hangs costs a whole deadline per shrinking step, and a model server left harmed would fail every
later candidate alike; instead the assertion names the failing call and every call of its example before it.
GLMIMAGE_FUZZ_SCALE=10 runs ten times the examples.
"""
from __future__ import annotations

import asyncio
import contextlib
import math
import os
import re
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from google.protobuf import text_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor, ServiceDescriptor
from google.protobuf.message import Message
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from glmimage.v1 import ar_service_pb2 as ar_pb
from glmimage.v1 import ar_service_pb2_grpc, common_pb2, denoiser_service_pb2_grpc
from glmimage.v1 import denoiser_service_pb2 as dn_pb
from glmimage.v1 import gateway_service_pb2 as gw_pb
from services.runtime.details import field_violation
from services.runtime.limits import round_up
from tests.support.sim_gateway import ADMIN, Gateway, running_gateway

# Examples hold 100k-character strings on purpose; hypothesis warns when it builds their repr.
pytestmark = pytest.mark.filterwarnings("ignore:Generating overly large repr")

OK, INVALID = grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT
# Refusals the admin RPCs may also answer with (auth, or a conflict with the current membership).
ADMIN_REFUSALS = frozenset({OK, INVALID, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED,
                            grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.NOT_FOUND})
CALL_TIMEOUT = 10.0  # every call's deadline: a call that runs into it has hung
PROMPT_REFUSAL = 3.0  # a refusal must come well inside that
SETTLE_TIMEOUT = 5.0  # a cancelled job may still finish its step; a slot held past this is leaked

U32 = 2**32 - 1
I32_MIN, I32_MAX = -(2**31), 2**31 - 1
NAN, INF = math.nan, math.inf
FLOAT32_MAX, FLOAT32_TINY = 3.4028235e38, 1e-45  # the largest float32, and its smallest denormal

# A deeper search on demand; the default keeps the file quick (about 30 s on 2 cores).
SCALE = float(os.environ.get("GLMIMAGE_FUZZ_SCALE", "1"))


def examples(n: int) -> int:
    return max(1, round(n * SCALE))


FUZZ = settings(deadline=None, phases=(Phase.explicit, Phase.reuse, Phase.generate),
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large, HealthCheck.large_base_example])

# ---- boundary values ------------------------------------------------------------------------------------------

# 0, 1, both sides of a multiple of 32, past the 2048x2048 pixel budget on one side, and the sizes that no longer
# fit uint32 once rounded up to a multiple of 32 (2**32 - 31 and above).
SIZES = [0, 1, 31, 32, 33, 2049, 2**31, 2**32 - 32, 2**32 - 31, U32]
SEEDS = [0, 1, U32 - 1, U32]
ENUM_VALUES = [0, 1, 2, 3, 4, -1, I32_MAX, I32_MIN]  # 0-3 are declared in ImageFormat; proto3 enums are open
COMPRESSIONS = [0, 1, 100, 101, U32]
STEPS = [0, 1, 2, 201, U32]  # 0: the server default; 200 is the maximum (too slow to fuzz: see the denoiser tests)
PARTIAL_IMAGES = [0, 1, 3, 4, U32]
TEMPERATURES = [NAN, INF, -INF, 0.0, -0.0, FLOAT32_TINY, -1.0, 1.0, 2.0, 2.0000002, FLOAT32_MAX]
TOP_PS = [NAN, INF, -INF, 0.0, FLOAT32_TINY, 0.5, 1.0, 1.0000001, -1.0, FLOAT32_MAX]
TOP_KS = [0, 1, 50, 1_000_000, 1_000_001, 2**31, U32]
GUIDANCES = [NAN, INF, -INF, 0.0, -0.0, FLOAT32_TINY, -FLOAT32_TINY, 1.5, 30.0, 30.000002, -1.0, FLOAT32_MAX]
PROMPTS = st.one_of(st.sampled_from([
    "", " ", "\t\n\r\x0b\x0c", "\x00", "\x01\x07\x1b\x7f", "\u200b\ufeff", "\U0001F600", "e\u0301\U00010348\U000E0041",
    '"\x00"', '"' + "\U0001F600" * 8 + '"', "x" * 8193, "x" * 100_000, "\U0001F600" * 100_000,
]), st.text(max_size=16))
REQUEST_IDS = st.sampled_from(["", "\x00", "\U0001F600", "a,b", "r" * 100_000])
# Token ids around the tiny codebook (128) and the real one (16384), and the int32 extremes.
TOKEN_IDS = [0, 1, 127, 128, 16383, 16384, I32_MAX, -1, I32_MIN]


@st.composite
def sampling_params(draw: st.DrawFn) -> common_pb2.SamplingParams:
    pools = {"temperature": TEMPERATURES, "top_p": TOP_PS, "top_k": TOP_KS}
    chosen = draw(st.lists(st.sampled_from(sorted(pools)), max_size=3, unique=True))
    return common_pb2.SamplingParams(**{name: draw(st.sampled_from(pools[name])) for name in chosen})


@st.composite
def mutated(draw: st.DrawFn, message: type[Message], base: dict[str, Any], pools: dict[str, Any]) -> Message:
    """`base` with one to three of its fields set from their pools."""
    names = draw(st.lists(st.sampled_from(sorted(pools)), min_size=1, max_size=3, unique=True))
    return message(**{**base, **{name: draw(pools[name]) for name in names}})


IMAGE_BASE = {"prompt": "fuzz", "height": 64, "width": 64, "num_inference_steps": 1, "seed": 1}
IMAGE_FIELDS = {
    "prompt": PROMPTS, "n": st.sampled_from([0, 1, 2, 11, U32]),  # 10, the maximum, is an explicit example
    "height": st.sampled_from(SIZES), "width": st.sampled_from(SIZES),
    "output_format": st.sampled_from(ENUM_VALUES), "output_compression": st.sampled_from(COMPRESSIONS),
    "num_inference_steps": st.sampled_from(STEPS), "guidance_scale": st.sampled_from(GUIDANCES),
    "seed": st.sampled_from(SEEDS), "sampling": sampling_params(), "request_id": REQUEST_IDS,
}
IMAGE_REQUESTS = mutated(gw_pb.GenerateImagesRequest, IMAGE_BASE, IMAGE_FIELDS)
STREAM_REQUESTS = st.one_of(
    st.builds(gw_pb.GenerateImagesStreamRequest, request=IMAGE_REQUESTS),
    st.builds(gw_pb.GenerateImagesStreamRequest, request=st.just(gw_pb.GenerateImagesRequest(**IMAGE_BASE)),
              partial_images=st.sampled_from(PARTIAL_IMAGES)),
    st.builds(gw_pb.GenerateImagesStreamRequest, request=IMAGE_REQUESTS,
              partial_images=st.sampled_from(PARTIAL_IMAGES)),
)

AR_BASE = {"prompt": "fuzz", "height": 64, "width": 64, "seed": 1}
AR_FIELDS = {
    "prompt": PROMPTS, "n": st.sampled_from([0, 1, 2, 17, U32]),  # 16, the maximum, is an explicit example
    "height": st.sampled_from(SIZES), "width": st.sampled_from(SIZES), "seed": st.sampled_from(SEEDS),
    "sampling": sampling_params(), "request_id": REQUEST_IDS,
}
AR_REQUESTS = mutated(ar_pb.GenerateRequest, AR_BASE, AR_FIELDS)
AR_BATCHES = st.builds(ar_pb.GenerateBatchRequest, requests=st.lists(
    st.one_of(st.just(ar_pb.GenerateRequest(**AR_BASE)), AR_REQUESTS), max_size=3))

DENOISE_BASE = {"prompt": "fuzz", "height": 64, "width": 64, "num_inference_steps": 1, "seed": 1}
DENOISE_FIELDS = {
    "prompt": PROMPTS, "height": st.sampled_from(SIZES), "width": st.sampled_from(SIZES),
    "num_inference_steps": st.sampled_from(STEPS), "guidance_scale": st.sampled_from(GUIDANCES),
    "seed": st.sampled_from(SEEDS), "output_format": st.sampled_from(ENUM_VALUES),
    "output_compression": st.sampled_from(COMPRESSIONS), "request_id": REQUEST_IDS,
    "prior_tokens": st.just(common_pb2.TokenRow()),  # only marks the field as chosen: filled in below
}


def fitting_tokens(height: int, width: int) -> int:
    """How many prior tokens a size takes; 16 where the size itself is refused first."""
    h, w = round_up(height), round_up(width)
    return (h // 16) * (w // 16) if height and width and h * w <= 2048 * 2048 else 16


@st.composite
def denoise_requests(draw: st.DrawFn) -> dn_pb.DenoiseRequest:
    job = draw(mutated(dn_pb.DenoiseRequest, DENOISE_BASE, DENOISE_FIELDS))
    ids = [0] * fitting_tokens(job.height, job.width)
    if job.HasField("prior_tokens"):  # chosen: a wrong length, or one id at a boundary
        length = draw(st.sampled_from(["fit", "empty", "one short", "one long", "huge"]))
        ids = {"fit": ids, "empty": [], "one short": ids[1:], "one long": [*ids, 0], "huge": [0] * 100_000}[length]
        if ids:
            ids[draw(st.sampled_from([0, -1]))] = draw(st.sampled_from(TOKEN_IDS))
    job.prior_tokens.CopyFrom(common_pb2.TokenRow(token_ids=ids))
    return job


DENOISE_REQUESTS = denoise_requests()
DENOISE_STREAM_REQUESTS = st.one_of(
    st.builds(dn_pb.DenoiseStreamRequest, job=DENOISE_REQUESTS),
    st.builds(dn_pb.DenoiseStreamRequest, job=st.just(dn_pb.DenoiseRequest(
        **{**DENOISE_BASE, "num_inference_steps": 2}, prior_tokens=common_pb2.TokenRow(token_ids=[0] * 16))),
        partial_images=st.sampled_from(PARTIAL_IMAGES)),
    st.builds(dn_pb.DenoiseStreamRequest, job=DENOISE_REQUESTS, partial_images=st.sampled_from(PARTIAL_IMAGES)),
)

# Worker addresses: malformed, unresolvable, huge, non-ASCII, control characters; "<ar>"/"<denoiser>" stand for the
# gateway's real workers (known only at run time).
ADDRESSES = st.one_of(
    st.sampled_from([
        "", ":", ":1", "host", "host:", "host:0", "host:1", "host:65535", "host:65536", "host:-1", "host:+1",
        "host:99999999999999999999", "[::1]:1", "::1:1", "[::1]", "[]:1", "h ost:1", " host:1 ", "\x00:1", "h\x00st:1",
        "host:1\x00", "\x7f:1", "ü:1", "\U0001F600:1", "x" * 100_000 + ":1", ":" * 1000, "unix:/tmp/socket",
        "dns:///host:1", "ipv4:127.0.0.1:1",
    ]),
    st.text(max_size=24),
    st.builds("{}:{}".format, st.text(max_size=12), st.sampled_from([0, 1, 65535, 65536])),
)
ROLES = st.sampled_from([0, 1, 2, 3, -1, I32_MAX, I32_MIN])
ADMIN_OPS = st.lists(st.one_of(
    st.tuples(st.just("add"), st.one_of(ADDRESSES, st.sampled_from(["<ar>", "<denoiser>"])), ROLES),
    st.tuples(st.just("remove"), ADDRESSES, st.just(0)),
), min_size=1, max_size=4)


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


@st.composite
def unknown_fields(draw: st.DrawFn) -> bytes:
    """Well-formed protobuf wire data made only of fields GetStatusRequest does not have."""
    out = b""
    for _ in range(draw(st.integers(0, 4))):
        number = draw(st.one_of(st.sampled_from([1, 2, 15, 16, 2047, 2**29 - 1]), st.integers(1, 2**29 - 1)))
        wire = draw(st.sampled_from([0, 1, 2, 5]))
        if wire == 0:
            body = varint(draw(st.sampled_from([0, 1, 2**63 - 1, 2**64 - 1])))
        elif wire == 2:
            data = draw(st.binary(max_size=64))
            body = varint(len(data)) + data
        else:
            body = draw(st.binary(min_size=8 if wire == 1 else 4, max_size=8 if wire == 1 else 4))
        out += varint(number << 3 | wire) + body
    return out


# Bytes that are not a valid protobuf of any message: a varint that never ends, a length past the end, field
# number 0, an unterminated group.
GARBAGE = [b"\xff" * 11, b"\x0a\x05ab", b"\x00", b"\x0b"]


def bad_utf8(message: Descriptor) -> bytes | None:
    """Invalid UTF-8 in the first string field reached through field 1, if there is one."""
    first = message.fields_by_number.get(1)
    if first is None:
        return None
    if first.type == FieldDescriptor.TYPE_STRING:
        return b"\x0a\x02\xff\xfe"
    if first.type == FieldDescriptor.TYPE_MESSAGE and (inner := bad_utf8(first.message_type)) is not None:
        return b"\x0a" + varint(len(inner)) + inner
    return None


# ---- answers and what they must look like ---------------------------------------------------------------------


@dataclass
class Answer:
    code: grpc.StatusCode
    details: str
    seconds: float
    replies: list[Any] = field(default_factory=list)


async def unary(call: Awaitable[Any]) -> Answer:
    t0 = time.monotonic()
    try:
        reply = await call
    except grpc.aio.AioRpcError as err:
        return Answer(err.code(), err.details() or "", time.monotonic() - t0)
    return Answer(OK, "", time.monotonic() - t0, [reply])


async def streamed(call: AsyncIterator[Any]) -> Answer:
    t0, replies = time.monotonic(), []
    try:
        async for reply in call:
            replies.append(reply)
    except grpc.aio.AioRpcError as err:
        return Answer(err.code(), err.details() or "", time.monotonic() - t0, replies)
    return Answer(OK, "", time.monotonic() - t0, replies)


def describe(value: Any, limit: int = 48) -> str:
    """A message (or raw bytes) in one line, long strings and lists shortened."""
    if isinstance(value, bytes):
        return f"raw {value[:limit]!r}" + (f"+{len(value) - limit} bytes" if len(value) > limit else "")
    if isinstance(value, Message):
        parts = []
        for fd, v in value.ListFields():
            if fd.is_repeated:
                items = [describe(i) for i in list(v)[:4]]
                parts.append(f"{fd.name}=[{', '.join(items)}{f', ... {len(v)} in all' if len(v) > 4 else ''}]")
            else:
                parts.append(f"{fd.name}={describe(v)}")
        return "{" + " ".join(parts) + "}"
    if isinstance(value, str) and len(value) > limit:
        return f"{value[:limit]!r}+{len(value) - limit} chars"
    return repr(value)


def field_names(message: Descriptor, seen: set[str] | None = None) -> set[str]:
    """Every field name of a message and of the messages inside it."""
    seen = set() if seen is None else seen
    names = set()
    if message.full_name in seen:
        return names
    seen.add(message.full_name)
    for fd in message.fields:
        names.add(fd.name)
        if fd.message_type is not None:
            names |= field_names(fd.message_type, seen)
    return names


FIELD_PATH = re.compile(r"([a-z_]+(?:\[\d+\])?(?:\.[a-z_]+(?:\[\d+\])?)*): ")


def names_a_field(details: str, message: Descriptor) -> bool:
    """The message starts with a field path of the request ("requests[1].sampling.top_p: ...")."""
    match = FIELD_PATH.match(details)
    if match is None:
        return False
    return all(re.sub(r"\[\d+\]$", "", part) in field_names(message) for part in match.group(1).split("."))


class Trail(list[str]):
    """The calls of one example so far, and their answers: a failure shows what came before it."""

    def __str__(self) -> str:
        return "".join(f"\n  earlier in this example, call {i}: {said}" for i, said in enumerate(self, 1))


def check(answer: Answer, call: str, request_type: Descriptor | None, *,
          allowed: frozenset[grpc.StatusCode] = frozenset({OK, INVALID}), hidden: tuple[str, ...] = (),
          trail: Trail | None = None) -> None:
    """The rules for any answer; `hidden`: addresses of workers, which a caller must not see."""
    said = f"{call} -> {answer.code.name} {answer.details[:400]!r} after {answer.seconds:.2f}s"
    context = said + str(trail or "")
    assert answer.code in allowed, context
    assert not any(marker in answer.details for marker in ("<class", "Error'>", "Traceback")), context
    assert not any(address in answer.details for address in hidden), f"names a worker's address: {context}"
    if answer.code == INVALID and request_type is not None:
        assert names_a_field(answer.details, request_type), f"does not start with a field of the request: {context}"
    if trail is not None:
        trail.append(said)


def address(server) -> str:
    return f"127.0.0.1:{server.port}"


# ---- the gateway ----------------------------------------------------------------------------------------------

NORMAL_IMAGE = gw_pb.GenerateImagesRequest(prompt='a "fuzz" test', height=64, width=64, num_inference_steps=1, seed=7)


@dataclass
class FuzzGateway:
    gw: Gateway
    members: dict[str, int]  # address -> WorkerRole of the real AR and denoisers it started with

    @property
    def stub(self):
        return self.gw.stub

    def hidden(self, request_text: str = "") -> tuple[str, ...]:
        return tuple(a for a in self.members if a not in request_text)


Workers = tuple[list[str], list[str]]  # the addresses of the real AR, and of the real denoisers


@pytest.fixture
def workers(ar_server, denoiser_server, second_denoiser_server) -> Workers:
    return [address(ar_server)], [address(denoiser_server), address(second_denoiser_server)]


@contextlib.asynccontextmanager
async def fresh_gateway(workers: Workers) -> AsyncIterator[FuzzGateway]:
    """A gateway of its own for one example over the shared model servers: an example that breaks it fails
    alone, and hypothesis, which replays a failing example to report it, sees that example fail, not the next."""
    async with running_gateway(*workers, max_queued_outputs=64) as gw:
        yield FuzzGateway(gw, {w.address: w.role for w in (await gw.status()).workers})


@pytest.fixture
async def gateway(workers: Workers) -> AsyncIterator[FuzzGateway]:
    async with fresh_gateway(workers) as gateway:
        yield gateway


async def check_gateway(gateway: FuzzGateway, answer: Answer, call: str, request_type: Descriptor, trail: Trail, *,
                        allowed: frozenset[grpc.StatusCode] = frozenset({OK, INVALID}), request_text: str = ""
                        ) -> None:
    """check() for a gateway answer; a failure also shows the gateway's state right after it."""
    try:
        check(answer, call, request_type, allowed=allowed, hidden=gateway.hidden(request_text), trail=trail)
    except AssertionError as exc:
        status = text_format.MessageToString(await gateway.gw.status(), as_one_line=True)
        raise AssertionError(f"{exc}\n  GetStatus then: {status}") from None


def leftovers(status: gw_pb.GetStatusResponse, members: dict[str, int]) -> list[str]:
    """What a gateway with no request in flight still holds, or what its workers lost."""
    out = []
    if status.active_requests or status.pending_ar_requests or status.pending_ar_outputs:
        out.append(f"active_requests={status.active_requests} pending_ar_requests={status.pending_ar_requests}")
    if status.pending_denoise_outputs:
        out.append(f"pending_denoise_outputs={status.pending_denoise_outputs}")
    for w in status.workers:
        name = gw_pb.WorkerState.Name(w.state)
        if w.inflight or w.current_job:
            out.append(f"{w.address} {name} inflight={w.inflight} current_job={w.current_job!r}")
        if w.address not in members:
            out.append(f"an added worker is still a member: {describe(w.address)} {name}")
        elif w.state != gw_pb.WORKER_STATE_AVAILABLE:
            out.append(f"{w.address} is {name}")
    if {w.address for w in status.workers} != set(members):
        out.append(f"members {sorted(w.address for w in status.workers)} instead of {sorted(members)}")
    return out


async def settled(gateway: FuzzGateway, trail: Trail) -> None:
    """Wait (briefly) until no request is in flight and no slot is held; fail naming what is still held."""
    deadline = time.monotonic() + SETTLE_TIMEOUT
    while held := leftovers(await gateway.gw.status(), gateway.members):
        if time.monotonic() > deadline:
            status = text_format.MessageToString(await gateway.gw.status(), as_one_line=True)
            pytest.fail(f"held without a request after {SETTLE_TIMEOUT}s: {held}; GetStatus: {status}{trail}")
        await asyncio.sleep(0.01)


async def assert_gateway_recovered(gateway: FuzzGateway, trail: Trail) -> None:
    """Nothing left held, a normal request succeeds at once, and nothing is held after it either."""
    await settled(gateway, trail)
    answer = await unary(gateway.stub.GenerateImages(NORMAL_IMAGE, timeout=CALL_TIMEOUT))
    assert answer.code == OK, f"a normal request afterwards: {answer.code.name} {answer.details!r}{trail}"
    assert len(answer.replies[0].images) == 1
    await settled(gateway, trail)


# Finding 1 of the hardening issue: rounded up to a multiple of 32, these sizes no longer fit uint32.
@pytest.mark.parametrize("height, width", [(U32, U32), (U32, 64), (64, U32), (2**32 - 31, 64), (2**32 - 32, 64)])
async def test_a_size_past_uint32_when_rounded_up_is_refused_at_once_and_holds_no_slot(
        gateway: FuzzGateway, height: int, width: int) -> None:
    trail = Trail()
    request = gw_pb.GenerateImagesRequest(prompt="x", height=height, width=width)
    answer = await unary(gateway.stub.GenerateImages(request, timeout=CALL_TIMEOUT))
    call = f"GenerateImages({describe(request)})"
    await check_gateway(gateway, answer, call, request.DESCRIPTOR, trail, allowed=frozenset({INVALID}))
    fields = {"height"} if height > width else {"width"} if width > height else {"height", "width"}
    assert answer.details.split(":", 1)[0] in fields, f"{call} -> {answer.details!r}"
    assert answer.seconds < PROMPT_REFUSAL, f"{call} took {answer.seconds:.2f}s"
    await assert_gateway_recovered(gateway, trail)


@settings(FUZZ, max_examples=examples(6))
@given(batch=st.lists(IMAGE_REQUESTS, min_size=1, max_size=3))
@example(batch=[gw_pb.GenerateImagesRequest(prompt="x", height=2048, width=2049),  # one past the pixel budget
                gw_pb.GenerateImagesRequest(**{**IMAGE_BASE, "n": 10, "seed": U32})])  # max n, seeds wrap
async def test_fuzz_generate_images(workers: Workers, batch: list[gw_pb.GenerateImagesRequest]) -> None:
    async with fresh_gateway(workers) as gateway:
        trail = Trail()
        for request in batch:
            answer = await unary(gateway.stub.GenerateImages(request, timeout=CALL_TIMEOUT))
            await check_gateway(gateway, answer, f"GenerateImages({describe(request)})", request.DESCRIPTOR, trail)
            if answer.code == OK:
                assert len(answer.replies[0].images) == (request.n or 1)
        await assert_gateway_recovered(gateway, trail)


@settings(FUZZ, max_examples=examples(5))
@given(batch=st.lists(STREAM_REQUESTS, min_size=1, max_size=3))
@example(batch=[gw_pb.GenerateImagesStreamRequest(  # finding 1 on the streaming path
    request=gw_pb.GenerateImagesRequest(prompt="x", height=64, width=U32), partial_images=1)])
async def test_fuzz_generate_images_stream(workers: Workers, batch: list[gw_pb.GenerateImagesStreamRequest]
                                           ) -> None:
    async with fresh_gateway(workers) as gateway:
        trail = Trail()
        for request in batch:
            answer = await streamed(gateway.stub.GenerateImagesStream(request, timeout=CALL_TIMEOUT))
            call = f"GenerateImagesStream({describe(request)})"
            await check_gateway(gateway, answer, call, request.DESCRIPTOR, trail)
            if answer.code == OK:
                *events, last = answer.replies
                assert last.WhichOneof("event") == "completed"
                assert len(last.completed.images) == (request.request.n or 1)
                partials = [e for e in events if e.WhichOneof("event") == "partial_image"]
                assert len(partials) <= request.partial_images * len(last.completed.images)
        await assert_gateway_recovered(gateway, trail)


# ---- every numeric field at its type's extremes, all of them, not a sample --------------------------------------

# What each numeric proto type of a generation request can hold at its ends (0 and 1 are in the pools above).
TYPE_EXTREMES: dict[int, list[Any]] = {
    FieldDescriptor.TYPE_UINT32: [2**31, U32],
    FieldDescriptor.TYPE_ENUM: [I32_MIN, -1, I32_MAX],
    FieldDescriptor.TYPE_FLOAT: [NAN, INF, -INF, FLOAT32_MAX, -FLOAT32_MAX],
}
VARINT_TYPES = (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_ENUM)
# Varints no typed client would send for a 32-bit field: the parser keeps the low 32 bits (2**32 -> 0).
WIRE_VARINTS = [2**32, 2**63, 2**64 - 1]
NUMERIC_TYPES = frozenset(TYPE_EXTREMES) | {FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_INT32,
                                            FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_DOUBLE}


def numeric_fields(message: Descriptor, prefix: str = "") -> list[tuple[str, FieldDescriptor]]:
    """(path, field) of every numeric field of ``message`` and of the messages inside it, repeated ones aside (an
    edit's references hold bytes only)."""
    out = []
    for fd in message.fields:
        if fd.is_repeated:
            continue
        if fd.type == FieldDescriptor.TYPE_MESSAGE:
            out += numeric_fields(fd.message_type, f"{prefix}{fd.name}.")
        elif fd.type in NUMERIC_TYPES:
            out.append((f"{prefix}{fd.name}", fd))
    return out


def with_value(message: Message, path: str, value: Any) -> Message:
    """A copy of ``message`` with the field at ``path`` ("sampling.top_k") set to ``value``."""
    out = type(message)()
    out.CopyFrom(message)
    *outer, name = path.split(".")
    inner = out
    for part in outer:
        inner = getattr(inner, part)
    setattr(inner, name, value)
    return out


def wire_varint(message: Message, path: str, value: int) -> bytes:
    """``message``'s bytes followed by ``value`` as the varint of the field at ``path`` (the last one wins, and a
    nested message's fields merge), as only a hand-made client would send it."""
    descriptor, numbers = message.DESCRIPTOR, []
    for part in path.split("."):
        fd = descriptor.fields_by_name[part]
        numbers.append(fd.number)
        descriptor = fd.message_type
    data = varint(numbers[-1] << 3) + varint(value)
    for number in reversed(numbers[:-1]):
        data = varint(number << 3 | 2) + varint(len(data)) + data
    return message.SerializeToString() + data


@dataclass
class Case:
    call: str
    path: str  # the field as the refusal must name it
    answer: Answer
    violation: tuple[str, str] | None


async def answer_of(call: Any, streaming: bool) -> tuple[Answer, tuple[str, str] | None]:
    """The answer, and the first field violation of the rich status of a refusal."""
    t0, replies = time.monotonic(), []
    try:
        if streaming:
            async for reply in call:
                replies.append(reply)
        else:
            replies.append(await call)
    except grpc.aio.AioRpcError as err:
        return Answer(err.code(), err.details() or "", time.monotonic() - t0, replies), field_violation(err)
    return Answer(OK, "", time.monotonic() - t0, replies), None


def judge(cases: list[Case], hidden: tuple[str, ...]) -> list[str]:
    """What is wrong with each answer: anything but OK or INVALID_ARGUMENT whose field violation names the field."""
    failures = []
    for case in cases:
        said = f"{case.call} -> {case.answer.code.name} {case.answer.details[:200]!r}"
        try:
            check(case.answer, case.call, None, hidden=hidden)
        except AssertionError:
            failures.append(said)
            continue
        if case.answer.code == INVALID and (case.violation is None or case.violation[0] != case.path
                                            or not case.answer.details.startswith(f"{case.path}: ")):
            failures.append(f"{said}: field violation {case.violation}, not {case.path!r}")
    return failures


def test_the_table_covers_every_numeric_field() -> None:
    paths = {path: fd.type for path, fd in numeric_fields(gw_pb.GenerateImagesStreamRequest.DESCRIPTOR)}
    assert set(paths.values()) <= set(TYPE_EXTREMES), "a numeric type without extremes in TYPE_EXTREMES"
    assert set(paths) == {"partial_images", *(f"request.{f}" for f in (
        "n", "height", "width", "output_format", "output_compression", "num_inference_steps", "guidance_scale",
        "seed", "sampling.temperature", "sampling.top_p", "sampling.top_k"))}


async def test_every_numeric_field_of_generate_images_at_its_type_extremes(gateway: FuzzGateway) -> None:
    """Each numeric field, one at a time, at its type's extremes, typed and as over-long varints on the wire:
    OK, or INVALID_ARGUMENT whose field violation names it; never INTERNAL or UNKNOWN."""
    base, trail = gw_pb.GenerateImagesRequest(**IMAGE_BASE), Trail()
    raw = gateway.gw.channel.unary_unary("/glmimage.v1.GatewayService/GenerateImages",
                                         request_serializer=lambda b: b, response_deserializer=lambda b: b)
    cases = []
    for path, fd in numeric_fields(base.DESCRIPTOR):
        for value in TYPE_EXTREMES[fd.type]:
            request = with_value(base, path, value)
            answer, violation = await answer_of(gateway.stub.GenerateImages(request, timeout=CALL_TIMEOUT), False)
            cases.append(Case(f"GenerateImages({describe(request)})", path, answer, violation))
            if answer.code == OK:
                assert len(answer.replies[0].images) == (request.n or 1)
        for value in WIRE_VARINTS if fd.type in VARINT_TYPES else ():
            answer, violation = await answer_of(raw(wire_varint(base, path, value), timeout=CALL_TIMEOUT), False)
            cases.append(Case(f"GenerateImages(base with {path} as the varint {value})", path, answer, violation))
    failures = judge(cases, gateway.hidden())
    assert not failures, "\n".join(failures)
    assert {case.answer.code for case in cases} == {OK, INVALID}  # some extremes are valid (seed), most are not
    await assert_gateway_recovered(gateway, trail)


async def test_every_numeric_field_of_generate_images_stream_at_its_type_extremes(gateway: FuzzGateway) -> None:
    base, trail = gw_pb.GenerateImagesStreamRequest(request=gw_pb.GenerateImagesRequest(**IMAGE_BASE)), Trail()
    cases = []
    for path, fd in numeric_fields(base.DESCRIPTOR):
        named = path.removeprefix("request.")  # the gateway names the generation's fields as on GenerateImages
        for value in TYPE_EXTREMES[fd.type]:
            request = with_value(base, path, value)
            answer, violation = await answer_of(gateway.stub.GenerateImagesStream(request, timeout=CALL_TIMEOUT),
                                                True)
            cases.append(Case(f"GenerateImagesStream({describe(request)})", named, answer, violation))
            if answer.code == OK:
                assert answer.replies[-1].WhichOneof("event") == "completed"
    failures = judge(cases, gateway.hidden())
    assert not failures, "\n".join(failures)
    assert {case.answer.code for case in cases} == {OK, INVALID}  # some extremes are valid (seed), most are not
    await assert_gateway_recovered(gateway, trail)


@settings(FUZZ, max_examples=examples(40))
@given(payload=unknown_fields())
async def test_fuzz_get_status_ignores_unknown_fields(gateway: FuzzGateway, payload: bytes) -> None:
    trail = Trail()
    method = gateway.gw.channel.unary_unary("/glmimage.v1.GatewayService/GetStatus",
                                            request_serializer=lambda b: b, response_deserializer=lambda b: b)
    # With the admin key: the addresses are the admin role's to see.
    answer = await unary(method(payload, timeout=CALL_TIMEOUT, metadata=ADMIN))
    check(answer, f"GetStatus({describe(payload)})", None, allowed=frozenset({OK}), trail=trail)
    status = gw_pb.GetStatusResponse.FromString(answer.replies[0])
    assert {w.address for w in status.workers} == set(gateway.members)


@settings(FUZZ, max_examples=examples(6))
@given(ops=ADMIN_OPS)
async def test_fuzz_add_and_remove_worker(workers: Workers, ops: list[tuple[str, str, int]]) -> None:
    async with fresh_gateway(workers) as gateway:
        trail = Trail()
        real = {"<ar>": next(a for a, r in gateway.members.items() if r == gw_pb.WORKER_ROLE_AR),
                "<denoiser>": next(a for a, r in gateway.members.items() if r == gw_pb.WORKER_ROLE_DENOISER)}
        for op, addr, role in ops:
            addr = real.get(addr, addr)
            if op == "remove":
                if addr.strip() in gateway.members:
                    continue  # draining a real worker is not what this fuzz is about
                request = gw_pb.RemoveWorkerRequest(address=addr)
                answer = await unary(gateway.stub.RemoveWorker(request, timeout=CALL_TIMEOUT, metadata=ADMIN))
                await check_gateway(gateway, answer, f"RemoveWorker({describe(request)})", request.DESCRIPTOR, trail,
                                    allowed=ADMIN_REFUSALS - {OK}, request_text=addr)
                continue
            request = gw_pb.AddWorkerRequest(address=addr, role=role)
            answer = await unary(gateway.stub.AddWorker(request, timeout=CALL_TIMEOUT, metadata=ADMIN))
            call = f"AddWorker({describe(request)})"
            await check_gateway(gateway, answer, call, request.DESCRIPTOR, trail, allowed=ADMIN_REFUSALS,
                                request_text=addr)
            if addr.strip() in gateway.members:
                if role in (gw_pb.WORKER_ROLE_AR, gw_pb.WORKER_ROLE_DENOISER):
                    # The same worker in its own role again changes nothing; in the other role it is a conflict.
                    same = gateway.members[addr.strip()] == role
                    assert answer.code == (OK if same else grpc.StatusCode.ALREADY_EXISTS), f"{call}{trail}"
            elif answer.code == OK:  # a new (unreachable) worker: remove it again, which must work
                removal = gw_pb.RemoveWorkerRequest(address=addr)
                removed = await unary(gateway.stub.RemoveWorker(removal, timeout=CALL_TIMEOUT, metadata=ADMIN))
                await check_gateway(gateway, removed, f"{call} then RemoveWorker", removal.DESCRIPTOR, trail,
                                    allowed=frozenset({OK}), request_text=addr)
        await assert_gateway_recovered(gateway, trail)


# ---- the AR ---------------------------------------------------------------------------------------------------

NORMAL_PRIOR = ar_pb.GenerateRequest(prompt='a "fuzz" test', height=64, width=64, seed=7)


@dataclass
class Worker:
    stub: Any
    channel: grpc.aio.Channel
    server: Any  # GrpcServer with `.servicer`

    def slot_held(self) -> bool:
        servicer = self.server.servicer
        if hasattr(servicer, "admission"):  # the AR: its model slot, and calls queued for it
            return servicer.admission.busy or servicer.admission.waiting > 0
        return servicer.busy


@pytest.fixture
async def ar(ar_server) -> AsyncIterator[Worker]:
    async with grpc.aio.insecure_channel(address(ar_server)) as channel:
        yield Worker(ar_service_pb2_grpc.ArServiceStub(channel), channel, ar_server)


async def assert_ar_recovered(ar: Worker, trail: Trail) -> None:
    assert not ar.slot_held(), f"the AR still holds its model slot with no call in flight{trail}"
    answer = await unary(ar.stub.Generate(NORMAL_PRIOR, timeout=CALL_TIMEOUT))
    assert answer.code == OK, f"a normal AR request afterwards: {answer.code.name} {answer.details!r}{trail}"
    assert len(answer.replies[0].outputs[0].tokens.token_ids) == 16


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


# ---- the denoisers --------------------------------------------------------------------------------------------

NORMAL_JOB = dn_pb.DenoiseRequest(**DENOISE_BASE, prior_tokens=common_pb2.TokenRow(token_ids=[3] * 16))


@pytest.fixture
async def denoiser(denoiser_server) -> AsyncIterator[Worker]:
    async with grpc.aio.insecure_channel(address(denoiser_server)) as channel:
        yield Worker(denoiser_service_pb2_grpc.DenoiserServiceStub(channel), channel, denoiser_server)


async def assert_denoiser_recovered(denoiser: Worker, trail: Trail) -> None:
    assert not denoiser.slot_held(), f"the denoiser still holds its slot with no call in flight{trail}"
    answer = await unary(denoiser.stub.Denoise(NORMAL_JOB, timeout=CALL_TIMEOUT))
    assert answer.code == OK, f"a normal denoise afterwards: {answer.code.name} {answer.details!r}{trail}"
    assert answer.replies[0].image


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
            # The admin RPCs need the admin key before anything is read: without it, UNAUTHENTICATED.
            needs_key = service.full_name == "glmimage.v1.GatewayService" and method.name.endswith("Worker")
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
