"""Edits end to end on the real stack (`python -m services.launcher`, what `make run` starts, on the tiny model):
the openai SDK's images.edit (several references, n=2, reproducible with a seed, streamed), the Python SDK, the
CLI, docs/grpcurl.md's example and the Node client, all against one stack."""
from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from PIL import Image

from glmimage import Client
from tests.support.cluster import running_stack
from tests.support.images import image_file
from tests.support.programs import glmimage, run_node, run_readme_grpcurl_edit

pytestmark = pytest.mark.e2e

STEPS = {"num_inference_steps": 2}


@pytest.fixture(scope="module")
def stack(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    with running_stack(tmp_path_factory.mktemp("edit-stack"), denoisers=1) as run:
        yield run.addresses


@pytest.fixture(scope="module")
def sdk(stack: dict[str, str]) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"http://{stack['rest']}/v1", api_key="x", max_retries=0, timeout=300) as client:
        yield client


def _decoded(b64: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(b64)))


REFERENCES = [("wide.png", image_file((96, 64), color=(200, 30, 30)), "image/png"),
              ("square.jpg", image_file((64, 64), "JPEG", (20, 30, 200)), "image/jpeg")]


def test_openai_sdk_edit_with_two_references_is_reproducible_with_a_seed(sdk: openai.OpenAI) -> None:
    def edit(seed: int):
        return sdk.images.edit(image=REFERENCES, prompt="make it blue", size="64x64", n=2,
                               extra_body={**STEPS, "seed": seed})

    first, again, other = edit(3), edit(3), edit(4)
    assert len(first.data) == 2 and first.size == "64x64"
    assert all(_decoded(d.b64_json).size == (64, 64) for d in first.data)
    assert [d.b64_json for d in again.data] == [d.b64_json for d in first.data]  # byte for byte
    assert other.data[0].b64_json != first.data[0].b64_json
    usage = first.usage
    assert usage is not None
    details = usage.input_tokens_details
    assert details.image_tokens > 0 and details.text_tokens > 0  # both references counted, and the prompt
    assert details.text_tokens + details.image_tokens == usage.input_tokens


def test_openai_sdk_edit_size_auto_takes_the_first_image(sdk: openai.OpenAI) -> None:
    res = sdk.images.edit(image=REFERENCES, prompt="make it blue", n=1, extra_body={**STEPS, "seed": 1})
    assert res.size == "96x64" and _decoded(res.data[0].b64_json).size == (96, 64)


def test_openai_sdk_edit_streamed(sdk: openai.OpenAI) -> None:
    events = list(sdk.images.edit(image=REFERENCES[:1], prompt="make it blue", size="64x64", n=1, stream=True,
                                  partial_images=1, extra_body={"num_inference_steps": 3, "seed": 2}))
    kinds = [e.type for e in events]
    assert kinds.count("image_edit.completed") == 1 and "image_edit.partial_image" in kinds
    (done,) = [e for e in events if e.type == "image_edit.completed"]
    assert _decoded(done.b64_json).size == (64, 64)
    assert done.usage.input_tokens_details.image_tokens > 0
    # The same edit, unstreamed, is the same image.
    plain = sdk.images.edit(image=REFERENCES[:1], prompt="make it blue", size="64x64", n=1,
                            extra_body={"num_inference_steps": 3, "seed": 2})
    assert plain.data[0].b64_json == done.b64_json


def test_python_sdk_edit(stack: dict[str, str]) -> None:
    with Client(stack["gateway"], timeout=300) as client:
        result = client.edit([image_file((128, 96)), image_file((64, 64))], "make it blue", n=2, size="128x96",
                             seed=3, steps=2)
    assert len(result.images) == 2 and result.seeds == [3, 4]
    for data in result.images:
        with Image.open(io.BytesIO(data)) as image:
            assert (image.format, image.size) == ("PNG", (128, 96))
    assert 0 < result.usage.image_tokens < result.usage.prompt_tokens


def test_cli_edit(stack: dict[str, str], tmp_path: Path) -> None:
    (tmp_path / "ref.png").write_bytes(image_file((64, 64)))
    out = glmimage("edit", "ref.png", "-p", "make it blue", "-n", "2", "--size", "64x64", "--seed", "5",
                   "--steps", "2", "-o", "out/", "--json", "--address", stack["gateway"], cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["seeds"] == [5, 6] and len(report["files"]) == 2
    assert report["usage"]["image_tokens"] > 0
    for name in report["files"]:
        with Image.open(tmp_path / name) as image:
            assert image.size == (64, 64)


def test_readme_grpcurl_edit(stack: dict[str, str], tmp_path: Path) -> None:
    reply = run_readme_grpcurl_edit(stack["gateway"], tmp_path, image_file((256, 256)))
    (image,) = reply["images"]
    assert image["image"].startswith("iVBORw0KGgo")  # base64 of the PNG signature
    assert int(reply["usage"]["image_tokens"]) > 0


def test_node_edit(node: str, stack: dict[str, str], tmp_path: Path) -> None:
    ref = tmp_path / "ref.png"
    ref.write_bytes(image_file((96, 64)))
    done = run_node(node, "--address", stack["gateway"], "--image", str(ref), "--prompt", "make it blue",
                    "--size", "96x64", "--out", str(tmp_path / "edit.png"))
    assert done.returncode == 0, done.stderr
    with Image.open(tmp_path / "edit.png") as image:
        assert (image.format, image.size) == ("PNG", (96, 64))
