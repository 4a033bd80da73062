"""Where the suite keeps files between runs: ``$GLMIMAGE_CACHE``, else ``$XDG_CACHE_HOME/glmimage`` (default
``~/.cache/glmimage``): the tiny model, and the embedded job store, its images and secrets."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("GLMIMAGE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "glmimage"))


def write_port_file(path: Path, port: int) -> None:
    """Write the port a server bound (``--port 0``) for its supervisor or test: the only race-free way to learn
    it. Atomic, so a reader polling for the file never sees a partial number."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(str(port))
    tmp.replace(path)
