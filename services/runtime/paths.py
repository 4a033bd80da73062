"""Where the suite keeps files between runs: ``$GLMIMAGE_CACHE``, else ``$XDG_CACHE_HOME/glmimage`` (default
``~/.cache/glmimage``): the tiny model, and the embedded job store, its images and secrets."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("GLMIMAGE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "glmimage"))
