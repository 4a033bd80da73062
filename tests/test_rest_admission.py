"""The REST front admits a request in one pass (rest/translate.py, admit): each value is parsed and checked
once, and the one admitted object holds the request the gateway call sends."""
from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from PIL import Image

import glmimage.wire.sizes
from rest import translate
from rest.errors import APIError
from rest.schemas import ImageEditRequest, ImageGenerationRequest
from rest.settings import RestSettings
from runtime.limits import Limits
from tests.support.images import image_file

WIDE, TALL = image_file((96, 64)), image_file((64, 128), fmt="JPEG")


def _admit(body: ImageGenerationRequest | ImageEditRequest, **kwargs: Any) -> translate.Generation:
    return translate.admit(body, RestSettings(), Limits(), rid="req-1", metadata=(("x-request-id", "req-1"),),
                           **kwargs)


@pytest.fixture()
def headers_read(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Every image header Pillow is asked to read, in order."""
    opened: list[bytes] = []
    real_open = Image.open

    def counting_open(fp: Any, *args: Any, **kwargs: Any) -> Any:
        opened.append(fp.getvalue())
        return real_open(fp, *args, **kwargs)

    monkeypatch.setattr(Image, "open", counting_open)
    return opened


@pytest.fixture()
def sizes_parsed(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every `WxH` text the suite's size parser is given."""
    parsed: list[str] = []
    real_parse = glmimage.wire.sizes.parse_size

    def counting_parse(text: str) -> tuple[int, int]:
        parsed.append(text)
        return real_parse(text)

    monkeypatch.setattr(glmimage.wire.sizes, "parse_size", counting_parse)
    return parsed


@pytest.mark.parametrize("size", [None, "auto", "128x96"])
def test_each_reference_header_is_read_once(headers_read: list[bytes], sizes_parsed: list[str],
                                            size: str | None) -> None:
    # `size: auto` takes the first reference's size from the same read that checks every reference's header.
    gen = _admit(ImageEditRequest(prompt="make it blue", image=[WIDE, TALL], size=size), references=[WIDE, TALL],
                 events="image_edit")
    assert headers_read == [WIDE, TALL]
    assert sizes_parsed == ([] if size in (None, "auto") else ["128x96"])
    assert (gen.admitted.width, gen.admitted.height) == ((96, 64) if size in (None, "auto") else (128, 96))
    assert gen.admitted.reference_pixels == 96 * 64 + 64 * 128
    assert [ref.data for ref in gen.request.reference_images] == [WIDE, TALL]


def test_a_bad_reference_is_refused_from_that_one_read(headers_read: list[bytes]) -> None:
    with pytest.raises(APIError) as refused:
        _admit(ImageEditRequest(prompt="p", image=[WIDE, b"not an image"]), references=[WIDE, b"not an image"])
    assert (refused.value.status, refused.value.param) == (400, "image")
    assert headers_read == [WIDE, b"not an image"]


def test_the_admitted_object_is_what_the_call_sends(sizes_parsed: list[str]) -> None:
    gen = _admit(ImageGenerationRequest(prompt="a fox", size="512x256", stream=True, partial_images=2, seed=7))
    assert sizes_parsed == ["512x256"]
    # n and the size settled once, by the admission; the request inside is the one it checked.
    assert (gen.admitted.n, gen.admitted.width, gen.admitted.height) == (1, 512, 256)
    assert gen.request is gen.admitted.request
    assert (gen.request.n, gen.request.width, gen.request.height, gen.request.seed) == (1, 512, 256, 7)
    assert (gen.stream, gen.partial_images, gen.size(), gen.size(64, 32)) == (True, 2, "512x256", "64x32")
    with pytest.raises(dataclasses.FrozenInstanceError):
        gen.partial_images = 3  # type: ignore[misc]


def test_an_empty_prompt_is_refused_by_the_admission_alone() -> None:
    with pytest.raises(APIError) as refused:
        _admit(ImageGenerationRequest(prompt="  "))
    assert (refused.value.status, refused.value.param, refused.value.message) == (400, "prompt",
                                                                                  "prompt: must not be empty")
