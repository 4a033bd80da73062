"""Image editing from every client: the SDK (sync and async), the CLI, the Node client and docs/grpcurl.md's
example, against the scripted gateway (tests/support/fake_gateway.py) on a real gRPC server.

An edit is a GenerateImages / GenerateImagesStream call with reference_images: the tests check that each client
sends the files' bytes as they are, with the generate options, and reads the results (image_tokens included) as for
generate. The last tests run the SDK and the README example against the real stack (marked e2e).
"""
from __future__ import annotations

import io
import json
import shlex
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from glmimage import AsyncClient, Client, Completed, GlmImageError, PartialImage, Progress
from glmimage.v1 import common_pb2
from tests.support.fake_gateway import IMAGE_TOKENS_PER_REFERENCE, FakeServer, fake_image, serve_fake
from tests.support.programs import glmimage, run_node, run_readme_grpcurl_edit

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
# Not decoded by any client: any bytes do, and distinct ones show which file went where.
PNG_A = b"\x89PNG\r\n\x1a\n" + b"reference a"
PNG_B = b"\x89PNG\r\n\x1a\n" + b"reference b"


def sent_references(call_request: object) -> list[bytes]:
    req = getattr(call_request, "request", call_request)  # a stream request wraps the GenerateImagesRequest
    return [image.data for image in req.reference_images]


@pytest.fixture()
def refs(tmp_path: Path) -> list[Path]:
    paths = [tmp_path / "a.png", tmp_path / "b.png"]
    for path, data in zip(paths, (PNG_A, PNG_B), strict=True):
        path.write_bytes(data)
    return paths


# --- the SDK -------------------------------------------------------------------------------------------------------


def test_edit_sends_paths_bytes_and_files_as_they_are(fake: FakeServer, refs: list[Path]) -> None:
    with Client(fake.address) as client, refs[1].open("rb") as f:
        result = client.edit([str(refs[0]), PNG_B, f, bytearray(PNG_A)], "make it blue", n=2, size="512x256",
                             seed=7, steps=9, guidance=3.5, output_format="webp", output_compression=80,
                             request_id="edit-rid")
    (call,) = fake.servicer.calls
    req = call.request
    assert call.method == "GenerateImages"
    assert sent_references(req) == [PNG_A, PNG_B, PNG_B, PNG_A]
    assert (req.prompt, req.n, req.width, req.height, req.seed) == ("make it blue", 2, 512, 256, 7)
    assert (req.num_inference_steps, req.guidance_scale, req.output_compression) == (9, 3.5, 80)
    assert req.output_format == common_pb2.IMAGE_FORMAT_WEBP
    assert call.metadata["x-request-id"] == "edit-rid"
    # Results as for generate: in order, with per-image and summed usage, image tokens included.
    assert result.images == [fake_image("make it blue", i, 7 + i, common_pb2.IMAGE_FORMAT_WEBP) for i in range(2)]
    assert result.seeds == [7, 8] and result.output_format == "webp"
    per_image = 4 * IMAGE_TOKENS_PER_REFERENCE
    assert [u.image_tokens for u in result.image_usages] == [per_image] * 2
    assert result.usage.image_tokens == 2 * per_image
    assert result.usage.prompt_tokens == 2 * (per_image + 3)  # three words of text per image
    assert result.usage.as_dict()["image_tokens"] == 2 * per_image


def test_one_image_may_be_passed_alone(fake: FakeServer, refs: list[Path]) -> None:
    with Client(fake.address) as client:
        client.edit(refs[0], "p", size=(256, 256))
        client.edit(PNG_B, "p", size=(256, 256))
        client.edit(io.BytesIO(PNG_A), "p", size=(256, 256))
    assert [sent_references(c.request) for c in fake.servicer.calls] == [[PNG_A], [PNG_B], [PNG_A]]


def test_generate_sends_no_references(fake: FakeServer) -> None:
    with Client(fake.address) as client:
        result = client.generate("p")
    assert sent_references(fake.servicer.calls[0].request) == []
    assert result.usage.image_tokens == 0


@pytest.mark.parametrize("images, error", [([], ValueError), ((), ValueError), ([io.StringIO("text")], TypeError),
                                           (["/no/such/file.png"], FileNotFoundError)])
