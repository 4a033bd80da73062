"""Where the embedded job store, its images and its secrets live by default: one cache directory the gateways and
the REST front of one machine agree on (runtime.paths), so `make run` keeps jobs across restarts."""
from __future__ import annotations

import os
from pathlib import Path

from runtime.paths import cache_root

JOBS_DIR_ENV = "GLMIMAGE_JOBS_DIR"


def jobs_dir() -> Path:
    """``$GLMIMAGE_JOBS_DIR`` (the test suite gives each worker its own), else the cache directory's jobs/."""
    given = os.environ.get(JOBS_DIR_ENV)
    return Path(given) if given else cache_root() / "jobs"


def default_jobs_db() -> str:
    return f"sqlite:///{jobs_dir() / 'jobs.sqlite3'}"


def default_image_store() -> str:
    return str(jobs_dir() / "images")


def default_url_secret_file() -> Path:
    return jobs_dir() / "url-secret"


def default_webhook_secret_file() -> Path:
    return jobs_dir() / "webhook-secret"
