"""The Node.js example client (clients/node) against the real stack: the contracts work from a second language."""
from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from glmimage import Client
from tests.support.cluster import running_stack
from tests.support.programs import run_node

pytestmark = pytest.mark.e2e

PROMPT = 'a red "STOP" sign'


@pytest.fixture(scope="module")
def stack(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    # One denoiser is enough here, and one model load fewer on a 2-core machine.
    with running_stack(tmp_path_factory.mktemp("node-stack"), denoisers=1) as run:
        yield run.addresses


def test_node_client_writes_a_png_and_prints_usage(node: str, stack: dict[str, str], tmp_path: Path) -> None:
    from PIL import Image

    out = tmp_path / "node" / "out.png"
    done = run_node(node, "--address", stack["gateway"], "--prompt", PROMPT, "--size", "256x192", "--seed", "7",
                    "--out", str(out))
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["files"] == [str(out)]
    image = Image.open(io.BytesIO(out.read_bytes()))
    image.load()
    assert (image.format, image.size) == ("PNG", (256, 192))
    usage = report["usage"]
    assert usage["completion_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]

    # The same request from the Python SDK gives the same bytes and usage: both speak the same contract.
    with Client(stack["gateway"], timeout=120) as client:
        result = client.generate(PROMPT, size="256x192", seed=7)
    assert result.images == [out.read_bytes()]
    assert usage == result.usage.as_dict()


def test_node_client_and_sdk_step_cache_give_the_same_cached_image(node: str, stack: dict[str, str],
                                                                   tmp_path: Path) -> None:
    out = tmp_path / "cached.png"
    done = run_node(node, "--address", stack["gateway"], "--prompt", PROMPT, "--size", "64x64", "--seed", "3",
                    "--steps", "12", "--step-cache", "aggressive", "--out", str(out))
    assert done.returncode == 0, done.stderr
    with Client(stack["gateway"], timeout=120) as client:
        cached = client.generate(PROMPT, size="64x64", seed=3, steps=12, step_cache="aggressive")
        off = client.generate(PROMPT, size="64x64", seed=3, steps=12, step_cache="off")
    assert cached.images == [out.read_bytes()] != off.images
    refused = run_node(node, "--prompt", PROMPT, "--step-cache", "fast")
    assert refused.returncode == 2 and "--step-cache must be one of off, balanced, aggressive" in refused.stderr


def test_node_client_writes_one_file_per_image(node: str, stack: dict[str, str], tmp_path: Path) -> None:
    done = run_node(node, "--address", stack["gateway"], "--prompt", "a cat", "--size", "64x64", "-n", "2",
                    "--out", str(tmp_path / "cat.png"))
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["files"] == [str(tmp_path / "cat-0.png"), str(tmp_path / "cat-1.png")]
    assert all(Path(f).read_bytes().startswith(b"\x89PNG\r\n\x1a\n") for f in report["files"])
    assert report["seeds"][1] == report["seeds"][0] + 1  # output i uses seed + i
    assert report["usage"]["completion_tokens"] > 0


def test_node_client_reports_grpc_errors(node: str, stack: dict[str, str], tmp_path: Path) -> None:
    done = run_node(node, "--address", stack["gateway"], "--prompt", "a cat", "-n", "11",
                    "--out", str(tmp_path / "x.png"))
    assert done.returncode == 1
    assert "INVALID_ARGUMENT" in done.stderr
    assert not (tmp_path / "x-0.png").exists()


def test_node_client_lora_gives_the_sdks_image(node: str, stack: dict[str, str], tmp_path: Path) -> None:
    # Needs the gateway to forward GenerateImagesRequest.loras; tiny-style is the tiny model's demo adapter.
    out = tmp_path / "styled.png"
    done = run_node(node, "--address", stack["gateway"], "--prompt", PROMPT, "--size", "64x64", "--seed", "3",
                    "--steps", "6", "--lora", "tiny-style:0.5", "--out", str(out))
    assert done.returncode == 0, done.stderr
    with Client(stack["gateway"], timeout=120) as client:
        styled = client.generate(PROMPT, size="64x64", seed=3, steps=6, loras=["tiny-style:0.5"])
        base = client.generate(PROMPT, size="64x64", seed=3, steps=6)
    assert styled.images == [out.read_bytes()] != base.images
    refused = run_node(node, "--address", stack["gateway"], "--prompt", PROMPT, "--lora", "no-such-adapter",
                       "--out", str(tmp_path / "x.png"))
    assert refused.returncode == 1 and "INVALID_ARGUMENT" in refused.stderr and "loras" in refused.stderr
