"""Denoise engine pieces that need no model: preview schedule, encoding options, stop checks."""
from __future__ import annotations

import io
import time

import numpy as np
import pytest
from PIL import Image

from runtime.errors import Cancelled, DeadlineExceeded
from services.denoiser.encoding import ImageFormat, encode
from services.denoiser.engine import JobControl, preview_steps


@pytest.mark.parametrize("steps, partials, expected", [
    (8, 3, [2, 4, 6]),
    (9, 2, [3, 6]),
    (6, 3, [2, 3, 5]),  # 1.5 and 4.5 round up, never two previews on one step
    (4, 3, [1, 2, 3]),
    (50, 1, [25]),
    (2, 3, [1]),  # too short for three: one preview per step before the last
    (1, 3, []),
    (8, 0, []),
])
def test_preview_steps_are_evenly_spaced_and_before_the_last(steps, partials, expected) -> None:
    assert preview_steps(steps, partials) == expected


def test_preview_steps_are_distinct_and_inside_the_loop_for_all_small_jobs() -> None:
    for steps in range(1, 60):
        for partials in range(4):
            got = preview_steps(steps, partials)
            assert got == sorted(set(got)) and all(1 <= s < steps for s in got)
            assert len(got) == min(partials, steps - 1)


def _photo_like(size: int = 256) -> Image.Image:
    """A smooth gradient with mild noise: compresses like a photo, unlike pure noise or flat colour."""
    y, x = np.mgrid[0:size, 0:size].astype(np.float32) / size
    rgb = np.stack([x, y, (x + y) / 2], axis=-1) * 255
    rgb += np.random.default_rng(0).normal(0, 4, rgb.shape)
    return Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8))


def _zlib_level_flag(png: bytes) -> int:
    """FLEVEL of the first IDAT's zlib header: 0 for levels 0-1, 2 for 6, 3 for 7-9."""
    at = png.index(b"IDAT") + 4
    return png[at + 1] >> 6


def test_png_level_comes_from_the_request_else_the_server_default() -> None:
    image = _photo_like()
    assert _zlib_level_flag(encode(image, ImageFormat.PNG, None, default_png_level=0)) == 0
    assert _zlib_level_flag(encode(image, ImageFormat.PNG, None, default_png_level=6)) == 2
    assert _zlib_level_flag(encode(image, ImageFormat.PNG, None, default_png_level=9)) == 3
    # A request's output_compression (0-100) wins over the server default; 0 compresses most, 100 least.
    assert _zlib_level_flag(encode(image, ImageFormat.PNG, 0, default_png_level=0)) == 3
    stored = encode(image, ImageFormat.PNG, 100, default_png_level=9)
    assert _zlib_level_flag(stored) == 0 and len(stored) > 256 * 256 * 3
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(stored))), np.asarray(image))  # lossless at any level


@pytest.mark.parametrize("fmt", list(ImageFormat))
def test_output_compression_runs_the_same_way_for_every_format(fmt) -> None:
    # OpenAI's convention: 100 (its default) is the least compressed, so the largest file; 0 the smallest.
    image = _photo_like()
    sizes = [len(encode(image, fmt, c)) for c in (0, 50, 100)]
    assert sizes[0] <= sizes[1] < sizes[2], sizes


@pytest.mark.parametrize("fmt, pil_format", [(ImageFormat.JPEG, "JPEG"), (ImageFormat.WEBP, "WEBP")])
def test_lossy_quality_spans_0_to_100(fmt, pil_format) -> None:
    image = _photo_like()
    sizes = {}
    for quality in (0, 50, 100):
        data = encode(image, fmt, quality)
        decoded = Image.open(io.BytesIO(data))
        assert decoded.format == pil_format and decoded.size == image.size
        sizes[quality] = len(data)
    assert sizes[0] < sizes[50] < sizes[100]


def test_job_control_stops_on_cancel_or_deadline() -> None:
    JobControl().check("now")  # neither asked: no error
    control = JobControl()
    control.cancel.set()
    with pytest.raises(Cancelled, match="after 3 of 9 steps"):
        control.check("after 3 of 9 steps")
    with pytest.raises(DeadlineExceeded):
        JobControl(deadline=time.monotonic() - 0.001).check("after 1 step")
    JobControl(deadline=time.monotonic() + 60).check("after 1 step")
