"""How a job's end is written: the Outcome the store records once, with the webhook its tenant asked for, made in
the same step so that a job cannot end without its webhook being owed."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from gateway.jobs.convert import job_proto
from gateway.jobs.keeper import ImageKeeper
from gateway.jobs.model import CANCELLED, FAILED, JobRecord, NewDelivery, Outcome, StoredObject, new_delivery_id
from gateway.jobs.webhooks import event_body
from glmimage.v1 import job_service_pb2

Render = Callable[[job_service_pb2.Job], dict[str, Any]]


class Finisher:
    def __init__(self, keeper: ImageKeeper, render: Render, job_ttl: float, webhook_retry_for: float) -> None:
        self.keeper = keeper
        self.render = render
        self.job_ttl = job_ttl
        self.webhook_retry_for = webhook_retry_for

    def outcome(self, job: JobRecord, status: str, now: float, result: bytes | None = None, code: str = "",
                message: str = "", field: str = "", objects: tuple[StoredObject, ...] = (),
                progress: tuple[int, int] | None = None) -> Outcome:
        """``progress``: the steps done and of how many, as the runner last saw them (``job`` is the record as it
        was taken, before any)."""
        expires_at = now + self.job_ttl
        webhook = None
        if job.webhook_url:
            step, total = progress if progress is not None else (job.step, job.total_steps)
            final = dataclasses.replace(job, status=status, finished_at=now, expires_at=expires_at, result=result,
                                        error_code=code, error_message=message, error_field=field,
                                        lease_owner=None, lease_until=None, step=step, total_steps=total)
            delivery_id = new_delivery_id()
            body = event_body(delivery_id, self.render(job_proto(final, self.keeper, now)), now)
            webhook = NewDelivery(id=delivery_id, job_id=job.id, tenant=job.tenant, url=job.webhook_url,
                                  payload=body, created_at=now, give_up_at=now + self.webhook_retry_for)
        step, total = progress if progress is not None else (None, None)
        return Outcome(status=status, finished_at=now, expires_at=expires_at, result=result, error_code=code,
                       error_message=message, error_field=field, objects=objects, webhook=webhook, step=step,
                       total_steps=total)

    def failed(self, job: JobRecord, code: str, message: str, now: float, field: str = "") -> Outcome:
        return self.outcome(job, FAILED, now, code=code, message=message, field=field)

    def cancelled(self, job: JobRecord, now: float, progress: tuple[int, int] | None = None) -> Outcome:
        return self.outcome(job, CANCELLED, now, progress=progress)
