"""The launcher's stack with jobs, for issue 31's end-to-end tests (tests/test_jobs_e2e.py,
tests/test_jobs_webhooks_e2e.py): two tenants, alpha (with a webhook_secret of its own in the tenants file) and beta
(whose secret is derived), a job directory of the module's own, and the REST calls the tests share.

Waiting on a job is polling its GET with a deadline, as a client does; nothing here sleeps for correctness.
"""
from __future__ import annotations

import base64
import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from tests.support.tenants_stack import TenantStack, tenant_stack, write_tenants

ALPHA, BETA = "sk-alpha-1", "sk-beta-1"
ALPHA_WEBHOOK_SECRET = "whsec_" + base64.b64encode(b"alpha's webhook secret, 32 bytes").decode()
TENANTS: dict[str, dict[str, object]] = {
    "alpha": {"keys": [ALPHA], "webhook_secret": ALPHA_WEBHOOK_SECRET},
    "beta": {"keys": [BETA]},
}
GENERATIONS, EDITS, JOBS = "/v1/images/generations", "/v1/images/edits", "/v1/images/jobs"
ASYNC = {"Prefer": "respond-async"}
TERMINAL = ("completed", "failed", "cancelled")
SIZE = 64
JOB_TIMEOUT_S = 120.0  # a small job on a loaded 2-core machine takes seconds; the bound is for a stuck one
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def auth(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def body(prompt: str, seed: int = 0, n: int = 1, steps: int = 2, size: int = SIZE, **extra: object
         ) -> dict[str, object]:
    return {"prompt": prompt, "n": n, "size": f"{size}x{size}", "num_inference_steps": steps, "seed": seed, **extra}


@contextlib.contextmanager
def jobs_stack(run_dir: Path, *gateway_args: str) -> Iterator[TenantStack]:
    """The launcher with --tenants (alpha, beta) and --jobs-dir run_dir/jobs, one denoiser, ``gateway_args`` passed
    to the gateway (``--gateway-arg=FLAG``)."""
    write_tenants(run_dir / "tenants.toml", TENANTS)
    with tenant_stack(run_dir, run_dir / "tenants.toml", "--jobs-dir", str(run_dir / "jobs"),
                      *(f"--gateway-arg={a}" for a in gateway_args), denoisers=1) as stack:
        yield stack


def submit(rest: httpx.Client, key: str, payload: dict[str, object]) -> dict[str, Any]:
    """A generation sent with Prefer: respond-async: the 202's job object (its Location checked)."""
    r = rest.post(GENERATIONS, json=payload, headers={**auth(key), **ASYNC})
    assert r.status_code == 202, r.text
    job = r.json()
    assert r.headers["location"] == f"{JOBS}/{job['id']}", r.headers
    assert r.headers["preference-applied"] == "respond-async", r.headers  # RFC 7240
    return job


def get_job(rest: httpx.Client, key: str, job_id: str) -> dict[str, Any]:
    r = rest.get(f"{JOBS}/{job_id}", headers=auth(key))
    assert r.status_code == 200, r.text
    return r.json()


def poll_job(rest: httpx.Client, key: str, job_id: str, done: Callable[[dict[str, Any]], bool], what: str,
             timeout: float = JOB_TIMEOUT_S) -> dict[str, Any]:
    """Poll the job's GET until ``done(job)``; the job as it was then."""
    deadline = time.monotonic() + timeout
    while True:
        job = get_job(rest, key, job_id)
        if done(job):
            return job
        assert time.monotonic() < deadline, f"job {job_id}: no {what} after {timeout}s: {job}"
        time.sleep(0.05)


def wait_job(rest: httpx.Client, key: str, job_id: str, timeout: float = JOB_TIMEOUT_S) -> dict[str, Any]:
    """The job once it has ended."""
    return poll_job(rest, key, job_id, lambda job: job["status"] in TERMINAL, "end", timeout)
