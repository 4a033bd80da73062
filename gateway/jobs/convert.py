"""Job records as the JobService messages: the one place a record becomes protobuf."""
from __future__ import annotations

from gateway.jobs.keeper import ImageKeeper
from gateway.jobs.model import CANCELLED, COMPLETED, FAILED, IN_PROGRESS, QUEUED, JobRecord
from glmimage.v1 import gateway_service_pb2, job_service_pb2

STATUS_TO_PROTO = {
    QUEUED: job_service_pb2.JOB_STATUS_QUEUED,
    IN_PROGRESS: job_service_pb2.JOB_STATUS_IN_PROGRESS,
    COMPLETED: job_service_pb2.JOB_STATUS_COMPLETED,
    FAILED: job_service_pb2.JOB_STATUS_FAILED,
    CANCELLED: job_service_pb2.JOB_STATUS_CANCELLED,
}
STATUS_FROM_PROTO = {v: k for k, v in STATUS_TO_PROTO.items()}


def _secs(t: float | None) -> int:
    return int(t) if t else 0


def stored_result(record: JobRecord) -> gateway_service_pb2.GenerateImagesResponse | None:
    return None if record.result is None else gateway_service_pb2.GenerateImagesResponse.FromString(record.result)


def job_proto(record: JobRecord, keeper: ImageKeeper, now: float, queue_position: int = 0,
              result: gateway_service_pb2.GenerateImagesResponse | None = None) -> job_service_pb2.Job:
    """``result``: the stored result with bytes already read back (include_images); else the stored one. Its keys
    become links signed now."""
    job = job_service_pb2.Job(
        id=record.id, status=STATUS_TO_PROTO[record.status], created_at=_secs(record.created_at),
        started_at=_secs(record.started_at), finished_at=_secs(record.finished_at),
        expires_at=_secs(record.expires_at), webhook_url=record.webhook_url, attempts=record.attempts,
        request_id=record.request_id, edit=record.edit, n=record.n,
        progress=job_service_pb2.JobProgress(queue_position=queue_position if record.status == QUEUED else 0,
                                             step=record.step, total_steps=record.total_steps))
    stored = result if result is not None else stored_result(record)
    if stored is not None:
        job.result.CopyFrom(keeper.present(stored, now, record.expires_at or now + keeper.job_ttl))
    if record.status == COMPLETED and record.total_steps:
        job.progress.step = record.total_steps
    if record.status == FAILED:
        job.error.CopyFrom(job_service_pb2.JobError(code=record.error_code, message=record.error_message,
                                                    field=record.error_field))
    return job
