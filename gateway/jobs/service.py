"""JobService over gRPC: thin. Checks at the edge, the store does the rest; a job is its tenant's alone (any other
caller gets NOT_FOUND, as for an id that never existed, so ids cannot be probed)."""
from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from gateway.auth import GatewayAuth
from gateway.jobs.convert import STATUS_FROM_PROTO, job_proto, stored_result
from gateway.jobs.egress import EgressPolicy, EgressRefused
from gateway.jobs.execute import JobExecutor
from gateway.jobs.keeper import ImageKeeper
from gateway.jobs.metrics import JobMetrics
from gateway.jobs.model import QUEUED, JobRecord, NewJob, new_job_id
from gateway.jobs.outcomes import Finisher
from gateway.jobs.runner import Runner
from gateway.jobs.store import JobStore, StoreUnavailable
from gateway.tenancy import TenantGate, priority_of
from glmimage.v1 import job_service_pb2, job_service_pb2_grpc
from runtime.errors import InvalidArgument, Unavailable
from runtime.logs import request_id_var
from runtime.tenants import Tenant

log = logging.getLogger(__name__)

JOB_ID_RE = re.compile(r"job_[0-9a-f]{32}")
MAX_IDEMPOTENCY_KEY = 256
MAX_WEBHOOK_URL = 2048
DEFAULT_PAGE, MAX_PAGE = 20, 100
WATCH_POLL_S = 0.5
STORE_CALL_TIMEOUT_S = 8.0  # under SQLite's 10 s busy timeout's worst case, far over a healthy store's milliseconds


@dataclass
class JobSettings:
    job_timeout: float = 3600.0  # queued and running, in all


