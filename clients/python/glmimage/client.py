"""Python clients for GatewayService: `Client` (blocking) and `AsyncClient` (asyncio).

Only grpcio and protobuf are needed. Both clients share the same options:

- ``timeout``: an overall deadline per call in seconds, retries and backoff included;
- ``retry``: exponential backoff with jitter, on UNAVAILABLE and RESOURCE_EXHAUSTED only (the two codes that mean
  "try again later"; anything else would fail the same way again, or must not be repeated);
- ``tls``: server CA and optional client certificate for mutual TLS;
- ``api_key``: sent as ``authorization: Bearer <key>`` metadata.

    >>> with Client("127.0.0.1:50050") as client:
    ...     result = client.generate("a red STOP sign", n=2, size="256x256", seed=1)
    ...     result.save("out/")
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc

from glmimage._keepalive import CHANNEL_OPTIONS
from glmimage.v1 import common_pb2, gateway_service_pb2, gateway_service_pb2_grpc

log = logging.getLogger(__name__)

DEFAULT_ADDRESS = "127.0.0.1:50050"
RETRYABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})
# Ten large PNGs in one reply exceed grpc's 4 MiB default by far.
DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024

FORMATS = {"png": common_pb2.IMAGE_FORMAT_PNG, "jpeg": common_pb2.IMAGE_FORMAT_JPEG,
           "webp": common_pb2.IMAGE_FORMAT_WEBP}
_FORMAT_NAMES = {v: k for k, v in FORMATS.items()} | {common_pb2.IMAGE_FORMAT_UNSPECIFIED: "png"}
_EXTENSIONS = {"png": "png", "jpeg": "jpg", "webp": "webp"}
_ROLE_NAMES = {gateway_service_pb2.WORKER_ROLE_AR: "ar", gateway_service_pb2.WORKER_ROLE_DENOISER: "denoiser"}
_ROLES = {v: k for k, v in _ROLE_NAMES.items()}
_STATE_NAMES = {gateway_service_pb2.WORKER_STATE_AVAILABLE: "available", gateway_service_pb2.WORKER_STATE_BUSY: "busy",
                gateway_service_pb2.WORKER_STATE_UNHEALTHY: "unhealthy",
                gateway_service_pb2.WORKER_STATE_DRAINING: "draining"}

T = TypeVar("T")


class GlmImageError(Exception):
    """A call failed; ``code`` is the final gRPC status, ``attempts`` how many calls were made."""

    def __init__(self, code: grpc.StatusCode, details: str, attempts: int = 1) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.attempts = attempts


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

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if not 0.0 <= self.jitter <= 1.0:
            raise ValueError("jitter must be between 0 and 1")
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


@dataclass(frozen=True)
class TlsConfig:
    """TLS settings. PEM bytes; no ``root_ca`` means the system trust store. Give both cert and key for mTLS."""

    root_ca: bytes | None = None
    client_cert: bytes | None = None
    client_key: bytes | None = None
    # Expected server name when it differs from the address host (e.g. connecting through an IP).
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.client_cert is None) != (self.client_key is None):
            raise ValueError("give both client_cert and client_key, or neither")

    @classmethod
    def from_files(cls, root_ca: str | Path | None = None, client_cert: str | Path | None = None,
                   client_key: str | Path | None = None, server_name: str | None = None) -> TlsConfig:
        def read(p: str | Path | None) -> bytes | None:
            return Path(p).read_bytes() if p else None

        return cls(read(root_ca), read(client_cert), read(client_key), server_name)

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.root_ca, self.client_key, self.client_cert)


# --- results -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    reasoning_tokens: int = 0
    cached_tokens: int = 0

    @classmethod
    def from_proto(cls, u: common_pb2.Usage) -> Usage:
        return cls(u.prompt_tokens, u.completion_tokens, u.total_tokens, u.reasoning_tokens, u.cached_tokens)

    def as_dict(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.total_tokens, "reasoning_tokens": self.reasoning_tokens,
                "cached_tokens": self.cached_tokens}


@dataclass(frozen=True)
class GenerationResult:
    """Images in output order (encoded bytes), the seed of each, per-image and summed usage."""

    images: list[bytes]
    seeds: list[int]
    usage: Usage
    image_usages: list[Usage]
    width: int
    height: int
    output_format: str
    request_id: str = ""

    @classmethod
    def from_proto(cls, r: gateway_service_pb2.GenerateImagesResponse) -> GenerationResult:
        ordered = sorted(r.images, key=lambda im: im.index)
        return cls(images=[im.image for im in ordered], seeds=[im.seed for im in ordered],
                   usage=Usage.from_proto(r.usage), image_usages=[Usage.from_proto(im.usage) for im in ordered],
                   width=r.width, height=r.height, output_format=_FORMAT_NAMES.get(r.output_format, "png"),
                   request_id=r.request_id)

    @property
    def extension(self) -> str:
        return _EXTENSIONS.get(self.output_format, self.output_format)

    def save(self, directory: str | Path, stem: str = "image") -> list[Path]:
        """Write ``<stem>-<i>.<ext>`` into ``directory`` (created if missing); returns the paths."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        paths = []
        for i, data in enumerate(self.images):
            path = out / f"{stem}-{i}.{self.extension}"
            path.write_bytes(data)
            paths.append(path)
        return paths