def test_bad_images_fail_before_any_call(fake: FakeServer, images: list, error: type[Exception]) -> None:
    with Client(fake.address) as client:
        with pytest.raises(error):
            client.edit(images, "p")
        with pytest.raises(error):
            client.edit_stream(images, "p")
    assert fake.servicer.calls == []


def test_edit_errors_are_glmimage_errors(fake: FakeServer) -> None:
    with Client(fake.address) as client, pytest.raises(GlmImageError) as err:
        client.edit([PNG_A], "invalid")
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_edit_stream_yields_the_events_of_generate_stream(fake: FakeServer) -> None:
    with Client(fake.address) as client:
        events = list(client.edit_stream([PNG_A, PNG_B], "p", n=2, size="256x256", steps=2, partial_images=1, seed=5))
    assert [(e.image_index, e.step) for e in events if isinstance(e, Progress)] == [(0, 1), (0, 2), (1, 1), (1, 2)]
    assert [e.image_index for e in events if isinstance(e, PartialImage)] == [0, 1]
    assert isinstance(events[-1], Completed)
    assert events[-1].result.seeds == [5, 6]
    assert events[-1].result.usage.image_tokens == 2 * 2 * IMAGE_TOKENS_PER_REFERENCE
    (call,) = fake.servicer.calls
    assert call.method == "GenerateImagesStream"
    assert sent_references(call.request) == [PNG_A, PNG_B]
    assert (call.request.partial_images, call.request.request.n, call.request.request.num_inference_steps) == (1, 2, 2)


async def test_async_edit_and_edit_stream(fake: FakeServer, refs: list[Path]) -> None:
    async with AsyncClient(fake.address, api_key="sk-edit") as client:
        result = await client.edit(refs, "a cat", n=2, size=(256, 128), seed=3, output_format="jpeg")
        events = [e async for e in client.edit_stream([PNG_B], "a cat", steps=1, partial_images=1)]
    assert result.images == [fake_image("a cat", i, 3 + i, common_pb2.IMAGE_FORMAT_JPEG) for i in range(2)]
    assert result.usage.image_tokens == 2 * 2 * IMAGE_TOKENS_PER_REFERENCE
    assert [type(e) for e in events] == [Progress, PartialImage, Completed]
    edit, stream = fake.servicer.calls
    assert (edit.method, sent_references(edit.request)) == ("GenerateImages", [PNG_A, PNG_B])
    assert (edit.request.n, edit.request.width, edit.request.height) == (2, 256, 128)
    assert (stream.method, sent_references(stream.request)) == ("GenerateImagesStream", [PNG_B])
    assert {c.metadata["authorization"] for c in fake.servicer.calls} == {"Bearer sk-edit"}


# --- the CLI -------------------------------------------------------------------------------------------------------


