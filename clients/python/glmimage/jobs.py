"""Jobs as the SDK hands them back (JobService): `Job`, its progress, images and error, a page of `list_jobs`, and
fetching a job's images from their URLs.

A job's images come as URLs (signed, expiring links to the REST front's image files, or an S3 bucket's presigned
URLs); ``GetJob(include_images=True)`` adds their bytes. `Job.fetch_images` uses the bytes when the job has them and
GETs the URLs otherwise, with urllib: no dependency beyond the standard library.
"""
from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.parse
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from glmimage.results import Usage
from glmimage.v1 import gateway_service_pb2, job_service_pb2
from glmimage.wire import formats

__all__ = ["JOB_STATUSES", "TERMINAL_STATUSES", "ImageFetchError", "Job", "JobError", "JobImage", "JobPage",
           "JobProgress", "JobWaitTimeout", "build_list_jobs", "build_submit_job", "job_status_value",
           "new_idempotency_key"]

# The statuses as the REST front and the gateway's job store spell them.
JOB_STATUSES = ("queued", "in_progress", "completed", "failed", "cancelled")
TERMINAL_STATUSES = frozenset({"completed", "failed", "cancelled"})
_STATUS_NAMES = {job_service_pb2.JobStatus.Value(f"JOB_STATUS_{name.upper()}"): name for name in JOB_STATUSES}


def job_status_value(status: str | None) -> int:
    """The JobStatus enum value of a status name (None: unspecified, every status). A ValueError naming ``status``
    otherwise, before any call."""
    if status is None:
        return job_service_pb2.JOB_STATUS_UNSPECIFIED
    if status not in JOB_STATUSES:
        raise ValueError(f"status must be one of {', '.join(JOB_STATUSES)}, got {status!r}")
    return job_service_pb2.JobStatus.Value(f"JOB_STATUS_{status.upper()}")


def new_idempotency_key() -> str:
    """What `submit_job` sends when the caller names no key: one per call, so the client's own retries of a submit
    whose answer was lost (UNAVAILABLE after the job was written) answer the first job instead of making another."""
    return f"sdk-{uuid.uuid4().hex}"


def build_submit_job(request: gateway_service_pb2.GenerateImagesRequest, *, webhook_url: str | None = None,
                     idempotency_key: str | None = None) -> job_service_pb2.SubmitJobRequest:
    """A SubmitJobRequest around a GenerateImagesRequest (glmimage.messages.build_request)."""
    return job_service_pb2.SubmitJobRequest(
        request=request, webhook_url=webhook_url or "",
        idempotency_key=new_idempotency_key() if idempotency_key is None else idempotency_key)


def build_list_jobs(limit: int = 20, after: str | None = None, status: str | None = None
                    ) -> job_service_pb2.ListJobsRequest:
    """ListJobs: ``limit`` 1 to 100 (checked here, so a bad one fails before any call), ``after`` a job id of an
    earlier page, ``status`` one of JOB_STATUSES (None: all)."""
    if not 1 <= limit <= 100:
        raise ValueError(f"limit must be 1 to 100, got {limit}")
    return job_service_pb2.ListJobsRequest(limit=limit, after=after or "", status=job_status_value(status))


def _time(seconds: int) -> int | None:
    """Unix seconds, None for the proto's 0 (not yet)."""
    return seconds or None


@dataclass(frozen=True)
class JobProgress:
    """Where a job stands: queued jobs (of any tenant) that run before it, then denoising steps over all its images."""

    queue_position: int = 0
    step: int = 0
    total_steps: int = 0


@dataclass(frozen=True)
class JobError:
    """Why a job failed: what the same synchronous request would have answered (a gRPC status code's name)."""

    code: str
    message: str
    field: str = ""  # the request field at fault, when one is (e.g. "prompt")

    def __str__(self) -> str:
        return f"{self.code}: {self.field + ': ' if self.field else ''}{self.message}"


@dataclass(frozen=True)
class JobImage:
    """One image of a completed job: its link (and when that stops working), and its bytes when the job was asked
    for with ``include_images`` (None otherwise)."""

    index: int
    seed: int
    url: str
    url_expires_at: int | None = None
    data: bytes | None = None
    usage: Usage = field(default_factory=Usage)


