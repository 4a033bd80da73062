"""The adapter directory (--lora-dir) holds what is read: a link inside it is followed only when it resolves inside
it. A link to an adapter file or folder outside, to /etc/passwd (as weights or as a sidecar), to nothing, or round in
a loop is left out of the listing and refused by name, logged once, and never opened; a file whose name is not an
adapter name is left out and logged once. On a real directory with real safetensors files, the tiny model loading
and applying what is allowed."""
from __future__ import annotations

import logging
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime.errors import InvalidArgument
from runtime.limits import Limits
from services.denoiser.adapters import AdapterDirectory, AdapterError, LoraRef, read_adapter
from services.denoiser.engine import DenoiseEngine, DenoiseJob, DenoiseSettings
from services.model.tiny import TINY_LORA, tiny_lora_dir
from tests.test_denoiser_edit import _target

LOGGER = "services.denoiser.adapters"
PASSWD = Path("/etc/passwd")
# Left out, each with what its log line says.
ESCAPES = {
    "out-file": "out-file.safetensors, a link that leads outside the adapter directory",
    "out-folder": "out-folder/pytorch_lora_weights.safetensors, a link that leads outside the adapter directory",
    "out-dotdot": "out-dotdot.safetensors, a link that leads outside the adapter directory",
    "passwd": "passwd.safetensors, a link that leads outside the adapter directory",
    "passwd-sidecar": "passwd-sidecar.json, a link that leads outside the adapter directory",
    "dangling": "dangling.safetensors, a link to nothing",
    "loop": "loop.safetensors, a link that cannot be followed",
}
BAD_NAMES = ["bad name.safetensors", ".hidden.safetensors", "-dash.safetensors",
             "spaced folder/pytorch_lora_weights.safetensors"]


def _adapter(path: Path, like: Path, seed: int) -> None:
    """A real adapter: tiny-style's shapes with other random weights."""
    g = torch.Generator().manual_seed(seed)
    tensors = {k: torch.randn(v.shape, generator=g) * 0.5 for k, v in load_file(str(like)).items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))