def test_cli_edit_writes_images_and_prints_usage(fake: FakeServer, refs: list[Path], tmp_path: Path) -> None:
    out = glmimage("edit", str(refs[0]), str(refs[1]), "-p", "make it blue", "-n", "2", "--size", "512x256",
                   "--seed", "4", "--steps", "3", "--guidance", "2.5", "-o", "out/", "--address", fake.address,
                   cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    files = sorted((tmp_path / "out").iterdir())
    assert [f.read_bytes() for f in files] == [fake_image("make it blue", i, 4 + i) for i in range(2)]
    assert "out/image-1.png" in out.stdout and "seed 5" in out.stdout
    assert f"image_tokens={2 * 2 * IMAGE_TOKENS_PER_REFERENCE} " in out.stdout
    (call,) = fake.servicer.calls
    req = call.request
    assert sent_references(req) == [PNG_A, PNG_B]
    assert (req.prompt, req.n, req.width, req.height, req.num_inference_steps, req.guidance_scale) == (
        "make it blue", 2, 512, 256, 3, 2.5)


def test_cli_edit_json_format_and_stream(fake: FakeServer, refs: list[Path], tmp_path: Path) -> None:
    out = glmimage("edit", str(refs[1]), "--prompt", "p", "--format", "jpeg", "--compression", "70", "--name", "e",
                   "--stream", "--partial-images", "1", "-o", str(tmp_path / "o"), "--json",
                   "--address", fake.address, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["files"] == [str(tmp_path / "o" / "e-0.jpg")]
    assert doc["partial_files"] == [str(tmp_path / "o" / "e-0.partial-0.jpg")]
    assert doc["usage"]["image_tokens"] == IMAGE_TOKENS_PER_REFERENCE
    assert doc["usage"]["prompt_tokens"] == IMAGE_TOKENS_PER_REFERENCE + 1
    (call,) = fake.servicer.calls
    assert call.method == "GenerateImagesStream"
    assert sent_references(call.request) == [PNG_B]
    assert (call.request.request.output_format, call.request.request.output_compression) == (
        common_pb2.IMAGE_FORMAT_JPEG, 70)


def test_cli_edit_needs_an_image_and_a_prompt_and_readable_files(fake: FakeServer, tmp_path: Path) -> None:
    assert glmimage("edit", "-p", "p", "--address", fake.address, cwd=tmp_path).returncode == 2
    assert glmimage("edit", "a.png", "--address", fake.address, cwd=tmp_path).returncode == 2
    out = glmimage("edit", "missing.png", "-p", "p", "--address", fake.address, cwd=tmp_path)
    assert out.returncode == 1 and "missing.png" in out.stderr
    assert fake.servicer.calls == []


def test_readme_cli_edit_runs_as_printed(fake: FakeServer, tmp_path: Path) -> None:
    (line,) = [ln for ln in README.read_text().splitlines() if ln.startswith(".venv/bin/glmimage edit ")]
    argv = shlex.split(line.split("  #")[0])[1:]
    for arg in argv[1:]:
        if arg.endswith(".png"):  # the README's reference files: what its generate line wrote
            (tmp_path / arg).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / arg).write_bytes(PNG_A)
    out = glmimage(*argv, "--address", fake.address, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / argv[argv.index("-o") + 1] / "image-0.png").is_file()
    assert sent_references(fake.servicer.calls[0].request)


# --- grpcurl: docs/grpcurl.md's edit example ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reflecting_fake() -> Iterator[FakeServer]:
    with serve_fake(with_reflection=True) as srv:
        yield srv


def test_readme_grpcurl_edit_sends_the_file(reflecting_fake: FakeServer, tmp_path: Path) -> None:
    reflecting_fake.servicer.reset()
    reference = PNG_A + bytes(range(256)) * 40  # long enough that base64 wraps lines unless the example unwraps
    reply = run_readme_grpcurl_edit(reflecting_fake.address, tmp_path, reference)
    (call,) = reflecting_fake.servicer.calls
    assert call.method == "GenerateImages"
    assert sent_references(call.request) == [reference]
    assert (call.request.width, call.request.height) == (256, 256)
    assert len(reply["images"]) == 1
    assert int(reply["usage"]["image_tokens"]) == IMAGE_TOKENS_PER_REFERENCE


# --- the Node client -----------------------------------------------------------------------------------------------


def test_node_edit_sends_each_image(node: str, fake: FakeServer, refs: list[Path], tmp_path: Path) -> None:
    out = tmp_path / "node" / "edit.png"
    done = run_node(node, "--address", fake.address, "--image", str(refs[0]), "--image", str(refs[1]),
                    "--prompt", "make it blue", "--size", "256x128", "-n", "2", "--seed", "9", "--out", str(out))
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["files"] == [str(tmp_path / "node" / "edit-0.png"), str(tmp_path / "node" / "edit-1.png")]
    assert [Path(f).read_bytes() for f in report["files"]] == [fake_image("make it blue", i, 9 + i) for i in range(2)]
    assert report["usage"]["image_tokens"] == 2 * 2 * IMAGE_TOKENS_PER_REFERENCE
    (call,) = fake.servicer.calls
    assert call.method == "GenerateImages"
    assert sent_references(call.request) == [PNG_A, PNG_B]
    assert (call.request.n, call.request.width, call.request.height, call.request.seed) == (2, 256, 128, 9)

    # Without --image it is a plain generate, as before.
    done = run_node(node, "--address", fake.address, "--prompt", "p", "--out", str(tmp_path / "g.png"))
    assert done.returncode == 0, done.stderr
    assert sent_references(fake.servicer.calls[-1].request) == []


def test_node_edit_with_an_unreadable_image_is_a_usage_error(node: str, fake: FakeServer, tmp_path: Path) -> None:
    done = run_node(node, "--address", fake.address, "--image", str(tmp_path / "missing.png"), "--prompt", "p",
                    "--out", str(tmp_path / "x.png"))
    assert done.returncode == 2
    assert "missing.png" in done.stderr
    assert fake.servicer.calls == []
