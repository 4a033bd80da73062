"""LoRA adapters in the Python SDK and the Node client, against a scripted gateway (tests/support/fake_lora_gateway.py):
``loras=`` on every generate and edit method (Lora or "NAME[:SCALE]", a scale left unset unless given), list_loras,
load_loras and unload_loras with the admin role's placement, and the gateway's refusals as GlmImageError.
The real stack's behaviour is tests/test_e2e.py's (the `make run` stack)."""
from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from glmimage import NO_RETRY, AsyncClient, Client, Completed, GlmImageError, Lora, LoraInfo, LoraPlacement
from glmimage.client import build_request, build_stream_request
from glmimage.v1 import gateway_service_pb2
from tests.support.fake_lora_gateway import (
    ADMIN_KEY,
    BROKEN,
    DENOISERS,
    FakeServer,
    lora_image,
    sent_loras,
    serve_fake_loras,
)
from tests.support.programs import run_node


@pytest.fixture()
def gw() -> Iterator[FakeServer]:
    with serve_fake_loras() as srv:
        yield srv


# --- parsing and request building ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "lora"), [
    ("tiny-style", Lora("tiny-style")), ("tiny-style:0.5", Lora("tiny-style", 0.5)),
    ("a.b_c-1:-4", Lora("a.b_c-1", -4.0)), ("x:0", Lora("x", 0.0)), ("x:+1e-1", Lora("x", 0.1)),
    ("x:.5", Lora("x", 0.5))])
def test_lora_parse(text: str, lora: Lora) -> None:
    assert Lora.parse(text) == lora


@pytest.mark.parametrize("text", ["", ":1", "x:", "x:big", "x:1:2", "x:nan", "x:inf", "x:-inf"])
def test_lora_parse_refuses_what_is_not_name_and_scale(text: str) -> None:
    with pytest.raises(ValueError, match=r"^loras: "):
        Lora.parse(text)


def test_build_request_sends_each_lora_in_order_and_a_scale_only_when_given() -> None:
    req = build_request("p", loras=["a", "b:0", Lora("c", -1.5), Lora("d")])
    assert [(r.name, r.HasField("scale"), r.scale) for r in req.loras] == [
        ("a", False, 0.0), ("b", True, 0.0), ("c", True, -1.5), ("d", False, 0.0)]
    # One alone is one adapter, not its characters.
    assert [r.name for r in build_request("p", loras="tiny-style").loras] == ["tiny-style"]
    assert [r.name for r in build_request("p", loras=Lora("ink", 2)).loras] == ["ink"]
    assert len(build_request("p").loras) == 0  # the base model
    stream = build_stream_request("p", partial_images=1, loras=["a:0.25"])
    assert (stream.request.loras[0].name, stream.request.loras[0].scale) == ("a", 0.25)


def test_build_request_refuses_what_is_not_a_lora() -> None:
    with pytest.raises(TypeError, match="loras: each must be a Lora or a 'NAME\\[:SCALE\\]' string, got tuple"):
        build_request("p", loras=[("a", 1.0)])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="loras: 'a:x'"):
        build_request("p", loras=["a:x"])


# --- generation with adapters --------------------------------------------------------------------------------------


def test_every_generate_and_edit_method_sends_the_loras(gw: FakeServer, tmp_path: Path) -> None:
    ref = tmp_path / "ref.png"
    ref.write_bytes(b"\x89PNG\r\n\x1a\nref")
    loras = ["tiny-style:0.5", Lora("ink")]
    with Client(gw.address) as client:
        result = client.generate("a", loras=loras)
        assert result.images == [lora_image(gw.servicer.calls[-1].request)]
        assert result.images == [b"PNG:a:tiny-style=0.5,ink=-"]
        assert sent_loras(gw) == [("tiny-style", 0.5), ("ink", None)]
        client.edit(ref, "b", size="64x64", loras=loras)
        assert sent_loras(gw) == [("tiny-style", 0.5), ("ink", None)]
        assert len(gw.servicer.calls[-1].request.reference_images) == 1
        events = list(client.generate_stream("c", loras="ink:-1"))
        assert sent_loras(gw) == [("ink", -1.0)]
        assert isinstance(events[-1], Completed) and events[-1].result.images == [b"PNG:c:ink=-1.0"]
        list(client.edit_stream([ref], "d", size="64x64", loras=[Lora("tiny-style", 0)]))
        assert sent_loras(gw) == [("tiny-style", 0.0)]
        client.generate("e")
        assert sent_loras(gw) == []
    assert [c.method for c in gw.servicer.calls] == ["GenerateImages", "GenerateImages", "GenerateImagesStream",
                                                     "GenerateImagesStream", "GenerateImages"]


