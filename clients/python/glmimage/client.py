"""Python clients for GatewayService: `Client` (blocking) and `AsyncClient` (asyncio).

Only grpcio, protobuf and googleapis-common-protos are needed. Both clients share the same options:

- ``timeout``: an overall deadline per call in seconds, retries and backoff included;
- ``retry``: exponential backoff with jitter, on UNAVAILABLE and RESOURCE_EXHAUSTED only (the two codes that mean
  "try again later"; anything else would fail the same way again, or must not be repeated); a refusal that says
  when to come back (a quota's RetryInfo) is retried no earlier than that, and not at all when that is past the
  deadline or ``retry.max_retry_after``;
- ``tls``: server CA and optional client certificate for mutual TLS;
- ``api_key``: sent as ``authorization: Bearer <key>`` metadata;
- ``address``: one host:port, several (a list or "a:p,b:p", IP literals) or a ``dns:///name:port`` resolving to
  several gateways: grpc's round_robin spreads the calls, and the retries on UNAVAILABLE reach another gateway.

    >>> with Client("127.0.0.1:50050") as client:
    ...     result = client.generate("a red STOP sign", n=2, size="256x256", seed=1)
    ...     result.save("out/")
    ...     edited = client.edit(["out/image-0.png"], "make it blue", size="256x256")
    ...     job = client.submit_job("a red STOP sign", n=4, size="1024x1024")   # a job outlives the connection
    ...     done = client.wait(job, timeout=900)
    ...     done.download("out/")
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar, Unpack

import grpc

from glmimage.errors import GlmImageError
from glmimage.job_calls import AsyncJobCalls, JobCalls
from glmimage.jobs import (
    ImageFetchError,
    Job,
    JobError,
    JobImage,
    JobPage,
    JobProgress,
    JobWaitTimeout,
)
from glmimage.messages import (
    ImageInput,
    ImageOptions,
    Lora,
    LoraInput,
    PriorityInput,
    build_add_worker,
    build_load_loras,
    build_request,
    build_stream_request,
    build_unload_loras,
    parse_size,
    read_images,
)
from glmimage.ratelimits import RateLimits
from glmimage.results import (
    Completed,
    GenerationResult,
    Limits,
    LoraCatalogue,
    LoraInfo,
    LoraPlacement,
    PartialImage,
    Progress,
    Status,
    StreamEvent,
    TenantInfo,
    Usage,
    WorkerInfo,
    event_from_proto,
    placements_from_proto,
)
from glmimage.v1 import gateway_service_pb2, gateway_service_pb2_grpc, job_service_pb2_grpc
from glmimage.wire.channels import TlsConfig, aio_channel, balanced_target, sync_channel
from glmimage.wire.formats import FORMATS
from glmimage.wire.keepalive import message_size_options

# The result types (glmimage.results), TlsConfig (glmimage.wire.channels) and FORMATS (glmimage.wire.formats) are
# re-exported here, where callers have always found them.
__all__ = ["DEFAULT_ADDRESS", "DEFAULT_RETRY", "FORMATS", "NO_RETRY", "AsyncClient", "Client", "Completed",
           "GenerationResult", "GlmImageError", "Limits", "Lora", "LoraCatalogue", "LoraInfo", "LoraInput",
           "LoraPlacement", "PartialImage", "PriorityInput", "Progress", "RateLimits", "RetryPolicy", "Status",
           "StreamEvent", "TenantInfo", "ImageFetchError", "Job", "JobError", "JobImage", "JobPage", "JobProgress",
           "JobWaitTimeout",
           "ImageInput", "ImageOptions", "TlsConfig", "Usage", "WorkerInfo", "build_request",
           "build_stream_request", "parse_size", "read_images"]

log = logging.getLogger(__name__)

DEFAULT_ADDRESS = "127.0.0.1:50050"
RETRYABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})
# Ten large PNGs in one reply exceed grpc's 4 MiB default by far.
DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024

T = TypeVar("T")


# --- options -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter. ``max_attempts`` counts the first call (1 disables retries)."""

    max_attempts: int = 4
    initial_backoff: float = 0.2
    max_backoff: float = 5.0
    multiplier: float = 2.0
    # Fraction of each delay that is randomised, so clients rejected together do not come back together.
    jitter: float = 0.5
    codes: frozenset[grpc.StatusCode] = RETRYABLE_CODES
    # A refusal asking for a longer wait than this (a quota's retry_after, seconds) is final at once.
    max_retry_after: float = 60.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if not 0.0 <= self.jitter <= 1.0:
            raise ValueError("jitter must be between 0 and 1")
        if self.max_retry_after < 0:
            raise ValueError("max_retry_after must be at least 0")
        unsafe = set(self.codes) - RETRYABLE_CODES
        if unsafe:
            names = sorted(c.name for c in unsafe)
            raise ValueError(f"only UNAVAILABLE and RESOURCE_EXHAUSTED may be retried, not {names}")

    def backoff(self, retry: int, rng: random.Random | None = None) -> float:
        """Delay before retry number ``retry`` (0-based): base * multiplier**retry, capped, minus up to jitter%."""
        base = min(self.max_backoff, self.initial_backoff * self.multiplier ** retry)
        return base * (1.0 - self.jitter * (rng or random).random())