class ImageFetchError(OSError):
    """An image URL could not be fetched (expired, refused, unreachable). The message names the URL without its
    query: the signature is the capability to read the image, and does not belong in logs."""


class JobWaitTimeout(TimeoutError):
    """`wait` gave up before the job ended. The job goes on: ``job`` is how it last stood (None if never seen)."""

    def __init__(self, job_id: str, timeout: float | None, job: Job | None) -> None:
        where = f"still {job.status}{_progress_note(job)}" if job is not None else "not seen"
        super().__init__(f"job {job_id} {where} after {timeout:g}s; it goes on: wait again, or cancel it"
                         if timeout is not None else f"job {job_id} {where}")
        self.job_id = job_id
        self.job = job


def _progress_note(job: Job) -> str:
    p = job.progress
    if job.status == "queued" and p.queue_position:
        return f" (queue position {p.queue_position})"
    if job.status == "in_progress" and p.total_steps:
        return f" (step {p.step}/{p.total_steps})"
    return ""


@dataclass(frozen=True)
class Job:
    """A job of JobService as it stood when the gateway answered. Times are unix seconds (None: not yet).
    ``images``, ``width``, ``height``, ``output_format`` and ``usage`` are a completed job's result; ``error`` a
    failed one's."""

    id: str
    status: str  # queued, in_progress, completed, failed or cancelled
    created_at: int
    started_at: int | None = None
    finished_at: int | None = None
    expires_at: int | None = None  # when the job and its images are deleted (set once it ends)
    progress: JobProgress = field(default_factory=JobProgress)
    images: list[JobImage] = field(default_factory=list)
    error: JobError | None = None
    attempts: int = 0  # times a runner took it: more than 1 after a runner died or gave it back
    webhook_url: str = ""
    request_id: str = ""
    n: int = 0
    edit: bool = False
    width: int = 0
    height: int = 0
    output_format: str = ""
    usage: Usage | None = None
    # Where relative image URLs are resolved (the REST front's base URL); the client that made the Job sets it.
    base_url: str | None = field(default=None, compare=False, repr=False)

    @classmethod
    def from_proto(cls, j: job_service_pb2.Job, base_url: str | None = None) -> Job:
        r = j.result
        completed = j.HasField("result")
        images = [JobImage(index=im.index, seed=im.seed, url=im.url, url_expires_at=_time(im.url_expires_at),
                           data=im.image or None, usage=Usage.from_proto(im.usage))
                  for im in sorted(r.images, key=lambda im: im.index)]
        error = JobError(j.error.code, j.error.message, j.error.field) if j.error.code or j.error.message else None
        return cls(id=j.id, status=_STATUS_NAMES.get(j.status, "unspecified"), created_at=j.created_at,
                   started_at=_time(j.started_at), finished_at=_time(j.finished_at), expires_at=_time(j.expires_at),
                   progress=JobProgress(j.progress.queue_position, j.progress.step, j.progress.total_steps),
                   images=images, error=error, attempts=j.attempts, webhook_url=j.webhook_url,
                   request_id=j.request_id or r.request_id, n=j.n, edit=j.edit, width=r.width, height=r.height,
                   output_format=formats.name_of(r.output_format) if completed else "",
                   usage=Usage.from_proto(r.usage) if completed else None, base_url=base_url)

    @property
    def done(self) -> bool:
        """The job has ended (completed, failed or cancelled): it changes no more."""
        return self.status in TERMINAL_STATUSES

    @property
    def ok(self) -> bool:
        """The job completed: its images are there."""
        return self.status == "completed"

    @property
    def seeds(self) -> list[int]:
        return [im.seed for im in self.images]

    @property
    def extension(self) -> str:
        fmt = formats.BY_NAME.get(self.output_format or formats.DEFAULT.name)
        return formats.DEFAULT.extension if fmt is None else fmt.extension

    def as_dict(self) -> dict[str, Any]:
        """The job as JSON-ready data (what `glmimage jobs get --json` prints); image bytes are left out."""
        return {"id": self.id, "status": self.status, "created_at": self.created_at, "started_at": self.started_at,
                "finished_at": self.finished_at, "expires_at": self.expires_at,
                "progress": {"queue_position": self.progress.queue_position, "step": self.progress.step,
                             "total_steps": self.progress.total_steps},
                "images": [{"index": im.index, "seed": im.seed, "url": im.url, "url_expires_at": im.url_expires_at}
                           for im in self.images],
                "error": None if self.error is None else {"code": self.error.code, "message": self.error.message,
                                                          "field": self.error.field},
                "attempts": self.attempts, "webhook_url": self.webhook_url, "request_id": self.request_id,
                "n": self.n, "edit": self.edit, "width": self.width, "height": self.height,
                "output_format": self.output_format or None,
                "usage": None if self.usage is None else self.usage.as_dict()}

    def image_urls(self, base_url: str | None = None) -> list[str]:
        """Each image's absolute URL: a relative one (a gateway without --public-url) resolved against
        ``base_url``, else the Job's own base_url. Only http and https are fetched."""
        return [_absolute(im.url, base_url or self.base_url) for im in self.images]

    def fetch_images(self, base_url: str | None = None, *, timeout: float = 60.0,
                     context: ssl.SSLContext | None = None) -> list[bytes]:
        """The images' bytes in order: those the job carries (``include_images``), the others GET from their URLs.
        ``context``: TLS settings for an https front with a private CA. No credentials are sent: the signed URL is
        the capability (an S3 presigned URL would refuse a second authorisation)."""
        if not self.ok:
            raise ValueError(f"job {self.id} is {self.status}: it has no images")
        out = []
        for im in self.images:
            if im.data is not None:
                out.append(im.data)
            else:
                out.append(_get(_absolute(im.url, base_url or self.base_url), timeout, context))
        return out

    def download(self, directory: str | Path, stem: str = "image", *, overwrite: bool = True,
                 base_url: str | None = None, timeout: float = 60.0,
                 context: ssl.SSLContext | None = None) -> list[Path]:
        """Write ``<stem>-<i>.<ext>`` into ``directory`` (created if missing), as `GenerationResult.save` does; the
        paths. Every image is fetched before anything is written, so a failed fetch leaves no partial set. With
        ``overwrite=False`` an existing file raises FileExistsError."""
        images = self.fetch_images(base_url, timeout=timeout, context=context)
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        paths = []
        for i, data in enumerate(images):
            path = out / f"{stem}-{i}.{self.extension}"
            with open(path, "wb" if overwrite else "xb") as f:
                f.write(data)
            paths.append(path)
        return paths


