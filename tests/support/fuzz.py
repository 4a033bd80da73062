"""The fuzz tests' vocabulary (tests/fuzz/): boundary values and request strategies, the answers and what they must
look like, and the checks that a gateway, the AR or a denoiser is left with nothing held.
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
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st

from glmimage.v1 import ar_service_pb2 as ar_pb
from glmimage.v1 import common_pb2
from glmimage.v1 import denoiser_service_pb2 as dn_pb
from glmimage.v1 import gateway_service_pb2 as gw_pb
from runtime.limits import round_up
from tests.support.sim_gateway import Gateway, running_gateway

OK, INVALID = grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT
# Refusals the admin RPCs may also answer with (auth, or a conflict with the current membership).
ADMIN_REFUSALS = frozenset({OK, INVALID, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED,
                            grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.NOT_FOUND})
# Every call's deadline, a hang guard: a call that runs into it has hung. A normal tiny-model request took over 10 s
# with both cores busy and three xdist workers, so the guard is 60 s.
CALL_TIMEOUT = 60.0
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
# 0-3 are declared in ImageFormat and in StepCache; proto3 enums are open.
ENUM_VALUES = [0, 1, 2, 3, 4, -1, I32_MAX, I32_MIN]
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
    "step_cache": st.sampled_from(ENUM_VALUES), "priority": st.sampled_from(ENUM_VALUES),
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
    "step_cache": st.sampled_from(ENUM_VALUES),
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


@contextlib.asynccontextmanager
async def fresh_gateway(workers: Workers) -> AsyncIterator[FuzzGateway]:
    """A gateway of its own for one example over the shared model servers: an example that breaks it fails
    alone, and hypothesis, which replays a failing example to report it, sees that example fail, not the next."""
    async with running_gateway(*workers, max_queued_outputs=64) as gw:
        yield FuzzGateway(gw, {w.address: w.role for w in (await gw.status()).workers})


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


async def assert_ar_recovered(ar: Worker, trail: Trail) -> None:
    assert not ar.slot_held(), f"the AR still holds its model slot with no call in flight{trail}"
    answer = await unary(ar.stub.Generate(NORMAL_PRIOR, timeout=CALL_TIMEOUT))
    assert answer.code == OK, f"a normal AR request afterwards: {answer.code.name} {answer.details!r}{trail}"
    assert len(answer.replies[0].outputs[0].tokens.token_ids) == 16


NORMAL_JOB = dn_pb.DenoiseRequest(**DENOISE_BASE, prior_tokens=common_pb2.TokenRow(token_ids=[3] * 16))


async def assert_denoiser_recovered(denoiser: Worker, trail: Trail) -> None:
    assert not denoiser.slot_held(), f"the denoiser still holds its slot with no call in flight{trail}"
    answer = await unary(denoiser.stub.Denoise(NORMAL_JOB, timeout=CALL_TIMEOUT))
    assert answer.code == OK, f"a normal denoise afterwards: {answer.code.name} {answer.details!r}{trail}"
    assert answer.replies[0].image