DEFAULT_RETRY = RetryPolicy()
NO_RETRY = RetryPolicy(max_attempts=1)


# Request building lives in glmimage.messages; its names are re-exported here, where callers have always found them.

# A job's update callback for `wait`: called with each new state (the async client also awaits a coroutine).


class _Base:
    """What both clients share: channel arguments, metadata, deadlines and the retry decision."""

    # The channel kind: grpc's blocking channel for Client, grpc.aio's for AsyncClient.
    _make_channel: Callable[..., Any]

    def __init__(self, address: str | Sequence[str] = DEFAULT_ADDRESS, *, api_key: str | None = None,
                 tls: TlsConfig | None = None,
                 timeout: float | None = None, retry: RetryPolicy = DEFAULT_RETRY,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, options: Sequence[tuple[str, Any]] = (),
                 rng: random.Random | None = None, base_url: str | None = None) -> None:
        self.address = address
        # The REST front's base URL (http://host:8000): relative job image URLs are resolved against it.
        self.base_url = base_url
        self.api_key = api_key
        self.tls = tls
        self.timeout = timeout
        self.retry = retry
        self._rng = rng or random.Random()
        # glmimage.wire.channels adds the keepalive the gateway accepts and a short capped reconnect backoff; the
        # caller's ``options`` come last, so they override.
        # Several gateways (a list, "a:p,b:p", or a dns:/// name) make one channel with grpc's round_robin: calls
        # spread over them, and a retry after an UNAVAILABLE goes to another one.
        self._target, balancing = balanced_target(address)
        self._options = [*message_size_options(max_message_bytes, max_message_bytes), *balancing, *options]
        self._channel = self._make_channel(self._target, tls, self._options)
        self._stub = gateway_service_pb2_grpc.GatewayServiceStub(self._channel)
        self._jobs = job_service_pb2_grpc.JobServiceStub(self._channel)

    def _metadata(self, request_id: str | None) -> list[tuple[str, str]]:
        md = []
        if self.api_key:
            md.append(("authorization", f"Bearer {self.api_key}"))
        if request_id:
            md.append(("x-request-id", request_id))
        return md

    def _deadline(self, timeout: float | None) -> float | None:
        t = self.timeout if timeout is None else timeout
        return None if t is None else time.monotonic() + t

    @staticmethod
    def _remaining(deadline: float | None) -> float | None:
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    def _next_delay(self, exc: grpc.RpcError, attempt: int, deadline: float | None, method: str) -> float:
        """Seconds to wait before retrying, or raise GlmImageError when this failure is final.

        A refusal that names a wait (a quota's retry_after) is retried no earlier than that, plus the jittered
        backoff so tenants refused together come back spread out; earlier it would only be refused again."""
        err = GlmImageError.from_rpc(exc, attempt)
        if err.code not in self.retry.codes or attempt >= self.retry.max_attempts:
            raise err from None
        if err.retry_after is not None and err.retry_after > self.retry.max_retry_after:
            raise err from None
        delay = (err.retry_after or 0.0) + self.retry.backoff(attempt - 1, self._rng)
        remaining = self._remaining(deadline)
        if remaining is not None and delay >= remaining:
            raise err from None  # waiting would overrun the caller's deadline
        # A quota wait (seconds, the caller's own doing) is worth a warning; a busy server's short backoff is not.
        log.log(logging.WARNING if err.quota else logging.INFO, "%s: %s (%s)%s, retry %d/%d in %.2fs", method,
                err.code.name, err.details, f", quota {err.quota}" if err.quota else "", attempt,
                self.retry.max_attempts - 1, delay)
        return delay



