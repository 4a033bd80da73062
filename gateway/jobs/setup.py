"""The gateway's job flags, and everything jobs need built from them: the store, the image store, the runner, the
webhook deliverer, housekeeping and JobService. One place, so python -m gateway only calls ``open_jobs``."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from gateway.auth import GatewayAuth
from gateway.driver import Driver
from gateway.jobs.defaults import (
    default_image_store,
    default_jobs_db,
    default_url_secret_file,
    default_webhook_secret_file,
)
from gateway.jobs.deliveries import Deliverer
from gateway.jobs.egress import EgressPolicy
from gateway.jobs.execute import JobExecutor
from gateway.jobs.housekeeping import Housekeeping, HousekeepingConfig
from gateway.jobs.images import ImageStore, open_image_store
from gateway.jobs.keeper import ImageKeeper
from gateway.jobs.metrics import JobMetrics
from gateway.jobs.outcomes import Finisher
from gateway.jobs.render import job_json
from gateway.jobs.runner import Runner, RunnerConfig
from gateway.jobs.service import JobServicer, JobSettings
from gateway.jobs.store import JobStore, StoreUnavailable, open_store
from gateway.jobs.urls import UrlSigner, load_secret, load_url_secret
from gateway.jobs.webhooks import webhook_secret_for
from gateway.tenancy import TenantGate
from runtime.tenants import Tenant, TenantsFile

log = logging.getLogger(__name__)

JOBS_DB_ENV = "GLMIMAGE_JOBS_DB"
JOBS_OFF = "none"  # --jobs-db none: this gateway keeps no jobs and no images
WEBHOOK_SECRET_ENV = "GLMIMAGE_WEBHOOK_SECRET"
GiB = 1 << 30


def _positive(value: str) -> float:
    number = float(value)
    if not number > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {value}")
    return number


def add_job_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("jobs", "asynchronous requests (JobService; the REST front's Prefer: respond-async), "
                                     "stored images (response_format url) and webhooks")
    g.add_argument("--jobs-db", default=os.environ.get(JOBS_DB_ENV), metavar="URL",
                   help=f"the durable job store: sqlite:///PATH (default: {default_jobs_db()}; the gateways of one "
                        f"machine may share it), postgresql://... (several gateways anywhere), or {JOBS_OFF} (no "
                        f"jobs, no stored images); ${JOBS_DB_ENV}")
    g.add_argument("--image-store", default=None, metavar="DIR|s3://BUCKET/PREFIX",
                   help=f"where stored images go (default: {default_image_store()}, served by the REST front given "
                        "the same directory; s3:// returns presigned URLs)")
    g.add_argument("--s3-endpoint", default=os.environ.get("AWS_ENDPOINT_URL"), metavar="URL",
                   help="S3-compatible endpoint for an s3:// image store (default: AWS, or $AWS_ENDPOINT_URL)")
    g.add_argument("--public-url", default=None, metavar="URL",
                   help="the REST front's public base URL, for absolute image links in gRPC answers and webhook "
                        "bodies (default: links relative to the REST front)")
    g.add_argument("--url-secret-file", type=Path, default=None, metavar="FILE",
                   help="the HMAC key of image links, shared with the REST front (default: $GLMIMAGE_URL_SECRET, "
                        f"else {default_url_secret_file()}, created once)")
    g.add_argument("--url-ttl", type=_positive, default=3600.0, metavar="SECONDS",
                   help="how long an image link works (signed anew at each read of a job)")
    g.add_argument("--job-ttl", type=_positive, default=86400.0, metavar="SECONDS",
                   help="finished jobs and stored images are deleted this long after they end")
    g.add_argument("--job-timeout", type=_positive, default=3600.0, metavar="SECONDS",
                   help="a job not done this long after it was accepted fails DEADLINE_EXCEEDED")
    g.add_argument("--job-concurrency", type=int, default=16, metavar="N",
                   help="jobs this gateway's runner holds at once (0: it serves JobService but runs none)")
    g.add_argument("--job-lease", type=_positive, default=30.0, metavar="SECONDS",
                   help="a runner's hold on a job, renewed while it runs: a dead runner's jobs are taken over "
                        "after this")
    g.add_argument("--job-max-attempts", type=int, default=10, metavar="N",
                   help="takes of one job (its runners died) before it fails ABORTED")
    g.add_argument("--job-poll", type=_positive, default=0.5, metavar="SECONDS",
                   help="how often an idle runner looks for jobs other gateways accepted")
    g.add_argument("--max-stored-bytes", type=int, default=GiB, metavar="BYTES",
                   help="per tenant: stored images past this refuse new url/job work (429) until some expire; the "
                        "tenants file's max_stored_bytes overrides it per tenant")
    g.add_argument("--webhook-allow", action="append", default=[], metavar="PATTERN",
                   help="[https://|http://]HOST[:PORT] a webhook may be sent to (HOST a glob, an IP or a CIDR); "
                        "repeatable; none: webhooks are refused. A private, loopback or link-local address only "
                        "when a pattern names it as an IP or CIDR")
    g.add_argument("--webhook-secret-file", type=Path, default=None, metavar="FILE",
                   help="master secret the tenants' webhook secrets are derived from (a tenant's webhook_secret in "
                        f"the tenants file wins; default: ${WEBHOOK_SECRET_ENV}, else "
                        f"{default_webhook_secret_file()}, created once)")
    g.add_argument("--webhook-timeout", type=_positive, default=10.0, metavar="SECONDS")
    g.add_argument("--webhook-backoff", type=_positive, default=5.0, metavar="SECONDS",
                   help="first wait after a failed delivery; doubled each time, at most 300 s")
    g.add_argument("--webhook-retry-for", type=_positive, default=3600.0, metavar="SECONDS",
                   help="a delivery is tried again for this long, then given up")
    g.add_argument("--webhook-ca", type=Path, default=None, metavar="FILE",
                   help="CA bundle trusted for webhook receivers besides the system's")


@dataclass
class Jobs:
    store: JobStore
    images: ImageStore
    keeper: ImageKeeper
    servicer: JobServicer
    runner: Runner
    deliverer: Deliverer
    housekeeping: Housekeeping
    metrics: JobMetrics
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _drain_started: float | None = None

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self.runner.run(self._stop), name="jobs:runner"),
                       asyncio.create_task(self.deliverer.run(self._stop), name="jobs:webhooks"),
                       asyncio.create_task(self.housekeeping.run(self._stop), name="jobs:housekeeping")]

    async def drain(self) -> None:
        """SIGTERM: take no more jobs (other gateways' runners take them); those held run on until close()."""
        self.runner.drain()
        self._drain_started = asyncio.get_running_loop().time()

    async def close(self, grace: float = 0.0) -> None:
        """Let the jobs held end within what is left of ``grace`` since drain(), then stop: the runner gives what is
        still running back to the store (the next runner takes it at once)."""
        if grace > 0 and self._drain_started is not None:
            left = self._drain_started + grace - asyncio.get_running_loop().time()
            if not await self.runner.finish_within(left):
                log.info("jobs still running after the drain grace: given back to the store")
        self._stop.set()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.store.close()


async def open_jobs(args: argparse.Namespace, driver: Driver, gate: TenantGate, auth: GatewayAuth,
                    tenants: TenantsFile, default_height: int, default_width: int, registry=None) -> Jobs:
    """Everything built and the store connected (it must answer at start-up: a gateway that cannot keep jobs says
    so at once rather than failing each submit)."""
    try:
        url_secret = load_url_secret(args.url_secret_file, default=default_url_secret_file())
        master = load_secret(args.webhook_secret_file, WEBHOOK_SECRET_ENV, what="webhook master secret",
                             flag="--webhook-secret-file", default=default_webhook_secret_file())
        egress = EgressPolicy.from_patterns(args.webhook_allow)
        signer = UrlSigner(url_secret, args.url_ttl)
        images = open_image_store(args.image_store or default_image_store(), signer, args.public_url,
                                  args.s3_endpoint)
        store = open_store(args.jobs_db or default_jobs_db())
        runner_config = RunnerConfig(concurrency=args.job_concurrency, lease_s=args.job_lease,
                                     max_attempts=args.job_max_attempts, poll_s=args.job_poll)
    except (ValueError, OSError) as exc:
        raise SystemExit(f"gateway: jobs: {exc}") from None
    if args.max_stored_bytes < 1:
        raise SystemExit("gateway: --max-stored-bytes must be at least 1")
    try:
        await store.connect()
    except StoreUnavailable as exc:
        raise SystemExit(f"gateway: the job store {store.url_for_logs} does not answer: {exc}") from None
    metrics = JobMetrics(registry) if registry is not None else JobMetrics()
    keeper = ImageKeeper(images, store, args.job_ttl, args.max_stored_bytes)
    finisher = Finisher(keeper, job_json, args.job_ttl, args.webhook_retry_for)

    def secret_of(tenant: Tenant) -> str:
        return webhook_secret_for(tenant.name, tenant.webhook_secret, master)

    def secret_by_name(name: str) -> str:
        return secret_of(tenants.current.by_name.get(name) or Tenant(name))

    deliverer = Deliverer(store, egress, secret_by_name, metrics, timeout=args.webhook_timeout,
                          backoff=args.webhook_backoff, ca_file=args.webhook_ca)
    executor = JobExecutor(driver, gate, tenants, default_height, default_width)
    runner = Runner(store, executor, keeper, finisher, runner_config, metrics, on_finished=deliverer.wake)
    housekeeping = Housekeeping(store, images, finisher, HousekeepingConfig(
        max_attempts=args.job_max_attempts, job_ttl=args.job_ttl), metrics, on_ended=deliverer.wake)
    servicer = JobServicer(store, keeper, executor, runner, finisher, gate, auth, egress, secret_of,
                           JobSettings(job_timeout=args.job_timeout), metrics, on_ended=deliverer.wake)
    log.info("jobs in %s, images in %s, runner %s (%d slot(s)); webhooks %s", store.url_for_logs,
             args.image_store or default_image_store(), runner.owner, args.job_concurrency,
             "to " + ", ".join(args.webhook_allow) if args.webhook_allow else "off (no --webhook-allow)")
    return Jobs(store, images, keeper, servicer, runner, deliverer, housekeeping, metrics)
