"""Image editing on the denoiser: the tiny real model behind a real DenoiserService on 127.0.0.1.

The reference tokens are random codes of the right length (the DiT accepts any code of its codebook); the grids are
chosen as the AR would report them, each reference's file resized to grid x 16 by the denoiser whatever its size.
"""
from __future__ import annotations

import io
import random
import struct
import zlib

import grpc
import numpy as np
import pytest
from PIL import Image
from prometheus_client import REGISTRY

from glmimage.v1 import common_pb2, denoiser_service_pb2_grpc
from glmimage.v1 import denoiser_service_pb2 as pb
from services.denoiser.metrics import CancelReason, Outcome
from services.model.tiny import CODEBOOK

PROMPT = 'Make the sign say "EDIT"'
LONG_STEPS = 200  # the server's maximum: still running whenever the test acts on it

# (file width, file height, grid height, grid width): the file's own size need not match its grid.
Spec = tuple[int, int, int, int]
SQUARE = (50, 50, 4, 4)
WIDE = (96, 64, 4, 6)
TALL = (40, 120, 8, 4)


def _png(width: int, height: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def _codes(count: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(CODEBOOK) for _ in range(count)]


def _target(height: int, width: int) -> common_pb2.TokenRow:
    h, w = -(-height // 32) * 32, -(-width // 32) * 32
    return common_pb2.TokenRow(token_ids=_codes((h // 16) * (w // 16), seed=7))


def _reference(spec: Spec, seed: int) -> tuple[common_pb2.ReferenceImage, common_pb2.ReferenceTokens]:
    width, height, grid_h, grid_w = spec
    return (common_pb2.ReferenceImage(data=_png(width, height, seed)),
            common_pb2.ReferenceTokens(tokens=common_pb2.TokenRow(token_ids=_codes(grid_h * grid_w, seed)),
                                       grid_height=grid_h, grid_width=grid_w))


def _edit(height: int, width: int, specs: list[Spec], **fields) -> pb.DenoiseRequest:
    images, references = zip(*(_reference(spec, seed=i) for i, spec in enumerate(specs)), strict=True)
    return pb.DenoiseRequest(prompt=PROMPT, prior_tokens=_target(height, width), height=height, width=width,
                             reference_images=images, references=references, **fields)


def _sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.fixture
async def dn(denoiser_server):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{denoiser_server.port}") as channel:
        yield denoiser_service_pb2_grpc.DenoiserServiceStub(channel)


@pytest.mark.parametrize("height, width, specs", [
    (64, 96, [SQUARE]),
    (80, 100, [SQUARE, WIDE, TALL]),  # runs at 96x128, center-cropped back as text-to-image is
])
async def test_an_edit_gives_the_requested_size_reproducibly_and_unlike_text_to_image(dn, height, width,
                                                                                      specs) -> None:
    req = _edit(height, width, specs, seed=5)
    a, b = await dn.Denoise(req), await dn.Denoise(req)
    assert (a.height, a.width) == (height, width) and a.steps_completed == 2 and a.seed == 5
    assert Image.open(io.BytesIO(a.image)).size == (width, height)
    assert a.image == b.image  # a seed reproduces an edit byte for byte
    text_to_image = pb.DenoiseRequest()
    text_to_image.CopyFrom(req)
    del text_to_image.reference_images[:], text_to_image.references[:]
    assert (await dn.Denoise(text_to_image)).image != a.image  # same seed and tokens: the references count
    other = _edit(height, width, specs[::-1] if len(specs) > 1 else [WIDE], seed=5)
    assert (await dn.Denoise(other)).image != a.image


async def test_an_edit_streams_every_step_and_its_previews(dn) -> None:
    job = _edit(64, 96, [SQUARE, WIDE], num_inference_steps=4, seed=3)
    events = [e async for e in dn.DenoiseStream(pb.DenoiseStreamRequest(job=job, partial_images=2))]
    kinds = [e.WhichOneof("event") for e in events]
    assert kinds == ["progress", "partial_image", "progress", "progress", "partial_image", "progress", "result"]
    assert [e.progress.step for e in events if e.HasField("progress")] == [1, 2, 3, 4]
    previews = [e.partial_image for e in events if e.HasField("partial_image")]
    assert [(p.partial_image_index, p.step) for p in previews] == [(0, 1), (1, 3)]
    assert all(Image.open(io.BytesIO(p.image)).size == (96, 64) for p in previews)
    result = events[-1].result
    assert result.steps_completed == 4 and result.image == (await dn.Denoise(job)).image


async def test_cancelling_an_edit_stops_within_one_step_and_the_next_job_runs(dn, denoiser_server) -> None:
    servicer = denoiser_server.servicer
    cancelled = _sample("glmimage_denoiser_cancelled_jobs_total", reason="client")
    job = _edit(256, 256, [SQUARE, TALL], num_inference_steps=LONG_STEPS, seed=1)
    call = dn.DenoiseStream(pb.DenoiseStreamRequest(job=job))
    first = await call.read()
    assert first.progress.step == 1 and servicer.busy
    call.cancel()
    await servicer.wait_idle()
    record = servicer.last_job
    assert record.outcome is Outcome.CANCELLED and record.cancel_reason is CancelReason.CLIENT
    assert 1 <= record.steps_done <= record.steps_at_cancel + 1 < LONG_STEPS
    assert _sample("glmimage_denoiser_cancelled_jobs_total", reason="client") == cancelled + 1
    assert (await dn.Denoise(_edit(64, 64, [WIDE], seed=2))).steps_completed == 2


def _bomb_header(width: int, height: int) -> bytes:
    """A PNG that is all header: it claims width x height pixels and holds none."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = struct.pack(">I", len(ihdr)) + b"IHDR" + ihdr + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    return b"\x89PNG\r\n\x1a\n" + chunk


def _gif() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (32, 32)).save(out, "GIF")
    return out.getvalue()


def _with(specs: list[Spec], *, image: bytes | None = None, index: int = 0,
          token_ids: list[int] | None = None, grid: tuple[int, int] | None = None, drop: str = "") -> pb.DenoiseRequest:
    """An edit with one thing wrong in its reference ``index`` (or one of its lists cut short)."""
    req = _edit(64, 64, specs)
    if image is not None:
        req.reference_images[index].data = image
    if token_ids is not None:
        req.references[index].tokens.token_ids[:] = token_ids
    if grid is not None:
        req.references[index].grid_height, req.references[index].grid_width = grid
    if drop:
        del getattr(req, drop)[-1]
    return req


@pytest.mark.parametrize("req, field", [
    (_with([SQUARE, WIDE], drop="references"), "references"),
    (_with([SQUARE], drop="reference_images"), "references"),
    (_with([SQUARE, WIDE], index=1, token_ids=[0] * 16), "references[1]"),
    (_with([SQUARE], token_ids=[CODEBOOK] * 16), "references[0]"),
    (_with([SQUARE, WIDE], index=1, token_ids=[-1] + [0] * 23), "references[1]"),
    (_with([SQUARE], grid=(0, 4)), "references[0]"),
    (_with([SQUARE], grid=(200, 200)), "references[0]"),  # 3200x3200 pixels: over max_pixels
    (_with([SQUARE, WIDE], index=1, image=b"not an image"), "reference_images[1]"),
    (_with([SQUARE], image=_gif()), "reference_images[0]"),
    (_with([SQUARE], image=_png(64, 64, seed=0)[:400]), "reference_images[0]"),  # a sound header, data cut short
    (_with([SQUARE], image=_bomb_header(8000, 8000)), "reference_images[0]"),  # 64 Mpx: checked before decoding
    (_edit(64, 64, [SQUARE] * 17), "reference_images"),
], ids=["fewer-references", "fewer-images", "token-count", "id-over-codebook", "negative-id", "empty-grid",
        "grid-over-max-pixels", "not-an-image", "gif", "truncated", "decompression-bomb", "too-many-images"])
async def test_bad_edits_are_refused_naming_the_field(dn, req, field) -> None:
    invalid = _sample("glmimage_denoiser_jobs_total", outcome="invalid")
    # One after the other: a call starts when made, and a truncated file holds the slot while it is decoded.
    for call in (lambda: dn.Denoise(req), lambda: dn.DenoiseStream(pb.DenoiseStreamRequest(job=req)).read()):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith(f"{field}:"), err.value.details()
    assert _sample("glmimage_denoiser_jobs_total", outcome="invalid") == invalid + 2


def test_a_cancel_while_the_references_are_encoded_stops_before_the_first_step(denoise_engine) -> None:
    from runtime.errors import Cancelled
    from services.denoiser.engine import JobControl
    from services.denoiser.servicer import job_from_proto

    control = JobControl()
    # The cancel lands while the first reference is VAE-encoded: the DiT's pass for it is where the job stops.
    hook = denoise_engine.pipe.vae.encoder.register_forward_pre_hook(lambda *_: control.cancel.set())
    try:
        with pytest.raises(Cancelled, match="while encoding the references"):
            denoise_engine.run(denoise_engine.validate(job_from_proto(_edit(64, 64, [SQUARE, WIDE], seed=1))),
                               control)
    finally:
        hook.remove()
    assert control.steps_done == 0 and control.step_seconds == []
