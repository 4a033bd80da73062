"""Jobs on REST: `Prefer: respond-async` (RFC 7240) on the image routes answers 202 with the job and its Location;
`/v1/images/jobs` reads, lists and cancels them. Every call is JobService on a gateway (the front keeps no job
state: any front answers for any job), with the caller's key, so a job is seen only by its own tenant: any other key
gets 404, never 403."""
from __future__ import annotations

import logging
import re
import uuid
from typing import Annotated, Any

import grpc
from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response

from gateway.jobs.render import STATUS_VALUES, job_json
from glmimage.v1 import job_service_pb2

from . import dispatch, translate, upstream
from .deps import GatewayDep, Settings
from .errors import APIError, from_rpc_error
from .middleware import request_id
from .schemas import ErrorResponse
from .settings import RestSettings

log = logging.getLogger("glmimage.rest")

router = APIRouter()

JOBS_PATH = "/v1/images/jobs"
IDEMPOTENCY_HEADER = "idempotency-key"
_TOKEN_RE = re.compile(r"\s*([!#$%&'*+.^_`|~0-9A-Za-z-]+)")


def preferences(request: Request) -> set[str]:
    """The preference names of every Prefer header, lower-cased (RFC 7240: `name [= value] *(; param)`, several
    comma-separated; a value may be a quoted string, in which a comma or a name is no preference of its own)."""
    found = set()
    for header in request.headers.getlist("prefer"):
        for item in _split_outside_quotes(header):
            if m := _TOKEN_RE.match(item):
                found.add(m.group(1).lower())
    return found


def _split_outside_quotes(header: str) -> list[str]:
    items, current, quoted, escaped = [], [], False, False
    for ch in header:
        if escaped:
            escaped = False
        elif quoted and ch == "\\":
            escaped = True
        elif ch == '"':
            quoted = not quoted
        elif ch == "," and not quoted:
            items.append("".join(current))
            current = []
            continue
        current.append(ch)
    items.append("".join(current))
    return items


def wants_async(request: Request) -> bool:
    return "respond-async" in preferences(request)


def _base(request: Request) -> str:
    return str(request.base_url)


async def _call(gateways: upstream.Gateways, method: str, message: Any, metadata, timeout: float,
                rid: str) -> Any:
    """One JobService call, on the next gateway that answers: every gateway reads the same store, so a call that
    fails UNAVAILABLE before any answer goes to the next one."""
    last: grpc.aio.AioRpcError | None = None
    for gateway in gateways.attempts():
        if gateway.jobs is None:
            continue
        await gateway.connected()
        try:
            return await getattr(gateway.jobs, method)(message, timeout=timeout, metadata=metadata)
        except grpc.aio.AioRpcError as err:
            if err.code() is not grpc.StatusCode.UNAVAILABLE:
                raise from_rpc_error(err, rid) from None
            last = err
    assert last is not None
    raise from_rpc_error(last, rid) from None


def _job_response(job: job_service_pb2.Job, request: Request, settings: RestSettings, status: int = 200,
                  headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(job_json(job, _base(request), settings.enable_cache_report), status_code=status,
                        headers=headers)


async def submit(gen: translate.Generation, request: Request, settings: RestSettings,
                 gateways: upstream.Gateways) -> Response:
    """The admitted request as a job: 202 once the gateway has written it to the job store."""
    if gen.stream:
        raise APIError(400, "stream cannot be used with Prefer: respond-async: a job is read with GET "
                       f"{JOBS_PATH}/{{id}}", param="stream", code="invalid_value")
    # The client's key, else one of this call's own: _call sends a submit that failed UNAVAILABLE to the next
    # gateway, and the first may have written the job before its answer was lost; the key makes that one job.
    key = request.headers.get(IDEMPOTENCY_HEADER, "") or f"rest-{uuid.uuid4().hex}"
    submit_request = job_service_pb2.SubmitJobRequest(request=gen.request, webhook_url=gen.webhook_url,
                                                      idempotency_key=key)
    reply = await _call(gateways, "SubmitJob", submit_request, gen.metadata, settings.request_timeout, gen.rid)
    job = reply.job
    log.info("%s accepted as job %s", gen.rid, job.id)
    return _job_response(job, request, settings, 202, {"Location": f"{JOBS_PATH}/{job.id}",
                                                       "Preference-Applied": "respond-async"})


def _metadata(request: Request, settings: RestSettings) -> tuple[tuple[str, str], ...]:
    return dispatch.gateway_metadata(request, settings, request_id(request))


@router.get(JOBS_PATH, summary="The caller's jobs, newest first",
            responses={400: {"model": ErrorResponse}, 401: {"model": ErrorResponse}})
async def list_jobs(request: Request, settings: Settings, gateways: GatewayDep,
                    limit: Annotated[int, Query(ge=1, le=100)] = 20, after: str | None = None,
                    status: str | None = None) -> Response:
    if status is not None and status not in STATUS_VALUES:
        raise APIError(400, f"status must be one of {', '.join(STATUS_VALUES)}", param="status",
                       code="invalid_value")
    message = job_service_pb2.ListJobsRequest(limit=limit, after=after or "",
                                              status=STATUS_VALUES.get(status or "", 0))
    reply = await _call(gateways, "ListJobs", message, _metadata(request, settings), settings.request_timeout,
                        request_id(request))
    base = _base(request)
    data = [job_json(job, base, settings.enable_cache_report) for job in reply.jobs]
    return JSONResponse({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                         "last_id": data[-1]["id"] if data else None, "has_more": reply.has_more})


@router.get(JOBS_PATH + "/{job_id}", summary="A job: its status, progress, and when done its images or error",
            responses={404: {"model": ErrorResponse}})
async def get_job(job_id: str, request: Request, settings: Settings, gateways: GatewayDep) -> Response:
    reply = await _call(gateways, "GetJob", job_service_pb2.GetJobRequest(id=job_id), _metadata(request, settings),
                        settings.request_timeout, request_id(request))
    return _job_response(reply.job, request, settings)


@router.post(JOBS_PATH + "/{job_id}/cancel", summary="Cancel a job (a running one frees its denoisers at once)",
             responses={404: {"model": ErrorResponse}})
async def cancel_job(job_id: str, request: Request, settings: Settings, gateways: GatewayDep) -> Response:
    reply = await _call(gateways, "CancelJob", job_service_pb2.CancelJobRequest(id=job_id),
                        _metadata(request, settings), settings.request_timeout, request_id(request))
    return _job_response(reply.job, request, settings)


@router.get("/v1/webhooks/secret", summary="The caller's tenant's webhook signing secret (Standard Webhooks)")
async def webhook_secret(request: Request, settings: Settings, gateways: GatewayDep) -> Response:
    reply = await _call(gateways, "GetWebhookSecret", job_service_pb2.GetWebhookSecretRequest(),
                        _metadata(request, settings), settings.request_timeout, request_id(request))
    return JSONResponse({"object": "webhook_secret", "secret": reply.secret})