class JobServicer(job_service_pb2_grpc.JobServiceServicer):
    def __init__(self, store: JobStore, keeper: ImageKeeper, executor: JobExecutor, runner: Runner | None,
                 finisher: Finisher, gate: TenantGate, auth: GatewayAuth, egress: EgressPolicy,
                 webhook_secret: Callable[[Tenant], str], settings: JobSettings,
                 metrics: JobMetrics | None = None, on_ended: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.keeper = keeper
        self.executor = executor
        self.runner = runner
        self.finisher = finisher
        self.gate = gate
        self.auth = auth
        self.egress = egress
        self.webhook_secret = webhook_secret
        self.settings = settings
        self.metrics = metrics
        self.on_ended = on_ended  # a job ended here with a webhook owed: wake the deliverer
        self.clock = clock

    def _tenant(self, context: grpc.aio.ServicerContext) -> Tenant:
        tenant = self.auth.caller(context.invocation_metadata())
        return tenant if tenant is not None else Tenant("default")

    async def _stored(self, call):
        """A store call whose failure is the client's UNAVAILABLE (retry later), never an internal error; bounded,
        so that a hung database (its pool and statement timeouts are 10 s and 30 s) is answered in seconds and the
        REST front or SDK may go to another gateway meanwhile."""
        try:
            async with asyncio.timeout(STORE_CALL_TIMEOUT_S):
                return await call
        except (StoreUnavailable, TimeoutError) as exc:
            log.warning("job store unavailable: %s", exc or "no answer in time")
            raise Unavailable("the job store is unavailable; try again shortly") from None

    async def _proto(self, record: JobRecord, include_images: bool = False) -> job_service_pb2.Job:
        now = self.clock()
        position = await self._stored(self.store.queue_position(record)) if record.status == QUEUED else 0
        result = None
        if include_images and (stored := stored_result(record)) is not None:
            result = await self.keeper.with_bytes(stored)
        return job_proto(record, self.keeper, now, position, result)

    async def _find(self, job_id: str, context: grpc.aio.ServicerContext) -> JobRecord:
        tenant = self._tenant(context)
        record = await self._stored(self.store.get(job_id, tenant.name)) if JOB_ID_RE.fullmatch(job_id) else None
        if record is None:
            shown = job_id if len(job_id) <= 64 else f"{job_id[:64]}..."
            await context.abort(grpc.StatusCode.NOT_FOUND, f"id: no job {shown!r} (of this API key's tenant)")
        return record

    async def SubmitJob(self, request, context: grpc.aio.ServicerContext):
        tenant = self._tenant(context)
        gen = request.request
        admitted = self.executor.check(gen)  # INVALID_ARGUMENT naming the field, as GenerateImages does
        priority = priority_of(gen.priority, tenant)
        webhook = request.webhook_url.strip()
        if webhook:
            if len(webhook) > MAX_WEBHOOK_URL:
                raise InvalidArgument("webhook_url", f"at most {MAX_WEBHOOK_URL} characters")
            try:
                self.egress.check_url(webhook)
            except EgressRefused as exc:
                raise InvalidArgument("webhook_url", str(exc)) from None
        key = request.idempotency_key
        if len(key) > MAX_IDEMPOTENCY_KEY or (key and not key.isprintable()):
            raise InvalidArgument("idempotency_key", f"at most {MAX_IDEMPOTENCY_KEY} printable characters")
        now = self.clock()
        await self._stored(self.keeper.check_room(tenant, now))
        # (A retried submit counts against the rate quotas again, as any request does; it makes no second job.)
        headers = await self.gate.charge(tenant, admitted.n)
        if headers:
            await context.send_initial_metadata(headers)
        stored = type(gen)()
        stored.CopyFrom(gen)
        rid = request_id_var.get()
        job_id = new_job_id()
        stored.request_id = rid if rid and rid != "-" else job_id
        stored.priority = gen.priority
        record, created = await self._stored(self.store.insert(NewJob(
            id=job_id, tenant=tenant.name, request=stored.SerializeToString(), n=admitted.n, priority=priority,
            created_at=now, deadline=now + self.settings.job_timeout, webhook_url=webhook, idempotency_key=key,
            request_id=stored.request_id, edit=admitted.edit)))
        if created:
            log.info("job %s accepted (tenant %s, %d image(s))", record.id, tenant.name, admitted.n)
            if self.metrics is not None:
                self.metrics.submitted.labels(tenant.name).inc()
            if self.runner is not None:
                self.runner.wake()
        return job_service_pb2.SubmitJobResponse(job=await self._proto(record))

    async def GetJob(self, request, context: grpc.aio.ServicerContext):
        record = await self._find(request.id, context)
        return job_service_pb2.GetJobResponse(job=await self._proto(record, request.include_images))

    async def WatchJob(self, request, context: grpc.aio.ServicerContext):
        record = await self._find(request.id, context)
        tenant = record.tenant
        last = None
        while True:
            job = await self._proto(record)
            seen = (job.status, job.progress.queue_position, job.progress.step, job.progress.total_steps,
                    job.attempts)
            if seen != last:
                last = seen
                yield job_service_pb2.WatchJobResponse(job=job)
            if record.ended:
                return
            await asyncio.sleep(WATCH_POLL_S)
            fresh = await self._stored(self.store.get(record.id, tenant))
            if fresh is None:  # deleted meanwhile (expired)
                return
            record = fresh

    async def CancelJob(self, request, context: grpc.aio.ServicerContext):
        before = await self._find(request.id, context)
        record = await self._stored(self.store.cancel(before.id, before.tenant, self.clock(),
                                                      lambda job: self.finisher.cancelled(job, self.clock())))
        if record is None:  # deleted meanwhile
            await context.abort(grpc.StatusCode.NOT_FOUND, "id: no such job (of this API key's tenant)")
        log.info("job %s: cancel asked for (it was %s, now %s)", record.id, before.status, record.status)
        if self.runner is not None:
            self.runner.cancel(record.id)  # if it runs here: stopped now, not at its next renewal
        if before.status == QUEUED and record.ended:  # this call ended it
            if self.metrics is not None:
                self.metrics.finished.labels(record.status).inc()
            if record.webhook_url and self.on_ended is not None:
                self.on_ended()
        return job_service_pb2.CancelJobResponse(job=await self._proto(record))

    async def ListJobs(self, request, context: grpc.aio.ServicerContext):
        tenant = self._tenant(context)
        limit = request.limit or DEFAULT_PAGE
        if limit > MAX_PAGE:
            raise InvalidArgument("limit", f"at most {MAX_PAGE}, got {limit}")
        after = request.after or None
        if after is not None and not JOB_ID_RE.fullmatch(after):
            raise InvalidArgument("after", "a job id (job_ and 32 hex digits) from a previous page")
        status = None
        if request.status:
            status = STATUS_FROM_PROTO.get(request.status)
            if status is None:
                raise InvalidArgument("status", f"unknown job status {request.status}")
        records, more = await self._stored(self.store.list(tenant.name, limit, after, status))
        return job_service_pb2.ListJobsResponse(jobs=[await self._proto(r) for r in records], has_more=more)

    async def GetWebhookSecret(self, request, context: grpc.aio.ServicerContext):
        return job_service_pb2.GetWebhookSecretResponse(secret=self.webhook_secret(self._tenant(context)))