@dataclass(frozen=True)
class Progress:
    """A denoising step finished for one image."""

    image_index: int
    step: int
    total_steps: int


@dataclass(frozen=True)
class PartialImage:
    """A preview of one image part-way through denoising."""

    image_index: int
    partial_image_index: int
    image: bytes


@dataclass(frozen=True)
class Completed:
    """The last event of a successful stream."""

    result: GenerationResult


StreamEvent = Progress | PartialImage | Completed


@dataclass(frozen=True)
class WorkerInfo:
    address: str
    role: str  # "ar" or "denoiser"
    state: str  # "available", "busy", "unhealthy", "draining"
    inflight: int
    current_job: str
    health: str = ""  # why it is (not) usable: "serving", "unreachable", "not answering health checks (hung)", ...
    stuck: bool = False  # connected but making no progress (hung, or a call to it timed out), not gone


@dataclass(frozen=True)
class Status:
    pending_ar_requests: int
    pending_ar_outputs: int
    pending_denoise_outputs: int
    active_requests: int
    workers: list[WorkerInfo] = field(default_factory=list)

    @classmethod
    def from_proto(cls, s: gateway_service_pb2.GetStatusResponse) -> Status:
        return cls(s.pending_ar_requests, s.pending_ar_outputs, s.pending_denoise_outputs, s.active_requests,
                   [WorkerInfo(w.address, _ROLE_NAMES.get(w.role, "unspecified"),
                               _STATE_NAMES.get(w.state, "unspecified"), w.inflight, w.current_job, w.health,
                               w.stuck)
                    for w in s.workers])


def _event(msg: gateway_service_pb2.GenerateImagesStreamResponse) -> StreamEvent | None:
    kind = msg.WhichOneof("event")
    if kind == "progress":
        p = msg.progress
        return Progress(p.image_index, p.step, p.total_steps)
    if kind == "partial_image":
        p = msg.partial_image
        return PartialImage(p.image_index, p.partial_image_index, p.image)
    if kind == "completed":
        return Completed(GenerationResult.from_proto(msg.completed))
    return None  # an event kind newer than this client: skip it rather than fail


# --- request building ----------------------------------------------------------------------------------------------


def parse_size(size: str | Sequence[int] | None) -> tuple[int, int]:
    """``"WxH"`` or ``(w, h)`` -> (width, height); None -> (0, 0), the gateway default."""
    if size is None:
        return 0, 0
    if isinstance(size, str):
        w, sep, h = size.lower().partition("x")
        if not sep or not w.strip().isdigit() or not h.strip().isdigit():
            raise ValueError(f"size must look like 512x512, got {size!r}")
        return int(w), int(h)
    width, height = size
    return int(width), int(height)


def build_request(prompt: str, *, n: int = 1, size: str | Sequence[int] | None = None,
                  output_format: str | None = None, output_compression: int | None = None,
                  seed: int | None = None, steps: int | None = None, guidance: float | None = None,
                  request_id: str = "") -> gateway_service_pb2.GenerateImagesRequest:
    width, height = parse_size(size)
    fmt = common_pb2.IMAGE_FORMAT_UNSPECIFIED
    if output_format is not None:
        try:
            fmt = FORMATS[output_format.lower()]
        except KeyError:
            raise ValueError(f"output_format must be one of {sorted(FORMATS)}, got {output_format!r}") from None
    req = gateway_service_pb2.GenerateImagesRequest(prompt=prompt, n=n, height=height, width=width,
                                                    output_format=fmt, num_inference_steps=steps or 0,
                                                    request_id=request_id)
    if output_compression is not None:
        req.output_compression = output_compression
    if seed is not None:
        req.seed = seed
    if guidance is not None:
        req.guidance_scale = guidance
    return req


