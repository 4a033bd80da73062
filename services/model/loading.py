"""Locating a checkpoint's parts: the tiny default, a full GLM-Image layout, or a bare AR pair."""
from __future__ import annotations

from pathlib import Path

from services.model.tiny import ensure_tiny_checkpoint


class CheckpointError(ValueError):
    """The model path does not hold what the service needs; the message lists what is missing."""


def checkpoint_root(model_path: str | Path | None) -> Path:
    """The directory to load from: --model-path if given, else the embedded tiny model (built on first use)."""
    if model_path is None:
        return ensure_tiny_checkpoint()
    root = Path(model_path).expanduser()
    if not root.is_dir():
        raise CheckpointError(f"--model-path {root}: not a directory")
    return root


def require_parts(root: Path, parts: tuple[str, ...], what: str) -> None:
    missing = [p for p in parts if not (root / p).is_dir()]
    if missing:
        raise CheckpointError(f"{root} has no {', '.join(missing)} subfolder(s) needed by the {what}")
