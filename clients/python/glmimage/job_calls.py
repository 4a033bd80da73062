"""JobService calls of the SDK's clients (jobs: generations that outlive the connection). Mixed into Client and
AsyncClient, whose channel, metadata, deadlines and retries (glmimage.client._Base) they use."""
from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any, Unpack

import grpc

from glmimage.errors import GlmImageError
from glmimage.jobs import Job, JobPage, JobWaitTimeout, build_list_jobs, build_submit_job
from glmimage.messages import GenerationOptions, ImageInput, build_request, read_images
from glmimage.v1 import gateway_service_pb2, job_service_pb2

log = logging.getLogger("glmimage.client")

JobCallback = Callable[[Job], Any]


JobOptions = GenerationOptions  # `submit_job`'s options: `generate`'s, less n and size (positional there too)


def job_request(prompt: str, n: int, size: str | Sequence[int] | None,
                 images: ImageInput | Sequence[ImageInput] | None,
                 options: JobOptions) -> gateway_service_pb2.GenerateImagesRequest:
    refs = read_images(images) if images is not None else []
    return build_request(prompt, n=n, size=size, images=refs, **options)


def job_id_of(job: Job | str) -> str:
    job_id = job if isinstance(job, str) else job.id
    if not job_id:
        raise ValueError("a job id is required")
    return job_id


class _JobsBase:
    """What both clients' job calls share (the attributes are glmimage.client._Base's)."""

    base_url: str | None
    timeout: float | None

    def _job(self, msg: job_service_pb2.Job) -> Job:
        return Job.from_proto(msg, self.base_url)

    def _rewatch_delay(self, exc: grpc.RpcError | None, failures: int, deadline: float | None, job_id: str,
                       last: Job | None, timeout: float | None) -> float:
        """Seconds before WatchJob is called again after its stream broke (``exc``) or ended before the job did
        (None); raises when it must not be. Unlike one call's retries, a wait reconnects as often as it takes
        within its deadline: the job goes on without the stream, and a gateway restart may take a while. Only
        UNAVAILABLE and RESOURCE_EXHAUSTED (the policy's codes) are retried, and none with retries disabled."""
        err = GlmImageError(grpc.StatusCode.UNAVAILABLE, "the watch ended before the job did", failures) \
            if exc is None else GlmImageError.from_rpc(exc, failures)
        remaining = self._remaining(deadline)
        if exc is not None and err.code == grpc.StatusCode.DEADLINE_EXCEEDED and remaining is not None \
                and remaining < 0.5:
            raise JobWaitTimeout(job_id, timeout, last) from None  # our own deadline, carried by the stream
        codes = {*self.retry.codes, grpc.StatusCode.DEADLINE_EXCEEDED}  # a server's end to a long watch
        if err.code not in codes or self.retry.max_attempts <= 1:
            raise err from None
        if err.retry_after is not None and err.retry_after > self.retry.max_retry_after:
            raise err from None
        delay = (err.retry_after or 0.0) + self.retry.backoff(failures - 1, self._rng)
        if remaining is not None and delay >= remaining:
            raise JobWaitTimeout(job_id, timeout, last) from err
        log.log(logging.WARNING if failures > 1 else logging.INFO, "WatchJob %s: %s (%s), watching again in %.2fs",
                job_id, err.code.name, err.details, delay)
        return delay


class JobCalls(_JobsBase):
    def submit_job(self, prompt: str, n: int = 1, size: str | Sequence[int] | None = None, *,
                   images: ImageInput | Sequence[ImageInput] | None = None, webhook_url: str | None = None,
                   idempotency_key: str | None = None, timeout: float | None = None, request_id: str | None = None,
                   **options: Unpack[JobOptions]) -> Job:
        """Submit a generation as a job, answered once the gateway has written it to its job store: it runs
        whether or not this client stays connected. ``images`` (reference images, as for `edit`) make it an edit;
        the other options are `generate`'s. ``webhook_url``: https URL the job is POSTed to when it ends (signed;
        the gateway's --webhook-allow must admit it). ``idempotency_key``: a second submit with the same key
        answers the first's job; without one the SDK sends a fresh key per call, so its own retries never make a
        second job."""
        req = build_submit_job(job_request(prompt, n, size, images, options), webhook_url=webhook_url,
                               idempotency_key=idempotency_key)
        resp = self._call("SubmitJob", self._jobs.SubmitJob, req, timeout, request_id)
        return self._job(resp.job)

    def get_job(self, job_id: str, include_images: bool = False, *, timeout: float | None = None) -> Job:
        """The job now. Its images come as URLs (signed anew at each call); ``include_images`` adds their bytes.
        Another tenant's job, like one that never existed, is NOT_FOUND."""
        req = job_service_pb2.GetJobRequest(id=job_id_of(job_id), include_images=include_images)
        return self._job(self._call("GetJob", self._jobs.GetJob, req, timeout, None).job)

    def wait(self, job: Job | str, timeout: float | None = None, on_update: JobCallback | None = None) -> Job:
        """Block until the job ends (completed, failed or cancelled) and return it; a job that has ended already is
        returned as it is. Follows WatchJob, calling ``on_update`` with each new state; when the stream breaks
        (UNAVAILABLE: a gateway restarted, a connection cut) it watches again with backoff. ``timeout`` (None: the
        client's; both None: no bound) ends the wait with JobWaitTimeout, and the job goes on."""
        job_id = job_id_of(job)
        last = None if isinstance(job, str) else job
        if last is not None and last.done:
            return last
        t = self.timeout if timeout is None else timeout
        deadline = self._deadline(t)
        metadata = self._metadata(None)
        failures = 0
        while True:
            call = self._jobs.WatchJob(job_service_pb2.WatchJobRequest(id=job_id), timeout=self._remaining(deadline),
                                       metadata=metadata)
            error: grpc.RpcError | None = None
            try:
                for msg in call:
                    failures = 0
                    current = self._job(msg.job)
                    if on_update is not None and current != last:
                        on_update(current)
                    last = current
                    if current.done:
                        return current
            except grpc.RpcError as exc:
                error = exc
            finally:
                call.cancel()
            failures += 1
            time.sleep(self._rewatch_delay(error, failures, deadline, job_id, last, t))

    def cancel_job(self, job_id: str, *, timeout: float | None = None) -> Job:
        """Cancel: a queued job ends at once, a running one as a disconnect would end it (its denoisers are
        freed), an ended one is left as it is. The job as it stands after the call."""
        req = job_service_pb2.CancelJobRequest(id=job_id_of(job_id))
        return self._job(self._call("CancelJob", self._jobs.CancelJob, req, timeout, None).job)

    def list_jobs(self, limit: int = 20, after: str | None = None, status: str | None = None, *,
                  timeout: float | None = None) -> JobPage:
        """One page of this key's jobs, newest first: ``after`` a job id of the previous page
        (``page.next_after``), ``status`` one of queued, in_progress, completed, failed, cancelled (None: all)."""
        resp = self._call("ListJobs", self._jobs.ListJobs, build_list_jobs(limit, after, status), timeout, None)
        return JobPage([self._job(j) for j in resp.jobs], resp.has_more)

    def iter_jobs(self, status: str | None = None, *, page_size: int = 100,
                  timeout: float | None = None) -> Iterator[Job]:
        """Every job of this key, newest first, a page at a time (``timeout`` bounds each page's call)."""
        after = None
        while True:
            page = self.list_jobs(page_size, after, status, timeout=timeout)
            yield from page.jobs
            after = page.next_after
            if after is None:
                return

    def get_webhook_secret(self, *, timeout: float | None = None) -> str:
        """This key's tenant's webhook signing secret (whsec_...), for verifying what its webhooks receive."""
        req = job_service_pb2.GetWebhookSecretRequest()
        return self._call("GetWebhookSecret", self._jobs.GetWebhookSecret, req, timeout, None).secret


