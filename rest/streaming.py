"""`stream: true`: GenerateImagesStream messages -> OpenAI image-generation (or image-edit) server-sent events."""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
from fastapi.responses import Response
from starlette.types import Receive

from glmimage.v1 import common_pb2, gateway_service_pb2

from . import sse
from .errors import APIError
from .metrics import RestMetrics
from .middleware import OUTCOME_STATUS_KEY
from .ratelimits import rate_limit_headers
from .settings import RestSettings
from .translate import FORMAT_NAMES, Generation, usage_json
from .upstream import CallGuard, GatewayGone, Gateways, Resubmissions, unanswered

log = logging.getLogger("glmimage.rest")

ERROR_EVENT = "error"


def _completed_events(
    resp: gateway_service_pb2.GenerateImagesResponse, gen: Generation, settings: RestSettings
) -> list[bytes]:
    """One completed event per image, each with that image's usage, so the events add up to the request's."""
    echo = gen.echo(gen.size(resp.width, resp.height), FORMAT_NAMES.get(resp.output_format, gen.output_format))
    per_image = all(img.HasField("usage") for img in resp.images)
    completed = f"{gen.events}.completed"
    events = []
    for i, img in enumerate(resp.images):
        if per_image:
            usage = usage_json(img.usage, 1, settings.enable_cache_report)
        else:  # a gateway without per-image usage: the whole bill on the last event keeps the sum right
            last = i == len(resp.images) - 1
            usage = usage_json(resp.usage if last else common_pb2.Usage(), len(resp.images) if last else 0,
                               settings.enable_cache_report)
        events.append(sse.event(completed, {
            "type": completed,
            "b64_json": base64.b64encode(img.image).decode("ascii"),
            "created_at": int(time.time()),
            **echo,
            "usage": usage,
            "image_index": img.index,  # extension: which of the n images this is
            **({"step_cache_note": img.step_cache_note} if img.step_cache_note else {}),
        }))
    return events


def _gone_mid_stream() -> APIError:
    return APIError(503, "the gateway went away mid-stream and no other gateway could run the request; retry",
                    type="server_error", code="gateway_unavailable")


def _incomplete() -> APIError:
    return APIError(502, "the gateway stream ended without a result", type="server_error", code="incomplete_stream")


def _error_event(err: APIError) -> bytes:
    # The openai SDK raises APIError for any event whose data has an "error" object.
    body = {"message": err.message, "type": err.type, "param": err.param, "code": err.code}
    return sse.event(ERROR_EVENT, {"type": ERROR_EVENT, "error": body})


@dataclass
class _Resume:
    """How a stream already relaying is run again, from the start, on another gateway when its gateway goes away
    (UNAVAILABLE: it exited, or its connection broke), once: the client sees its progress and partial images
    again, then the one completed result."""

    attempts: Resubmissions
    request: gateway_service_pb2.GenerateImagesStreamRequest
    receive: Receive
    left: int = 1

    async def again(self, gen: Generation) -> tuple[CallGuard, Any] | None:
        """The new call's guard and first message, or None when it may not be resumed (again)."""
        while self.left > 0:
            self.left -= 1
            try:
                gateway = await self.attempts.__anext__()
            except StopAsyncIteration:
                return None
            log.warning("%s gateway went away mid-stream; running the request again from the start on another "
                        "gateway", gen.rid)
            await gateway.connected()
            call = gateway.stub.GenerateImagesStream(self.request, metadata=gen.metadata,
                                                     timeout=self.attempts.remaining())
            guard = CallGuard(call, self.receive, gen.rid, resubmit=False)
            try:
                return guard, await guard.wait(call.read())
            except BaseException:
                guard.close()
                raise
        return None