def build_stream_request(prompt: str, *, partial_images: int = 0, **fields: Any
                         ) -> gateway_service_pb2.GenerateImagesStreamRequest:
    return gateway_service_pb2.GenerateImagesStreamRequest(request=build_request(prompt, **fields),
                                                           partial_images=partial_images)


def build_add_worker(address: str, role: str) -> gateway_service_pb2.AddWorkerRequest:
    if role not in _ROLES:
        raise ValueError(f"role must be one of {sorted(_ROLES)}, got {role!r}")
    return gateway_service_pb2.AddWorkerRequest(address=address, role=_ROLES[role])


class _Base:
    """What both clients share: channel arguments, metadata, deadlines and the retry decision."""

    def __init__(self, address: str, *, api_key: str | None, tls: TlsConfig | None, timeout: float | None,
                 retry: RetryPolicy, max_message_bytes: int, options: Sequence[tuple[str, Any]],
                 rng: random.Random | None) -> None:
        self.address = address
        self.api_key = api_key
        self.tls = tls
        self.timeout = timeout
        self.retry = retry
        self._rng = rng or random.Random()
        # Keepalive the gateway accepts and a short capped reconnect backoff (see glmimage._keepalive); the
        # caller's ``options`` come last, so they override.
        opts: list[tuple[str, Any]] = [("grpc.max_receive_message_length", max_message_bytes),
                                       ("grpc.max_send_message_length", max_message_bytes),
                                       *CHANNEL_OPTIONS]
        if tls is not None and tls.server_name:
            opts.append(("grpc.ssl_target_name_override", tls.server_name))
        self._options = [*opts, *options]

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
        """Seconds to wait before retrying, or raise GlmImageError when this failure is final."""
        code = exc.code()
        details = exc.details() or ""
        if code not in self.retry.codes or attempt >= self.retry.max_attempts:
            raise GlmImageError(code, details, attempt) from None
        delay = self.retry.backoff(attempt - 1, self._rng)
        remaining = self._remaining(deadline)
        if remaining is not None and delay >= remaining:
            raise GlmImageError(code, details, attempt) from None  # waiting would overrun the caller's deadline
        log.info("%s: %s (%s), retry %d/%d in %.2fs", method, code.name, details, attempt,
                 self.retry.max_attempts - 1, delay)
        return delay


def _stream_ended_early(attempts: int) -> GlmImageError:
    return GlmImageError(grpc.StatusCode.UNKNOWN, "the stream ended without a completed event", attempts)


class Client(_Base):
    """Blocking client for GatewayService. Thread-safe; close it (or use ``with``) to release the channel."""

    def __init__(self, address: str = DEFAULT_ADDRESS, *, api_key: str | None = None, tls: TlsConfig | None = None,
                 timeout: float | None = None, retry: RetryPolicy = DEFAULT_RETRY,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, options: Sequence[tuple[str, Any]] = (),
                 rng: random.Random | None = None) -> None:
        super().__init__(address, api_key=api_key, tls=tls, timeout=timeout, retry=retry,
                         max_message_bytes=max_message_bytes, options=options, rng=rng)
        if tls is None:
            self._channel = grpc.insecure_channel(address, options=self._options)
        else:
            self._channel = grpc.secure_channel(address, tls.credentials(), options=self._options)
        self._stub = gateway_service_pb2_grpc.GatewayServiceStub(self._channel)

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
                 steps: int | None = None, guidance: float | None = None, timeout: float | None = None,
                 request_id: str | None = None) -> GenerationResult:
        """Generate ``n`` images; ``size`` is ``"WxH"`` or ``(w, h)`` (None: the gateway default)."""
        req = build_request(prompt, n=n, size=size, output_format=output_format,
                            output_compression=output_compression, seed=seed, steps=steps, guidance=guidance)
        resp = self._call("GenerateImages", self._stub.GenerateImages, req, timeout, request_id)
        return GenerationResult.from_proto(resp)

    def generate_stream(self, prompt: str, n: int = 1, size: str | Sequence[int] | None = None, *,
                        partial_images: int = 0, output_format: str | None = None,
                        output_compression: int | None = None, seed: int | None = None, steps: int | None = None,
                        guidance: float | None = None, timeout: float | None = None,
                        request_id: str | None = None) -> Iterator[StreamEvent]:
        """Yield Progress and PartialImage events, then one Completed. Stopping the iteration cancels the call.

        A failure is retried only before the first event arrives: after that the caller has seen part of the
        stream and a silent restart would replay it.
        """
        req = build_stream_request(prompt, partial_images=partial_images, n=n, size=size, output_format=output_format,
                                   output_compression=output_compression, seed=seed, steps=steps, guidance=guidance)
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
                    event = _event(msg)
                    if event is not None:
                        yield event
                    if isinstance(event, Completed):
                        return
                raise _stream_ended_early(attempt)
            except grpc.RpcError as exc:
                if received:
                    raise GlmImageError(exc.code(), exc.details() or "", attempt) from None
                delay = self._next_delay(exc, attempt, deadline, "GenerateImagesStream")
            finally:
                call.cancel()  # no-op once finished; stops the server's work when the caller breaks early
            time.sleep(delay)

    def status(self, *, timeout: float | None = None) -> Status:
        resp = self._call("GetStatus", self._stub.GetStatus, gateway_service_pb2.GetStatusRequest(), timeout, None)
        return Status.from_proto(resp)

    def add_worker(self, address: str, role: str, *, timeout: float | None = None) -> None:
        """Add an ``"ar"`` or ``"denoiser"`` worker at run time."""
        req = build_add_worker(address, role)
        self._call("AddWorker", self._stub.AddWorker, req, timeout, None)

    def remove_worker(self, address: str, *, timeout: float | None = None) -> None:
        """Drain and remove a worker."""
        req = gateway_service_pb2.RemoveWorkerRequest(address=address)
        self._call("RemoveWorker", self._stub.RemoveWorker, req, timeout, None)


