"""Every numeric field of GenerateImages and GenerateImagesStream at each of its type's extremes (and, on the wire, as
varints too long for its type), one field at a time: all of them, not a sample.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from glmimage.v1 import gateway_service_pb2 as gw_pb
from runtime.details import field_violation
from tests.support.fuzz import (
    CALL_TIMEOUT,
    FLOAT32_MAX,
    I32_MAX,
    I32_MIN,
    IMAGE_BASE,
    INF,
    INVALID,
    NAN,
    OK,
    U32,
    Answer,
    FuzzGateway,
    Trail,
    assert_gateway_recovered,
    check,
    describe,
    varint,
)

# Examples hold 100k-character strings on purpose; hypothesis warns when it builds their repr.
pytestmark = pytest.mark.filterwarnings("ignore:Generating overly large repr")

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
        "seed", "step_cache", "priority", "response_format", "sampling.temperature", "sampling.top_p",
        "sampling.top_k"))}


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