async def test_async_generate_and_edit_methods_send_the_loras(gw: FakeServer, tmp_path: Path) -> None:
    ref = tmp_path / "ref.png"
    ref.write_bytes(b"\x89PNG\r\n\x1a\nref")
    async with AsyncClient(gw.address) as client:
        assert (await client.generate("a", loras=["ink:2"])).images == [b"PNG:a:ink=2.0"]
        await client.edit([ref], "b", size="64x64", loras=["tiny-style"])
        assert sent_loras(gw) == [("tiny-style", None)]
        events = [e async for e in client.generate_stream("c", loras=[Lora("ink", 0.5)])]
        assert events[-1].result.images == [b"PNG:c:ink=0.5"]
        _ = [e async for e in client.edit_stream(ref, "d", size="64x64", loras=["ink:-0.5"])]
        assert sent_loras(gw) == [("ink", -0.5)]


def test_an_unknown_adapter_is_a_glmimage_error_naming_loras(gw: FakeServer) -> None:
    with Client(gw.address) as client:
        with pytest.raises(GlmImageError) as caught:
            client.generate("a", loras=["tiny-style", "nope"])
        assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT and caught.value.attempts == 1
        assert caught.value.details.startswith("loras[1]: unknown LoRA adapter 'nope'")
        with pytest.raises(GlmImageError, match="loras"):
            list(client.generate_stream("a", loras="nope"))
        with pytest.raises(ValueError, match="loras"):  # a malformed one never leaves the client
            client.generate("a", loras="tiny-style:strong")
    assert len(gw.servicer.calls) == 2


# --- ListLoras, LoadLoras, UnloadLoras -----------------------------------------------------------------------------


def test_list_loras_shows_placement_to_the_admin_role_only(gw: FakeServer) -> None:
    with Client(gw.address) as anyone, Client(gw.address, api_key=ADMIN_KEY) as admin:
        catalogue = anyone.list_loras()
        assert catalogue.names == ["tiny-style", "ink"]
        assert catalogue.loras[0] == LoraInfo("tiny-style", "a demo style", 1.0, 12345)
        assert math.isclose(catalogue.loras[1].default_scale, 0.75) and catalogue.loras[1].description == ""
        assert catalogue.placement == []
        assert admin.list_loras().placement == [LoraPlacement(DENOISERS[0], ["tiny-style"]),
                                                LoraPlacement(DENOISERS[1], [])]


def test_load_and_unload_loras(gw: FakeServer) -> None:
    with Client(gw.address, api_key=ADMIN_KEY) as client:
        placement = client.load_loras(["ink", "tiny-style"], workers=[DENOISERS[1]])
        assert placement == [LoraPlacement(DENOISERS[1], ["ink", "tiny-style"])]
        load = gw.servicer.calls[-1].request
        assert (list(load.names), list(load.workers)) == (["ink", "tiny-style"], [DENOISERS[1]])
        # One name alone is one name; no workers: every denoiser.
        assert client.load_loras("ink") == [LoraPlacement(DENOISERS[0], ["tiny-style", "ink"]),
                                            LoraPlacement(DENOISERS[1], ["tiny-style", "ink"])]
        assert list(gw.servicer.calls[-1].request.workers) == []
        assert client.unload_loras("tiny-style", DENOISERS[0]) == [LoraPlacement(DENOISERS[0], ["ink"])]
        assert isinstance(gw.servicer.calls[-1].request, gateway_service_pb2.UnloadLorasRequest)
        # A denoiser that could not says why in its placement; the call itself succeeds.
        assert client.load_loras("ink", [BROKEN]) == [
            LoraPlacement(BROKEN, [], "UNAVAILABLE: the denoiser is not reachable")]
        with pytest.raises(GlmImageError) as caught:
            client.load_loras(["nope"])
        assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT and "names[0]" in caught.value.details
        calls = len(gw.servicer.calls)
        with pytest.raises(ValueError, match="load_loras needs at least one adapter name"):
            client.load_loras([])
        with pytest.raises(ValueError, match="unload_loras needs at least one adapter name"):
            client.unload_loras(())
        assert len(gw.servicer.calls) == calls
    with Client(gw.address, retry=NO_RETRY) as anyone, pytest.raises(GlmImageError) as caught:
        anyone.unload_loras("ink")
    assert caught.value.code == grpc.StatusCode.PERMISSION_DENIED