@pytest.fixture(scope="module")
def dirs(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the adapter directory, a directory beside it with real adapters that must stay unreachable)."""
    base = tmp_path_factory.mktemp("lora-paths")
    root, outside = base / "loras", base / "outside"
    style = tiny_lora_dir(tiny_checkpoint) / f"{TINY_LORA}.safetensors"
    root.mkdir()
    shutil.copy(style, root / style.name)
    _adapter(root / "folder" / "pytorch_lora_weights.safetensors", style, 1)
    _adapter(root / "side.safetensors", style, 2)  # the passwd-sidecar's weights: real, but its sidecar escapes
    shutil.copy(root / "side.safetensors", root / "passwd-sidecar.safetensors")
    (root / "store").mkdir()
    _adapter(root / "store" / "kept.safetensors", style, 3)
    _adapter(outside / "secret.safetensors", style, 4)
    _adapter(outside / "folder" / "pytorch_lora_weights.safetensors", style, 5)

    (root / "inner-link.safetensors").symlink_to(root / style.name)  # absolute, inside
    (root / "relative-link.safetensors").symlink_to(Path("store") / "kept.safetensors")  # relative, inside
    (root / "folder-link").symlink_to(root / "folder", target_is_directory=True)
    (root / "out-file.safetensors").symlink_to(outside / "secret.safetensors")
    (root / "out-folder").symlink_to(outside / "folder", target_is_directory=True)
    (root / "out-dotdot.safetensors").symlink_to(Path("..") / "outside" / "secret.safetensors")
    (root / "passwd.safetensors").symlink_to(PASSWD)
    (root / "passwd-sidecar.json").symlink_to(PASSWD)
    (root / "dangling.safetensors").symlink_to(root / "missing.safetensors")
    (root / "loop.safetensors").symlink_to(root / "loop.safetensors")
    for bad in BAD_NAMES:
        _adapter(root / bad, style, 6)
    return root, outside


@pytest.fixture
def opened() -> Iterator[list[str]]:
    """Every path this process opens while the test runs, observed by an audit hook (open(), os.open, io.open)."""
    seen: list[str] = []
    _recording[:] = [seen]
    Path(__file__).read_bytes()  # the observer observes
    assert seen == [__file__]
    seen.clear()
    yield seen
    _recording.clear()


_recording: list[list[str]] = []


def _audit(event: str, args: tuple) -> None:
    if event == "open" and _recording and isinstance(args[0], str | bytes | os.PathLike):
        _recording[0].append(os.fsdecode(args[0]))


sys.addaudithook(_audit)  # audit hooks cannot be removed: it records only inside the `opened` fixture


def _touched(seen: list[str], outside: Path) -> list[str]:
    real = [str(Path(p).resolve()) for p in seen]
    return [p for p in real if p == str(PASSWD) or p.startswith(str(outside.resolve()))]


def _left_out(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


def test_the_listing_keeps_links_inside_and_leaves_out_the_rest_logging_each_once(dirs, caplog, opened) -> None:
    root, outside = dirs
    directory = AdapterDirectory(root)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        listing = directory.listing()
    assert [info.name for info in listing] == ["folder", "folder-link", "inner-link", "relative-link", "side",
                                               TINY_LORA]
    real = root.resolve()
    for info in listing:  # what a load would read: resolved, no link left, inside the directory
        assert info.path == info.path.resolve() and info.path.is_relative_to(real), info
        assert not info.path.is_symlink()
    by_name = {info.name: info.path for info in listing}
    assert by_name["inner-link"] == real / f"{TINY_LORA}.safetensors"
    assert by_name["relative-link"] == real / "store" / "kept.safetensors"
    assert by_name["folder-link"] == real / "folder" / "pytorch_lora_weights.safetensors"

    logged = _left_out(caplog)
    for name, why in ESCAPES.items():
        assert [m for m in logged if m.startswith(f"LoRA adapter {name} ")] == [
            f"LoRA adapter {name} left out of the listing: it has {why}"], logged
    for bad in BAD_NAMES:
        assert len([m for m in logged if m.startswith(f"LoRA adapter file {bad} left out")]) == 1, logged
    assert len(logged) == len(ESCAPES) + len(BAD_NAMES), logged

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):  # ListLoras lists afresh each time: no new lines
        assert directory.listing() == listing
        assert AdapterDirectory(root).names() == [info.name for info in listing]
    assert _left_out(caplog) == []
    assert _touched(opened, outside) == []  # listing only stats: /etc/passwd and outside/ are never opened


@pytest.mark.parametrize("name", sorted(ESCAPES))
def test_find_refuses_a_link_leading_out_without_opening_it(dirs, opened, name: str) -> None:
    root, outside = dirs
    with pytest.raises(AdapterError, match=ESCAPES[name].split(", ", 1)[1]):
        AdapterDirectory(root).find(name)
    assert _touched(opened, outside) == []


@pytest.fixture(scope="module")
def engine(tiny_checkpoint: Path, dirs) -> DenoiseEngine:
    return DenoiseEngine.load(tiny_checkpoint, device="cpu", settings=DenoiseSettings(lora_dir=dirs[0],
                                                                                      max_loaded_loras=2))


def _job(*loras: LoraRef) -> DenoiseJob:
    return DenoiseJob(prompt='a "lora" sign', token_ids=list(_target(64, 64).token_ids), height=64, width=64, seed=7,
                      loras=loras)


def _image(engine: DenoiseEngine, *loras: LoraRef) -> bytes:
    return engine.run(engine.validate(_job(*loras))).image


def test_a_link_inside_is_loaded_and_applied_as_its_target(engine) -> None:
    base, style = _image(engine), _image(engine, LoraRef(TINY_LORA))
    assert style != base
    assert _image(engine, LoraRef("inner-link")) == style  # the same file through the link: the same image
    assert _image(engine, LoraRef("folder-link")) == _image(engine, LoraRef("folder")) != base


@pytest.mark.parametrize("name", sorted(ESCAPES))
def test_a_job_or_a_load_naming_a_link_out_is_refused_and_nothing_outside_is_opened(engine, dirs, opened,
                                                                                    name: str) -> None:
    outside = dirs[1]
    loaded = engine.loras_loaded()
    with pytest.raises(InvalidArgument) as err:
        engine.validate(_job(LoraRef(name)))
    assert err.value.field == "loras[0]" and ESCAPES[name].split(", ", 1)[1] in err.value.description
    assert str(outside) not in err.value.description and str(PASSWD) not in err.value.description
    with pytest.raises(InvalidArgument) as err:  # LoadLoras: the same check
        engine.adapters.check_names([name])
    assert err.value.field == "names[0]"
    with pytest.raises(InvalidArgument):  # the worker's own look-up, past any earlier validation
        engine.adapters.preload([name])
    assert engine.loras_loaded() == loaded
    assert _touched(opened, outside) == []


def test_a_bad_name_is_not_served(engine) -> None:
    assert "bad name" not in [info.name for info in engine.available_loras()]
    with pytest.raises(InvalidArgument) as err:
        engine.validate(_job(LoraRef("bad name")))
    assert err.value.field == "loras[0].name"


def test_a_link_put_in_place_of_a_resolved_file_is_not_followed(dirs, tmp_path) -> None:
    """read_adapter opens with O_NOFOLLOW: a path resolved earlier that has since become a link is not read."""
    root, outside = dirs
    link = tmp_path / "swapped.safetensors"
    link.symlink_to(outside / "secret.safetensors")
    with pytest.raises(OSError):  # ELOOP, before a byte is read
        read_adapter(link, {}, Limits())
    with pytest.raises(AdapterError, match="not a linear layer"):  # the file itself is opened and read
        read_adapter(outside / "secret.safetensors", {}, Limits())
