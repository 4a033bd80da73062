"""services/model/references.py: the reference sizes agree with the installed image processor's own smart_resize
(so the AR's grid is exactly size / 32), and undecodable data is refused naming the field."""
from __future__ import annotations

import io
import itertools

import pytest
from PIL import Image
from transformers.models.glm_image.image_processing_pil_glm_image import smart_resize

from runtime.errors import InvalidArgument
from services.model.references import decode, prepare, prepare_for_model, reference_model_size

# (min_pixels, max_pixels): the tiny checkpoint's processor, transformers' defaults, and a GLM-Image-like pair.
PROCESSORS = [(32 * 32, 1024 * 1024), (56 * 56, 28 * 28 * 1280), (512 * 512, 2048 * 2048)]
SIDES = [1, 16, 31, 47, 64, 96, 100, 188, 255, 700, 1000, 2049, 4096]


def _png(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (10, 200, 30)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize(("min_pixels", "max_pixels"), PROCESSORS)
def test_model_size_is_one_the_processor_leaves_as_it_is(min_pixels: int, max_pixels: int) -> None:
    for width, height in itertools.product(SIDES, SIDES):
        if max(width, height) > 4 * min(width, height):
            continue  # refused at the edge (check_reference_images)
        w, h = reference_model_size(width, height, min_pixels, max_pixels)
        assert w % 32 == 0 and h % 32 == 0 and max(w, h) <= 4 * min(w, h), (width, height, w, h)
        # The processor halves the model size and cuts 16-pixel patches: no rescale means a grid of size / 32.
        assert smart_resize(h, w, 16, min_pixels, max_pixels) == (h // 2, w // 2), (width, height, w, h)


def test_model_size_keeps_a_size_that_already_fits() -> None:
    assert reference_model_size(64, 64, 32 * 32, 1024 * 1024) == (64, 64)
    assert reference_model_size(96, 64, 32 * 32, 1024 * 1024) == (96, 64)
    assert reference_model_size(2048, 512, 32 * 32, 1024 * 1024) == (1024, 256)  # the long side bound
    assert reference_model_size(64, 64, 512 * 512, 2048 * 2048) == (512, 512)  # the short side bound
    assert reference_model_size(188, 47, 32 * 32, 1024 * 1024) == (192, 64)  # rounding kept within 4:1


def test_prepare_resizes_to_exactly_the_size_given() -> None:
    image = prepare(_png(100, 60), "reference_images[0]", 96, 64)
    assert image.size == (96, 64) and image.mode == "RGB"
    assert prepare_for_model(_png(100, 60), "reference_images[0]", 32 * 32, 1024 * 1024).size == (96, 64)


@pytest.mark.parametrize("data", [b"not an image", _png(64, 64)[:60], _png(64, 64)[:-30]],
                         ids=["garbage", "header-only", "truncated"])
def test_undecodable_data_is_refused_naming_the_field(data: bytes) -> None:
    with pytest.raises(InvalidArgument) as err:
        decode(data, "reference_images[2]")
    assert err.value.field == "reference_images[2]"