async def _stream_events(
    guard: CallGuard,
    first: gateway_service_pb2.GenerateImagesStreamResponse,
    gen: Generation,
    settings: RestSettings,
    metrics: RestMetrics,
    state: dict[str, Any],
    resume: _Resume | None = None,
) -> AsyncIterator[bytes]:
    """GenerateImagesStream messages -> OpenAI image events. Progress becomes SSE comments
    (OpenAI has no progress event; comments are ignored by clients and keep proxies from timing out)."""
    call: grpc.aio.UnaryStreamCall = guard.call  # type: ignore[assignment]
    partial = f"{gen.events}.partial_image"
    partial_echo = gen.echo(gen.size(), gen.output_format)
    msg: Any = first
    try:
        while msg is not None and msg is not grpc.aio.EOF:
            kind = msg.WhichOneof("event")
            if kind == "progress":
                p = msg.progress
                yield sse.comment(f"progress image={p.image_index} step={p.step}/{p.total_steps}")
            elif kind == "partial_image":
                part = msg.partial_image
                yield sse.event(partial, {
                    "type": partial,
                    "b64_json": base64.b64encode(part.image).decode("ascii"),
                    "created_at": int(time.time()),
                    **partial_echo,
                    "partial_image_index": part.partial_image_index,
                    "image_index": part.image_index,  # extension, as on the completed event
                })
            elif kind == "completed":
                metrics.images.inc(len(msg.completed.images))
                for chunk in _completed_events(msg.completed, gen, settings):
                    yield chunk
                log.info("%s stream done: %d image(s), %d+%d tokens", gen.rid, len(msg.completed.images),
                         msg.completed.usage.prompt_tokens, msg.completed.usage.completion_tokens)
                return
            try:
                msg = await guard.wait(call.read())
            except GatewayGone:  # (only while guard.resubmit: the first call, with a resume left)
                guard.close()
                again = await resume.again(gen) if resume is not None else None
                if again is None:
                    raise _gone_mid_stream() from None
                guard, msg = again
                call = guard.call  # type: ignore[assignment]
        if msg is None:
            log.info("%s client disconnected mid-stream; gateway call cancelled", gen.rid)
            state[OUTCOME_STATUS_KEY] = 499
            return
        log.warning("%s gateway stream ended without a result", gen.rid)
        raise _incomplete()
    except APIError as err:
        log.info("%s stream failed: %d %s", gen.rid, err.status, err.message)
        state[OUTCOME_STATUS_KEY] = err.status  # the 200 went out before the failure: count the failure
        yield _error_event(err)
    except (asyncio.CancelledError, GeneratorExit):
        state.setdefault(OUTCOME_STATUS_KEY, 499)  # closed before its end (the send failed): the client is gone
        raise
    finally:
        guard.close()


async def stream(
    gateways: Gateways, gen: Generation, settings: RestSettings, metrics: RestMetrics, receive: Receive,
    state: dict[str, Any],
) -> Response:
    req = gateway_service_pb2.GenerateImagesStreamRequest(request=gen.request, partial_images=gen.partial_images)
    # Resubmitted to the next gateway while nothing was relayed; once relaying, a gateway that goes away
    # (UNAVAILABLE) has the request run again from the start on another, once (_Resume); any other failure after
    # the first event is the client's (an error event).
    gone: GatewayGone | None = None
    attempts = Resubmissions(gateways, gen.rid, settings.request_timeout)
    async for gateway in attempts:
        await gateway.connected()
        call = gateway.stub.GenerateImagesStream(req, metadata=gen.metadata, timeout=attempts.remaining())
        guard = CallGuard(call, receive, gen.rid, resubmit=True)
        try:
            # Wait for the first message before committing to a 200, so that errors the gateway reports at once
            # (bad input, queue full, bad key, no streaming support) keep their HTTP status.
            first = await guard.wait(call.read())
        except GatewayGone as exc:
            guard.close()
            gone = exc
            continue
        except BaseException:
            guard.close()
            raise
        break
    else:
        raise unanswered(gone, gen.rid) from gone.err if gone else None
    if first is None:
        guard.close()
        log.info("%s client disconnected; gateway call cancelled", gen.rid)
        return Response(status_code=499)
    if first is grpc.aio.EOF:
        guard.close()
        raise _incomplete()
    # The initial metadata (the tenant's rate-limit figures) came before the first message: the response's headers.
    headers = rate_limit_headers(await call.initial_metadata())
    resume = _Resume(attempts, req, receive)
    return sse.EventStreamResponse(_stream_events(guard, first, gen, settings, metrics, state, resume),
                                   headers=headers)