def _with_rate_limits(event: Completed, rate_limits: RateLimits) -> Completed:
    return Completed(replace(event.result, rate_limits=rate_limits))


def _stream_ended_early(attempts: int) -> GlmImageError:
    return GlmImageError(grpc.StatusCode.UNKNOWN, "the stream ended without a completed event", attempts)


class Client(JobCalls, _Base):
    """Blocking client for GatewayService. Thread-safe; close it (or use ``with``) to release the channel."""

    _make_channel = staticmethod(sync_channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, rpc: Callable[..., T], request: Any, timeout: float | None,
              request_id: str | None) -> T:
        deadline = self._deadline(timeout)
        metadata = self._metadata(request_id)
        attempt = 0
        while True:
            attempt += 1
            try:
                return rpc(request, timeout=self._remaining(deadline), metadata=metadata)
            except grpc.RpcError as exc:
                time.sleep(self._next_delay(exc, attempt, deadline, method))

    def generate(self, prompt: str, n: int = 1, size: str | Sequence[int] | None = None, *,
                 output_format: str | None = None, output_compression: int | None = None, seed: int | None = None,
                 steps: int | None = None, guidance: float | None = None, step_cache: str | None = None,
                 loras: LoraInput | Sequence[LoraInput] = (), priority: PriorityInput | None = None,
                 timeout: float | None = None, request_id: str | None = None) -> GenerationResult:
        """Generate ``n`` images; ``size`` is ``"WxH"`` or ``(w, h)`` (None: the gateway default). ``loras``:
        adapters the DiT runs with, as `Lora`s or ``"NAME[:SCALE]"`` strings (`list_loras` names them).
        ``priority``: ``interactive``, ``default`` or ``batch``, up to the tenant's max_priority (None: default).
        The result's ``rate_limits`` are the tenant's quotas as the gateway reported them with the call."""
        req = build_request(prompt, n=n, size=size, output_format=output_format,
                            output_compression=output_compression, seed=seed, steps=steps, guidance=guidance,
                            step_cache=step_cache, loras=loras, priority=priority)
        return self._generate(req, timeout, request_id)

    def edit(self, images: ImageInput | Sequence[ImageInput], prompt: str, *, timeout: float | None = None,
             request_id: str | None = None, **options: Unpack[ImageOptions]) -> GenerationResult:
        """Edit: ``n`` images from ``prompt`` and the reference ``images`` (paths, bytes or binary files, sent as
        they are); the other options as for `generate`. Give ``size``: it is the size of the outputs."""
        req = build_request(prompt, images=read_images(images), **options)
        return self._generate(req, timeout, request_id)

    def _generate(self, req: gateway_service_pb2.GenerateImagesRequest, timeout: float | None,
                  request_id: str | None) -> GenerationResult:
        # with_call: the call's initial metadata carries the rate limits.
        resp, call = self._call("GenerateImages", self._stub.GenerateImages.with_call, req, timeout, request_id)
        return GenerationResult.from_proto(resp, RateLimits.from_metadata(call.initial_metadata()))

    def generate_stream(self, prompt: str, n: int = 1, size: str | Sequence[int] | None = None, *,
                        partial_images: int = 0, output_format: str | None = None,
                        output_compression: int | None = None, seed: int | None = None, steps: int | None = None,
                        guidance: float | None = None, step_cache: str | None = None,
                        loras: LoraInput | Sequence[LoraInput] = (), priority: PriorityInput | None = None,
                        timeout: float | None = None, request_id: str | None = None) -> Iterator[StreamEvent]:
        """Yield Progress and PartialImage events, then one Completed. Stopping the iteration cancels the call.

        A failure is retried only before the first event arrives: after that the caller has seen part of the
        stream and a silent restart would replay it.
        """
        req = build_stream_request(prompt, partial_images=partial_images, n=n, size=size, output_format=output_format,
                                   output_compression=output_compression, seed=seed, steps=steps, guidance=guidance,
                                   step_cache=step_cache, loras=loras, priority=priority)
        return self._stream(req, timeout, request_id)

    def edit_stream(self, images: ImageInput | Sequence[ImageInput], prompt: str, *, partial_images: int = 0,
                    timeout: float | None = None, request_id: str | None = None,
                    **options: Unpack[ImageOptions]) -> Iterator[StreamEvent]:
        """`edit` as a stream, with the events of `generate_stream`."""
        req = build_stream_request(prompt, partial_images=partial_images, images=read_images(images), **options)
        return self._stream(req, timeout, request_id)

    def _stream(self, req: gateway_service_pb2.GenerateImagesStreamRequest, timeout: float | None,
                request_id: str | None) -> Iterator[StreamEvent]:
        deadline = self._deadline(timeout)
        metadata = self._metadata(request_id)
        attempt = 0
        while True:
            attempt += 1
            call = self._stub.GenerateImagesStream(req, timeout=self._remaining(deadline), metadata=metadata)
            received = False
            try:
                for msg in call:
                    received = True
                    event = event_from_proto(msg)
                    if isinstance(event, Completed):  # the initial metadata came before any message
                        yield _with_rate_limits(event, RateLimits.from_metadata(call.initial_metadata()))
                        return
                    if event is not None:
                        yield event
                raise _stream_ended_early(attempt)
            except grpc.RpcError as exc:
                if received:
                    raise GlmImageError.from_rpc(exc, attempt) from None
                delay = self._next_delay(exc, attempt, deadline, "GenerateImagesStream")
            finally:
                call.cancel()  # no-op once finished; stops the server's work when the caller breaks early
            time.sleep(delay)

    def status(self, *, timeout: float | None = None) -> Status:
        resp = self._call("GetStatus", self._stub.GetStatus, gateway_service_pb2.GetStatusRequest(), timeout, None)
        return Status.from_proto(resp)

    def limits(self, *, timeout: float | None = None) -> Limits:
        """What the gateway admits: what some worker of each stage can run (the union of their own limits), within
        the gateway's flags."""
        resp = self._call("GetLimits", self._stub.GetLimits, gateway_service_pb2.GetLimitsRequest(), timeout, None)
        return Limits.from_proto(resp.limits)

    def add_worker(self, address: str, role: str, *, timeout: float | None = None) -> None:
        """Add an ``"ar"`` or ``"denoiser"`` worker at run time."""
        req = build_add_worker(address, role)
        self._call("AddWorker", self._stub.AddWorker, req, timeout, None)

    def remove_worker(self, address: str, *, timeout: float | None = None) -> None:
        """Drain and remove a worker."""
        req = gateway_service_pb2.RemoveWorkerRequest(address=address)
        self._call("RemoveWorker", self._stub.RemoveWorker, req, timeout, None)

    def list_loras(self, *, timeout: float | None = None) -> LoraCatalogue:
        """The adapters requests may name; with the admin role also which denoiser holds which loaded."""
        resp = self._call("ListLoras", self._stub.ListLoras, gateway_service_pb2.ListLorasRequest(), timeout, None)
        return LoraCatalogue.from_proto(resp)

    def load_loras(self, names: str | Sequence[str], workers: str | Sequence[str] = (), *,
                   timeout: float | None = None) -> list[LoraPlacement]:
        """Admin role: load adapters on ``workers`` (denoiser addresses; none: every denoiser that takes work) ahead
        of the requests that name them. A denoiser that could not says so in its placement's ``error``."""
        resp = self._call("LoadLoras", self._stub.LoadLoras, build_load_loras(names, workers), timeout, None)
        return placements_from_proto(resp.placement)

    def unload_loras(self, names: str | Sequence[str], workers: str | Sequence[str] = (), *,
                     timeout: float | None = None) -> list[LoraPlacement]:
        """Admin role: drop adapters from the denoisers' memory (the files stay); placements as for `load_loras`."""
        resp = self._call("UnloadLoras", self._stub.UnloadLoras, build_unload_loras(names, workers), timeout, None)
        return placements_from_proto(resp.placement)

