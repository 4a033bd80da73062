"""LoRA adapters through the Python SDK and the CLI against the real stack (`python -m services.launcher` on the tiny
model, whose denoiser serves the demo adapter tiny-style): an adapter changes the image, the same request gives the
same bytes, scale 0 is the base image, an unknown name is refused naming loras, and ListLoras/LoadLoras/UnloadLoras
reach the denoiser. The scripted-gateway tests of the same calls are tests/test_client_loras.py's."""
from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from gateway.auth import ENV_ADMIN_KEYS
from glmimage import Client, Completed, GlmImageError, Lora
from services.model.tiny import TINY_LORA
from tests.support.cluster import running_stack
from tests.support.programs import glmimage
from tests.support.waiting import until

pytestmark = pytest.mark.e2e

PROMPT = 'a red "STOP" sign'
# Small and few steps: the tiny model on CPU.
BASE = dict(size="64x64", seed=5, steps=6)
# LoadLoras and UnloadLoras are admin RPCs, off on a gateway without an admin key.
ADMIN_KEY = "sk-lora-admin"


@pytest.fixture(scope="module")
def gateway(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    # One denoiser: every request lands on it, so a load is seen by the next generation (and one model load fewer).
    with pytest.MonkeyPatch.context() as env:
        env.setenv(ENV_ADMIN_KEYS, ADMIN_KEY)  # the launcher's gateway reads it; no user keys: the rest stays open
        with running_stack(tmp_path_factory.mktemp("lora-stack"), denoisers=1) as run:
            yield run.addresses["gateway"]


@pytest.fixture()
def client(gateway: str) -> Iterator[Client]:
    with Client(gateway, timeout=120) as c:
        yield c


@pytest.fixture()
def admin(gateway: str) -> Iterator[Client]:
    with Client(gateway, api_key=ADMIN_KEY, timeout=120) as c:
        yield c


def test_an_adapter_changes_the_image_and_the_same_request_gives_the_same_bytes(client: Client) -> None:
    base = client.generate(PROMPT, **BASE).images
    styled = client.generate(PROMPT, loras=[TINY_LORA], **BASE).images
    assert styled != base
    assert client.generate(PROMPT, loras=[Lora(TINY_LORA)], **BASE).images == styled
    # The sidecar's scale is 1: an explicit 1 is the default; 0 switches the adapter off (the base, byte for byte);
    # another scale is another image.
    assert client.generate(PROMPT, loras=[f"{TINY_LORA}:1"], **BASE).images == styled
    assert client.generate(PROMPT, loras=[f"{TINY_LORA}:0"], **BASE).images == base
    assert client.generate(PROMPT, loras=[Lora(TINY_LORA, -1.0)], **BASE).images not in (base, styled)


def test_the_stream_and_an_edit_take_the_adapter(client: Client) -> None:
    styled = client.generate(PROMPT, loras=TINY_LORA, **BASE).images
    events = list(client.generate_stream(PROMPT, loras=TINY_LORA, **BASE))
    assert isinstance(events[-1], Completed) and events[-1].result.images == styled
    reference = client.generate("a blue circle", **BASE).images[0]
    plain = client.edit(io.BytesIO(reference), "make it green", **BASE).images
    edited = client.edit(io.BytesIO(reference), "make it green", loras=[TINY_LORA], **BASE).images
    assert edited != plain
    assert client.edit(reference, "make it green", loras=[TINY_LORA], **BASE).images == edited


def test_an_unknown_adapter_is_refused_naming_loras(client: Client) -> None:
    with pytest.raises(GlmImageError) as caught:
        client.generate(PROMPT, loras=["no-such-adapter"], **BASE)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT and caught.value.attempts == 1
    assert "loras" in caught.value.details
    with pytest.raises(GlmImageError, match="INVALID_ARGUMENT: .*loras"):
        list(client.generate_stream(PROMPT, loras=[TINY_LORA, TINY_LORA], **BASE))  # no name twice


def test_list_load_and_unload_reach_the_denoiser(client: Client, admin: Client) -> None:
    catalogue = client.list_loras()  # any caller
    (info,) = [i for i in catalogue.loras if i.name == TINY_LORA]
    assert info.default_scale == 1.0 and info.size_bytes > 0 and info.description  # from its sidecar
    assert catalogue.placement == []  # the admin role's
    assert [p.error for p in admin.list_loras().placement] == [""]  # its one denoiser, which answered

    with pytest.raises(GlmImageError) as caught:
        client.load_loras([TINY_LORA])
    assert caught.value.code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
    placement = admin.unload_loras([TINY_LORA])
    assert placement and all(not p.error and TINY_LORA not in p.loaded for p in placement), placement
    placement = admin.load_loras([TINY_LORA])
    assert placement and all(not p.error and TINY_LORA in p.loaded for p in placement), placement
    # The denoiser's occupancy stream carries what it holds into GetStatus.
    until(lambda: all(TINY_LORA in w.loras_loaded for w in client.status().workers if w.role == "denoiser"), 30,
          "GetStatus to show the adapter loaded")
    # Named by address (the admin role sees them); an unknown name or address is refused naming the field.
    (address,) = [w.address for w in admin.status().workers if w.role == "denoiser"]
    (placement,) = admin.unload_loras(TINY_LORA, workers=[address])
    assert (placement.worker, placement.error) == (address, "") and TINY_LORA not in placement.loaded
    for call, field in ((lambda: admin.load_loras(["no-such-adapter"]), "names[0]"),
                        (lambda: admin.load_loras(TINY_LORA, workers=["10.9.9.9:1"]), "workers[0]")):
        with pytest.raises(GlmImageError) as caught:
            call()
        assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT and field in caught.value.details


def test_cli_lora_flag_and_loras_commands(gateway: str, client: Client, tmp_path: Path) -> None:
    done = glmimage("generate", PROMPT, "--size", "64x64", "--seed", "5", "--steps", "6", "--lora", f"{TINY_LORA}:0.5",
                    "-o", "out", "--address", gateway, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    sdk = client.generate(PROMPT, loras=[Lora(TINY_LORA, 0.5)], **BASE).images
    assert [(tmp_path / "out" / "image-0.png").read_bytes()] == sdk != client.generate(PROMPT, **BASE).images
    listed = glmimage("loras", "list", "--address", gateway, cwd=tmp_path)
    assert listed.returncode == 0 and any(ln.split()[0] == TINY_LORA for ln in listed.stdout.splitlines()[1:])
    loaded = glmimage("loras", "load", TINY_LORA, "--address", gateway, "--api-key", ADMIN_KEY, cwd=tmp_path)
    assert loaded.returncode == 0, loaded.stderr
    assert TINY_LORA in loaded.stdout.splitlines()[1]
    elsewhere = glmimage("loras", "load", TINY_LORA, "--worker", "10.9.9.9:1", "--address", gateway,
                         "--api-key", ADMIN_KEY, cwd=tmp_path)
    assert elsewhere.returncode == 1 and "INVALID_ARGUMENT: workers[0]" in elsewhere.stderr, elsewhere.stderr

    def status_column() -> list[str]:  # GetStatus learns it from the denoiser's occupancy stream: soon, not at once
        status = glmimage("status", "--address", gateway, cwd=tmp_path)
        return [ln.split()[-1] for ln in status.stdout.splitlines() if ln.startswith("denoiser")]

    until(lambda: status_column() == [TINY_LORA], 30, "glmimage status to show the adapter loaded", step=0.2)
    refused = glmimage("generate", PROMPT, "--lora", "no-such-adapter", "--address", gateway, cwd=tmp_path)
    assert refused.returncode == 1 and "INVALID_ARGUMENT" in refused.stderr and "loras" in refused.stderr