@dataclass(frozen=True)
class JobPage:
    """One page of `list_jobs`, newest first; ``has_more``: older jobs remain (ask with ``after=page.next_after``)."""

    jobs: list[Job]
    has_more: bool

    @property
    def next_after(self) -> str | None:
        return self.jobs[-1].id if self.has_more and self.jobs else None


def _redacted(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, parts.path, "", ""))


def _absolute(url: str, base_url: str | None) -> str:
    if not url:
        raise ValueError("the image has no URL")
    if not urllib.parse.urlsplit(url).scheme:
        if not base_url:
            raise ValueError(f"image URL {_redacted(url)} is relative: give base_url, the REST front's base "
                             "(e.g. http://127.0.0.1:8000), or start the gateway with --public-url")
        url = urllib.parse.urljoin(base_url, url)
    # urllib also opens file: and ftp: URLs; an answer must not make the client read local files.
    if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
        raise ValueError(f"image URL {_redacted(url)}: only http and https are fetched")
    return url


def _get(url: str, timeout: float, context: ssl.SSLContext | None) -> bytes:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="GET"), timeout=timeout,
                                    context=context) as resp:
            return resp.read()
    except urllib.error.HTTPError as exc:
        body = exc.read(2048).decode("utf-8", "replace")
        raise ImageFetchError(f"GET {_redacted(url)}: HTTP {exc.code}{_error_code(body)}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ImageFetchError(f"GET {_redacted(url)}: {reason}") from None


def _error_code(body: str) -> str:
    """The REST front's OpenAI error code (url_expired, invalid_signature), when the body is one."""
    try:
        code = json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return ""
    return f" ({code})" if isinstance(code, str) and code else ""
