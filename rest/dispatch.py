"""What every image route does with an admitted request (translate.Generation): the gateway call's metadata
(request id, and the client's or this front's key), the call itself, and the answer as JSON or as server-sent
events, with the call's rate-limit figures as headers (rest/ratelimits.py)."""

from __future__ import annotations

import logging
import re

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from gateway.jobs.render import absolute
from runtime.auth import bearer_metadata
from runtime.tracing import with_trace

from . import jobs, streaming, translate, upstream
from .errors import APIError
from .metrics import RestMetrics
from .middleware import REQUEST_ID_HEADER
from .settings import RestSettings

log = logging.getLogger("glmimage.rest")

_HEADER_VALUE_RE = re.compile(r"[\x20-\x7e]{1,8192}")


def gateway_metadata(request: Request, settings: RestSettings, rid: str) -> tuple[tuple[str, str], ...]:
    """The request id, the traceparent of this front's span (with traces on), and the key the gateway sees
    (settings.gateway_auth)."""
    metadata: tuple[tuple[str, str], ...] = with_trace(((REQUEST_ID_HEADER, rid),))
    if settings.gateway_auth == "own":  # the gateway sees this front's key; the client's stays here
        return metadata + bearer_metadata(settings.gateway_api_key)
    # Forwarded whether or not REST checks keys itself: the gateway may enforce its own. A repeated one is not
    # forwarded, as no key check on any hop accepts one (runtime.auth).
    authorization = request.headers.getlist("authorization")
    if len(authorization) == 1 and _HEADER_VALUE_RE.fullmatch(authorization[0]):
        metadata += (("authorization", authorization[0]),)
    return metadata


async def answer(gen: translate.Generation, request: Request, settings: RestSettings, metrics: RestMetrics,
                 gateway: upstream.Gateways) -> Response:
    """Run the gateway call for ``gen``: a job when the client prefers an asynchronous answer (202), events when it
    streams, else one ImagesResponse JSON (499 when the client went away first)."""
    if jobs.wants_async(request):
        return await jobs.submit(gen, request, settings, gateway)
    if gen.webhook_url:
        raise APIError(400, "webhook_url needs the header 'Prefer: respond-async': a webhook reports a job's end",
                       param="webhook_url", code="invalid_value")
    if gen.stream:
        return await streaming.stream(gateway, gen, settings, metrics, request.receive, request.scope["state"])
    reply = await upstream.generate(gateway, gen, settings.request_timeout, request.receive)
    if reply is None:
        log.info("%s client disconnected; gateway call cancelled", gen.rid)
        return Response(status_code=499)
    resp = reply.response
    metrics.images.inc(len(resp.images))
    result = translate.images_json(resp, gen, settings)
    for item in result["data"]:  # links the gateway made relative (it has no --public-url): this front's
        if "url" in item:
            item["url"] = absolute(item["url"], str(request.base_url))
    log.info("%s done: %d image(s), %d+%d tokens", gen.rid, len(resp.images),
             resp.usage.prompt_tokens, resp.usage.completion_tokens)
    return JSONResponse(result, headers=reply.headers)