class AsyncJobCalls(_JobsBase):
    async def submit_job(self, prompt: str, n: int = 1, size: str | Sequence[int] | None = None, *,
                         images: ImageInput | Sequence[ImageInput] | None = None, webhook_url: str | None = None,
                         idempotency_key: str | None = None, timeout: float | None = None,
                         request_id: str | None = None, **options: Unpack[JobOptions]) -> Job:
        """As `Client.submit_job`."""
        req = build_submit_job(job_request(prompt, n, size, images, options), webhook_url=webhook_url,
                               idempotency_key=idempotency_key)
        resp = await self._call("SubmitJob", self._jobs.SubmitJob, req, timeout, request_id)
        return self._job(resp.job)

    async def get_job(self, job_id: str, include_images: bool = False, *, timeout: float | None = None) -> Job:
        req = job_service_pb2.GetJobRequest(id=job_id_of(job_id), include_images=include_images)
        return self._job((await self._call("GetJob", self._jobs.GetJob, req, timeout, None)).job)

    async def wait(self, job: Job | str, timeout: float | None = None,
                   on_update: JobCallback | None = None) -> Job:
        """As `Client.wait`; ``on_update`` may be a plain function or a coroutine function."""
        job_id = job_id_of(job)
        last = None if isinstance(job, str) else job
        if last is not None and last.done:
            return last
        t = self.timeout if timeout is None else timeout
        deadline = self._deadline(t)
        metadata = self._metadata(None)
        failures = 0
        while True:
            call = self._jobs.WatchJob(job_service_pb2.WatchJobRequest(id=job_id), timeout=self._remaining(deadline),
                                       metadata=metadata)
            error: grpc.RpcError | None = None
            try:
                async for msg in call:
                    failures = 0
                    current = self._job(msg.job)
                    if on_update is not None and current != last:
                        result = on_update(current)
                        if inspect.isawaitable(result):
                            await result
                    last = current
                    if current.done:
                        return current
            except grpc.RpcError as exc:
                error = exc
            finally:
                call.cancel()
            failures += 1
            await asyncio.sleep(self._rewatch_delay(error, failures, deadline, job_id, last, t))

    async def cancel_job(self, job_id: str, *, timeout: float | None = None) -> Job:
        req = job_service_pb2.CancelJobRequest(id=job_id_of(job_id))
        return self._job((await self._call("CancelJob", self._jobs.CancelJob, req, timeout, None)).job)

    async def list_jobs(self, limit: int = 20, after: str | None = None, status: str | None = None, *,
                        timeout: float | None = None) -> JobPage:
        resp = await self._call("ListJobs", self._jobs.ListJobs, build_list_jobs(limit, after, status), timeout,
                                None)
        return JobPage([self._job(j) for j in resp.jobs], resp.has_more)

    async def iter_jobs(self, status: str | None = None, *, page_size: int = 100,
                        timeout: float | None = None) -> AsyncIterator[Job]:
        after = None
        while True:
            page = await self.list_jobs(page_size, after, status, timeout=timeout)
            for job in page.jobs:
                yield job
            after = page.next_after
            if after is None:
                return

    async def get_webhook_secret(self, *, timeout: float | None = None) -> str:
        req = job_service_pb2.GetWebhookSecretRequest()
        return (await self._call("GetWebhookSecret", self._jobs.GetWebhookSecret, req, timeout, None)).secret