class AsyncClient(_Base):
    """asyncio client for GatewayService (grpc.aio). Create it inside the event loop that uses it."""

    def __init__(self, address: str = DEFAULT_ADDRESS, *, api_key: str | None = None, tls: TlsConfig | None = None,
                 timeout: float | None = None, retry: RetryPolicy = DEFAULT_RETRY,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, options: Sequence[tuple[str, Any]] = (),
                 rng: random.Random | None = None) -> None:
        super().__init__(address, api_key=api_key, tls=tls, timeout=timeout, retry=retry,
                         max_message_bytes=max_message_bytes, options=options, rng=rng)
        if tls is None:
            self._channel = grpc.aio.insecure_channel(address, options=self._options)
        else:
            self._channel = grpc.aio.secure_channel(address, tls.credentials(), options=self._options)
        self._stub = gateway_service_pb2_grpc.GatewayServiceStub(self._channel)

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
                       timeout: float | None = None, request_id: str | None = None) -> GenerationResult:
        req = build_request(prompt, n=n, size=size, output_format=output_format,
                            output_compression=output_compression, seed=seed, steps=steps, guidance=guidance)
        resp = await self._call("GenerateImages", self._stub.GenerateImages, req, timeout, request_id)
        return GenerationResult.from_proto(resp)

    async def generate_stream(self, prompt: str, n: int = 1, size: str | Sequence[int] | None = None, *,
                              partial_images: int = 0, output_format: str | None = None,
                              output_compression: int | None = None, seed: int | None = None,
                              steps: int | None = None, guidance: float | None = None, timeout: float | None = None,
                              request_id: str | None = None) -> AsyncIterator[StreamEvent]:
        """As `Client.generate_stream`, as an async iterator."""
        req = build_stream_request(prompt, partial_images=partial_images, n=n, size=size, output_format=output_format,
                                   output_compression=output_compression, seed=seed, steps=steps, guidance=guidance)
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
                    event = _event(msg)
                    if event is not None:
                        yield event
                    if isinstance(event, Completed):
                        return
                raise _stream_ended_early(attempt)
            except grpc.RpcError as exc:
                if received:
                    raise GlmImageError(exc.code(), exc.details() or "", attempt) from None
                delay = self._next_delay(exc, attempt, deadline, "GenerateImagesStream")
            finally:
                call.cancel()
            await asyncio.sleep(delay)

    async def status(self, *, timeout: float | None = None) -> Status:
        resp = await self._call("GetStatus", self._stub.GetStatus, gateway_service_pb2.GetStatusRequest(),
                                timeout, None)
        return Status.from_proto(resp)

    async def add_worker(self, address: str, role: str, *, timeout: float | None = None) -> None:
        req = build_add_worker(address, role)
        await self._call("AddWorker", self._stub.AddWorker, req, timeout, None)

    async def remove_worker(self, address: str, *, timeout: float | None = None) -> None:
        req = gateway_service_pb2.RemoveWorkerRequest(address=address)
        await self._call("RemoveWorker", self._stub.RemoveWorker, req, timeout, None)
