"""Image editing on the AR stage: the tiny real model behind a real ArService, over gRPC.

An edit's outputs are the target grid only, each output reproducible from its seed, the references' tokens on their
(model size / 16) grids, and the references' tokens counted in prompt_tokens as image_tokens. Bad reference data is
INVALID_ARGUMENT naming it, refused from the header where the header already says so (no model work).
"""
from __future__ import annotations

import io
import random
import struct
import zlib

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from PIL import Image
from prometheus_client import REGISTRY

from glmimage.v1 import ar_service_pb2 as pb
from glmimage.v1 import ar_service_pb2_grpc, common_pb2
from runtime.executor import SerialExecutor
from tests.support.servers import serve_ar

# Small enough that every refusal is cheap to provoke, large enough for the references below.
MAX_IMAGES, MAX_BYTES, MAX_TOTAL = 3, 64 << 10, 100 << 10
TARGET_H, TARGET_W = 64, 96
TARGET_GRID = (TARGET_H // 32) * (TARGET_W // 32)
PROMPT = "make the sign blue"


def encoded(width: int, height: int, fmt: str = "PNG", *, noise: bool = False) -> bytes:
    image = (Image.frombytes("RGB", (width, height), random.Random(0).randbytes(width * height * 3))
             if noise else Image.new("RGB", (width, height), (width % 256, 90, height % 256)))
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


def png_declaring(width: int, height: int) -> bytes:
    """A ~70-byte PNG whose header claims width x height: a decompression bomb, as far as its header goes."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


SQUARE_PNG = encoded(64, 64)
WIDE_JPEG = encoded(96, 64, "JPEG")


def edit(*images: bytes, n: int = 1, seed: int | None = 7, prompt: str = PROMPT) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=prompt, n=n, height=TARGET_H, width=TARGET_W, seed=seed,
                              reference_images=[common_pb2.ReferenceImage(data=d) for d in images])


def batches() -> float:
    return REGISTRY.get_sample_value("glmimage_ar_batch_size_count") or 0.0


@pytest.fixture(scope="module")
async def ar(ar_engine):
    """An ArService on the session's tiny model with tight reference limits."""
    from runtime.limits import Limits
    from services.ar.engine import ArEngine

    limits = Limits(max_reference_images=MAX_IMAGES, max_reference_bytes=MAX_BYTES,
                    max_reference_total_bytes=MAX_TOTAL)
    server = await serve_ar(ArEngine(ar_engine.processor, ar_engine.model, ar_engine.device, limits),
                            SerialExecutor("test-ar-edit"))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield ar_service_pb2_grpc.ArServiceStub(channel)
    await server.stop(None)


def processor_counts(processor, images: list[bytes]) -> tuple[int, int]:
    """(prompt tokens, image tokens) of the edit as the processor itself lays it out (the references are already at
    sizes it keeps): image tokens are its <|image|> patches plus each reference's start and end markers."""
    content = [*({"type": "image", "image": Image.open(io.BytesIO(d)).convert("RGB")} for d in images),
               {"type": "text", "text": PROMPT}]
    ids = processor.apply_chat_template([[{"role": "user", "content": content}]], tokenize=True, return_dict=True,
                                        processor_kwargs={"padding": False, "target_h": TARGET_H,
                                                          "target_w": TARGET_W, "return_tensors": "pt"})
    ids = ids["input_ids"][0].tolist()
    tok = processor.tokenizer
    image_id, end_id = tok.convert_tokens_to_ids("<|image|>"), tok.eos_token_id
    return len(ids), ids.count(image_id) + 2 * ids.count(end_id)


@pytest.mark.parametrize(("images", "grids"), [([SQUARE_PNG], [(4, 4)]), ([SQUARE_PNG, WIDE_JPEG], [(4, 4), (4, 6)])],
                         ids=["one", "png+jpeg"])
async def test_an_edit_generates_the_target_grid_and_the_reference_tokens(ar, ar_engine, images, grids) -> None:
    resp = await ar.Generate(edit(*images))
    assert (resp.height, resp.width, resp.grid_height, resp.grid_width) == (TARGET_H, TARGET_W, 4, 6)
    (out,) = resp.outputs
    codebook = ar_engine.codebook_size
    assert len(out.tokens.token_ids) == 4 * 6 and all(0 <= t < codebook for t in out.tokens.token_ids)
    assert [(r.grid_height, r.grid_width) for r in resp.references] == grids
    for ref in resp.references:
        ids = list(ref.tokens.token_ids)
        assert len(ids) == ref.grid_height * ref.grid_width and all(0 <= t < codebook for t in ids)
        rows = [ids[r * ref.grid_width:(r + 1) * ref.grid_width] for r in range(ref.grid_height)]
        assert all(rows[r] == rows[r + 1] and row[0::2] == row[1::2] for r in range(0, len(rows), 2)
                   for row in [rows[r]])  # nearest 2x upsampling: each code a 2x2 block
    prompt_tokens, image_tokens = processor_counts(ar_engine.processor, images)
    u = out.usage
    assert (u.prompt_tokens, u.image_tokens) == (prompt_tokens, image_tokens)
    assert image_tokens == sum(h // 2 * w // 2 + 2 for h, w in grids)
    assert u.completion_tokens == TARGET_GRID + 1  # the target grid, then the end token: no preview grid
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens and resp.usage == u


async def test_n_outputs_differ_by_seed_and_each_is_its_run_alone(ar) -> None:
    images = (SQUARE_PNG, WIDE_JPEG)
    both = await ar.Generate(edit(*images, n=2, seed=40))
    assert [o.seed for o in both.outputs] == [40, 41]
    assert both.outputs[0].tokens != both.outputs[1].tokens
    for out in both.outputs:
        alone = await ar.Generate(edit(*images, seed=out.seed))
        assert alone.outputs == [out] and alone.references == both.references
    u = both.outputs[0].usage
    assert both.usage.prompt_tokens == 2 * u.prompt_tokens and both.usage.image_tokens == 2 * u.image_tokens


async def test_edits_of_one_reference_count_batch_and_match_each_alone(ar) -> None:
    reqs = [edit(SQUARE_PNG, prompt="a"), edit(encoded(128, 64, "WEBP"), seed=9, prompt="a much longer instruction")]
    batch = await ar.GenerateBatch(pb.GenerateBatchRequest(requests=reqs))
    assert [(r.grid_height, r.grid_width) for r in batch.responses[1].references] == [(4, 8)]
    for req, resp in zip(reqs, batch.responses, strict=True):
        assert await ar.Generate(req) == resp


async def test_text_to_image_has_no_references_and_no_image_tokens(ar) -> None:
    resp = await ar.Generate(pb.GenerateRequest(prompt=PROMPT, height=64, width=64, seed=1))
    assert not resp.references and resp.usage.image_tokens == 0


def _field(err: grpc.aio.AioRpcError) -> str:
    """The one field the rich status names (google.rpc.BadRequest); the text leads with it too."""
    (detail,) = rpc_status.from_call(err).details
    bad = error_details_pb2.BadRequest()
    assert detail.Unpack(bad)
    (violation,) = bad.field_violations
    assert err.details().startswith(f"{violation.field}:")
    return violation.field


BAD = [  # (case, reference images, the field named, what the message says, refused from headers alone)
    ("not-an-image", [b"hello, not an image"], "reference_images[0]", "not a PNG", True),
    ("truncated-png", [SQUARE_PNG, encoded(64, 64, noise=True)[:6000]], "reference_images[1]", "decoded", False),
    ("bomb-20000x20000", [png_declaring(20000, 20000)], "reference_images[0]", "", True),
    ("bomb-5000x5000", [png_declaring(5000, 5000)], "reference_images[0]", "declares 5000x5000", True),
    ("too-many", [SQUARE_PNG] * (MAX_IMAGES + 1), "reference_images", "at most 3", True),
    ("over-bytes", [SQUARE_PNG + b"\0" * MAX_BYTES], "reference_images[0]", "bytes", True),
    ("over-total-bytes", [SQUARE_PNG + b"\0" * (MAX_TOTAL // 2)] * 2, "reference_images", "in all", True),
    ("gif", [encoded(64, 64, "GIF")], "reference_images[0]", "GIF", True),
    ("bmp", [SQUARE_PNG, encoded(64, 64, "BMP")], "reference_images[1]", "BMP", True),
    ("aspect-5:1", [encoded(320, 64)], "reference_images[0]", "elongated", True),
]


@pytest.mark.parametrize(("images", "field", "says", "header_only"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
async def test_bad_references_are_invalid_argument_naming_them(ar, images, field, says, header_only) -> None:
    before = batches()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await ar.Generate(edit(*images))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert _field(err.value) == field and says in err.value.details()
    if header_only:
        assert batches() == before  # refused before the model was asked for anything
    partner = edit(*[SQUARE_PNG] * min(len(images), MAX_IMAGES))  # a sound edit that could share its batch
    with pytest.raises(grpc.aio.AioRpcError) as err:  # within a batch: the request's index leads the field
        await ar.GenerateBatch(pb.GenerateBatchRequest(requests=[partner, edit(*images)]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and _field(err.value) == f"requests[1].{field}"


async def test_an_edit_shares_no_batch_with_another_reference_count(ar) -> None:
    for other in (pb.GenerateRequest(prompt="t2i", height=TARGET_H, width=TARGET_W), edit(SQUARE_PNG, WIDE_JPEG)):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await ar.GenerateBatch(pb.GenerateBatchRequest(requests=[edit(SQUARE_PNG), other]))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and _field(err.value) == "requests"


async def test_the_server_keeps_serving_after_bad_references(ar) -> None:
    for case in BAD:
        with pytest.raises(grpc.aio.AioRpcError):
            await ar.Generate(edit(*case[1]))
    first = await ar.Generate(edit(SQUARE_PNG, seed=3))
    assert await ar.Generate(edit(SQUARE_PNG, seed=3)) == first


async def test_the_srt_backend_refuses_edits(ar_engine) -> None:
    from services.ar.prompts import PromptEncoder
    from services.ar.srt_backend import SrtBackend

    # Never contacted: the edit is refused at validation.
    backend = SrtBackend("http://127.0.0.1:9", PromptEncoder(ar_engine.processor))
    server = await serve_ar(backend, SerialExecutor("test-ar-edit-srt"))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await ar_service_pb2_grpc.ArServiceStub(channel).Generate(edit(SQUARE_PNG))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and _field(err.value) == "reference_images"
        assert "srt backend does not support edits" in err.value.details()
    finally:
        await server.stop(None)