async def test_async_list_load_and_unload(gw: FakeServer) -> None:
    async with AsyncClient(gw.address, api_key=ADMIN_KEY) as client:
        assert (await client.list_loras()).names == ["tiny-style", "ink"]
        assert await client.load_loras(["ink"], [DENOISERS[1]]) == [LoraPlacement(DENOISERS[1], ["ink"])]
        assert await client.unload_loras("ink") == [LoraPlacement(DENOISERS[0], ["tiny-style"]),
                                                    LoraPlacement(DENOISERS[1], [])]
        status = await client.status()
    assert [w.loras_loaded for w in status.workers] == [[], ["tiny-style"], []]


def test_status_shows_each_denoisers_loaded_adapters(gw: FakeServer) -> None:
    with Client(gw.address) as client:
        status = client.status()
    assert [(w.role, w.loras_loaded) for w in status.workers] == [("ar", []), ("denoiser", ["tiny-style"]),
                                                                  ("denoiser", [])]


# --- the Node client -------------------------------------------------------------------------------------------------


def test_node_sends_each_lora_with_a_scale_only_when_given(node: str, gw: FakeServer, tmp_path: Path) -> None:
    out = tmp_path / "styled.png"
    done = run_node(node, "--address", gw.address, "--prompt", "a cat", "--lora", "tiny-style:0.5", "--lora", "ink",
                    "--lora", "ink2:0", "--lora", "x:-1e0", "--out", str(out))
    # ink2 and x are unknown to the fake: the gateway's refusal, exit 1, names loras.
    assert done.returncode == 1 and "INVALID_ARGUMENT: loras[2]" in done.stderr, done.stderr
    assert sent_loras(gw) == [("tiny-style", 0.5), ("ink", None), ("ink2", 0.0), ("x", -1.0)]
    done = run_node(node, "--address", gw.address, "--prompt", "a cat", "--lora", "tiny-style:0", "--lora", "ink",
                    "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert out.read_bytes() == b"PNG:a cat:tiny-style=0.0,ink=-"
    assert json.loads(done.stdout)["files"] == [str(out)]
    # An edit takes them too.
    (tmp_path / "ref.png").write_bytes(b"\x89PNG\r\n\x1a\nref")
    done = run_node(node, "--address", gw.address, "--image", str(tmp_path / "ref.png"), "--prompt", "blue",
                    "--lora", "ink:2", "--out", str(tmp_path / "edit.png"))
    assert done.returncode == 0, done.stderr
    assert sent_loras(gw) == [("ink", 2.0)] and len(gw.servicer.calls[-1].request.reference_images) == 1


@pytest.mark.parametrize("value", ["", ":1", "ink:", "ink:strong", "ink:1:2"])
def test_node_refuses_a_malformed_lora_before_any_call(node: str, gw: FakeServer, value: str) -> None:
    done = run_node(node, "--address", gw.address, "--prompt", "a cat", "--lora", value)
    assert done.returncode == 2 and "--lora must be NAME[:SCALE]" in done.stderr, done.stderr
    assert gw.servicer.calls == []