class AsyncClient(AsyncJobCalls, _Base):
    """asyncio client for GatewayService (grpc.aio). Create it inside the event loop that uses it."""

    _make_channel = staticmethod(aio_channel)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(self, method: str, rpc: Callable[..., Any], request: Any, timeout: float | None,
                    request_id: str | None) -> Any:
        deadline = self._deadline(timeout)
        metadata = self._metadata(request_id)
        attempt = 0
        while True:
            attempt += 1
            try:
                return await rpc(request, timeout=self._remaining(deadline), metadata=metadata)
            except grpc.RpcError as exc:
                await asyncio.sleep(self._next_delay(exc, attempt, deadline, method))

    async def generate(self, prompt: str, n: int = 1, size: str | Sequence[int] | None = None, *,
                       output_format: str | None = None, output_compression: int | None = None,
                       seed: int | None = None, steps: int | None = None, guidance: float | None = None,
                       step_cache: str | None = None, loras: LoraInput | Sequence[LoraInput] = (),
                       priority: PriorityInput | None = None, timeout: float | None = None,
                       request_id: str | None = None) -> GenerationResult:
        req = build_request(prompt, n=n, size=size, output_format=output_format,
                            output_compression=output_compression, seed=seed, steps=steps, guidance=guidance,
                            step_cache=step_cache, loras=loras, priority=priority)
        return await self._generate(req, timeout, request_id)

    async def edit(self, images: ImageInput | Sequence[ImageInput], prompt: str, *, timeout: float | None = None,
                   request_id: str | None = None, **options: Unpack[ImageOptions]) -> GenerationResult:
        """As `Client.edit`. Paths and files are read before the call, in the event loop's thread."""
        req = build_request(prompt, images=read_images(images), **options)
        return await self._generate(req, timeout, request_id)

    async def _generate(self, req: gateway_service_pb2.GenerateImagesRequest, timeout: float | None,
                        request_id: str | None) -> GenerationResult:
        resp, initial = await self._call("GenerateImages", self._generate_images, req, timeout, request_id)
        return GenerationResult.from_proto(resp, RateLimits.from_metadata(initial))

    async def _generate_images(self, request: gateway_service_pb2.GenerateImagesRequest, *, timeout: float | None,
                               metadata: Sequence[tuple[str, str]]) -> tuple[Any, Any]:
        """GenerateImages, answered with the call's initial metadata (which carries the rate limits)."""
        call = self._stub.GenerateImages(request, timeout=timeout, metadata=metadata)
        return await call, await call.initial_metadata()

    def generate_stream(self, prompt: str, n: int = 1, size: str | Sequence[int] | None = None, *,
                        partial_images: int = 0, output_format: str | None = None,
                        output_compression: int | None = None, seed: int | None = None, steps: int | None = None,
                        guidance: float | None = None, step_cache: str | None = None,
                        loras: LoraInput | Sequence[LoraInput] = (), priority: PriorityInput | None = None,
                        timeout: float | None = None, request_id: str | None = None) -> AsyncIterator[StreamEvent]:
        """As `Client.generate_stream`, as an async iterator."""
        req = build_stream_request(prompt, partial_images=partial_images, n=n, size=size, output_format=output_format,
                                   output_compression=output_compression, seed=seed, steps=steps, guidance=guidance,
                                   step_cache=step_cache, loras=loras, priority=priority)
        return self._stream(req, timeout, request_id)

    def edit_stream(self, images: ImageInput | Sequence[ImageInput], prompt: str, *, partial_images: int = 0,
                    timeout: float | None = None, request_id: str | None = None,
                    **options: Unpack[ImageOptions]) -> AsyncIterator[StreamEvent]:
        """As `Client.edit_stream`, as an async iterator."""
        req = build_stream_request(prompt, partial_images=partial_images, images=read_images(images), **options)
        return self._stream(req, timeout, request_id)

    async def _stream(self, req: gateway_service_pb2.GenerateImagesStreamRequest, timeout: float | None,
                      request_id: str | None) -> AsyncIterator[StreamEvent]:
        deadline = self._deadline(timeout)
        metadata = self._metadata(request_id)
        attempt = 0
        while True:
            attempt += 1
            call = self._stub.GenerateImagesStream(req, timeout=self._remaining(deadline), metadata=metadata)
            received = False
            try:
                async for msg in call:
                    received = True
                    event = event_from_proto(msg)
                    if isinstance(event, Completed):
                        yield _with_rate_limits(event, RateLimits.from_metadata(await call.initial_metadata()))
                        return
                    if event is not None:
                        yield event
                raise _stream_ended_early(attempt)
            except grpc.RpcError as exc:
                if received:
                    raise GlmImageError.from_rpc(exc, attempt) from None
                delay = self._next_delay(exc, attempt, deadline, "GenerateImagesStream")
            finally:
                call.cancel()
            await asyncio.sleep(delay)

    async def status(self, *, timeout: float | None = None) -> Status:
        resp = await self._call("GetStatus", self._stub.GetStatus, gateway_service_pb2.GetStatusRequest(),
                                timeout, None)
        return Status.from_proto(resp)

    async def limits(self, *, timeout: float | None = None) -> Limits:
        resp = await self._call("GetLimits", self._stub.GetLimits, gateway_service_pb2.GetLimitsRequest(),
                                timeout, None)
        return Limits.from_proto(resp.limits)

    async def add_worker(self, address: str, role: str, *, timeout: float | None = None) -> None:
        req = build_add_worker(address, role)
        await self._call("AddWorker", self._stub.AddWorker, req, timeout, None)

    async def remove_worker(self, address: str, *, timeout: float | None = None) -> None:
        req = gateway_service_pb2.RemoveWorkerRequest(address=address)
        await self._call("RemoveWorker", self._stub.RemoveWorker, req, timeout, None)

    async def list_loras(self, *, timeout: float | None = None) -> LoraCatalogue:
        resp = await self._call("ListLoras", self._stub.ListLoras, gateway_service_pb2.ListLorasRequest(),
                                timeout, None)
        return LoraCatalogue.from_proto(resp)

    async def load_loras(self, names: str | Sequence[str], workers: str | Sequence[str] = (), *,
                         timeout: float | None = None) -> list[LoraPlacement]:
        resp = await self._call("LoadLoras", self._stub.LoadLoras, build_load_loras(names, workers), timeout, None)
        return placements_from_proto(resp.placement)

    async def unload_loras(self, names: str | Sequence[str], workers: str | Sequence[str] = (), *,
                           timeout: float | None = None) -> list[LoraPlacement]:
        resp = await self._call("UnloadLoras", self._stub.UnloadLoras, build_unload_loras(names, workers),
                                timeout, None)
        return placements_from_proto(resp.placement)
