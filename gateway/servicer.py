"""GatewayService over gRPC: validate at the edge, hand the request to the driver, shape the reply.

Usage is carried as the AR reports it, ``cached_tokens`` included; hiding it unless asked
(``--enable-cache-report``) is the REST front's rule, not this service's.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

import grpc

from gateway.auth import ADMIN, GatewayAuth
from gateway.compat import gateway_build
from gateway.config import GatewayConfig
from gateway.driver import Driver, Outcome, StreamOptions
from gateway.jobs.images import ImageStoreUnavailable
from gateway.jobs.keeper import ImageKeeper
from gateway.jobs.store import StoreUnavailable
from gateway.loras import PoolLoras, check_names, pick_workers
from gateway.membership import WorkerAddress, allowed, parse_worker_address, split_host_port
from gateway.quota_store import LocalStore
from gateway.quotas import Quotas
from gateway.scheduler import types as sch
from gateway.stream_relay import StreamRelay
from gateway.tenancy import PRIORITY_TO_PROTO, TenantGate, Ticket, Usage, priority_of, quota_of
from gateway.workers import Platform, WorkerHealth
from glmimage.v1 import common_pb2, gateway_service_pb2, gateway_service_pb2_grpc
from runtime.admission import Admitted, check_generate, check_partial_images
from runtime.capability import Needs
from runtime.errors import InvalidArgument, ServiceError, Unavailable, error_for
from runtime.limits import Limits
from runtime.logs import request_id_var
from runtime.tenants import Tenant, TenantsFile, tenants_from_keys

log = logging.getLogger(__name__)

DEADLINE_SLACK_S = 0.1

STATE_TO_PROTO = {
    sch.WorkerState.AVAILABLE: gateway_service_pb2.WORKER_STATE_AVAILABLE,
    sch.WorkerState.BUSY: gateway_service_pb2.WORKER_STATE_BUSY,
    sch.WorkerState.UNHEALTHY: gateway_service_pb2.WORKER_STATE_UNHEALTHY,
    sch.WorkerState.DRAINING: gateway_service_pb2.WORKER_STATE_DRAINING,
}
ROLE_TO_PROTO = {sch.WorkerRole.AR: gateway_service_pb2.WORKER_ROLE_AR,
                 sch.WorkerRole.DENOISER: gateway_service_pb2.WORKER_ROLE_DENOISER}
ROLE_FROM_PROTO = {v: k for k, v in ROLE_TO_PROTO.items()}


_USAGE_FIELDS = tuple(f.name for f in common_pb2.Usage.DESCRIPTOR.fields)


def sum_usage(usages) -> common_pb2.Usage:
    """Every counter of Usage summed: a field added to the message is summed too, never dropped."""
    total = common_pb2.Usage()
    for u in usages:
        for name in _USAGE_FIELDS:
            setattr(total, name, getattr(total, name) + getattr(u, name))
    return total


def response_of(outcome: Outcome, admitted: Admitted, request_id: str) -> gateway_service_pb2.GenerateImagesResponse:
    """A finished generation as GenerateImages answers it (a job's result is the same message)."""
    images = [gateway_service_pb2.GeneratedImage(index=i, image=img.image, seed=prior.seed, usage=prior.usage,
                                                 steps_cached=img.steps_cached, step_cache_note=img.step_cache_note)
              for i, (img, prior) in enumerate(zip(outcome.images, outcome.priors, strict=True))]
    log.info("completed %d image(s) at %dx%d", len(images), admitted.width, admitted.height)
    return gateway_service_pb2.GenerateImagesResponse(
        images=images, usage=sum_usage(p.usage for p in outcome.priors), height=admitted.height,
        width=admitted.width, output_format=outcome.images[0].output_format, request_id=request_id)


_RESPONSE_FORMATS = frozenset(gateway_service_pb2.ResponseFormat.values())


async def _kept(call):
    """An image or job store call whose failure is the caller's UNAVAILABLE (retry later)."""
    try:
        return await call
    except (StoreUnavailable, ImageStoreUnavailable) as exc:
        log.warning("image keeping unavailable: %s", exc)
        raise Unavailable("the image store is unavailable; try again shortly, or ask for bytes") from None


def job_label(job: sch.JobId | None) -> str:
    return f"{job.request_id}/{job.index}#{job.attempt}" if job else ""


def status_error(error: sch.RequestError) -> ServiceError:
    """The scheduler's error as the call's status (the error interceptor sends it): the one place a failed
    request becomes gRPC. Its operator_note stays in the gateway's log."""
    return error_for(error.kind, error.message, error.field)


def check_address(address: str) -> str:
    try:
        split_host_port(address)
    except ValueError as exc:
        raise InvalidArgument("address", str(exc)) from None
    return address.strip()


def check_worker_address(address: str) -> WorkerAddress:
    """The strict form AddWorker accepts (see membership.parse_worker_address); INVALID_ARGUMENT naming the field."""
    try:
        return parse_worker_address(address)
    except ValueError as exc:
        raise InvalidArgument("address", str(exc)) from None


class GatewayServicer(gateway_service_pb2_grpc.GatewayServiceServicer):
    def __init__(self, driver: Driver, config: GatewayConfig, tenants: TenantsFile | None = None,
                 gate: TenantGate | None = None, auth: GatewayAuth | None = None,
                 keeper: ImageKeeper | None = None) -> None:
        self.driver = driver
        self.keeper = keeper  # response_format url: where images are kept (none: refused)
        self.config = config
        # Who is calling: the tenants in force (the file, reloaded on SIGHUP, or the key flags), read by the same
        # GatewayAuth the server installs. Whether the call may go ahead at all is the installed interceptor's
        # business; here the tenant decides the request's share, priority, quotas and what GetStatus shows.
        self.tenants = tenants or TenantsFile(None, tenants_from_keys(config.api_keys, config.admin_keys))
        self._auth = auth or GatewayAuth(self.tenants)
        self.gate = gate or TenantGate(Quotas(LocalStore()), driver.observe.metrics)
        if self.gate.metrics is not None:  # (python -m gateway tells it again after each reload)
            self.gate.metrics.tenants(self.tenants.current.by_name)
        self.loras = PoolLoras(driver.members.denoisers, config.worker_metadata)

    @property
    def _keyless(self) -> bool:
        """No key configured at all: authentication is off and callers cannot be told apart (everyone may do
        everything a user may); GetStatus then shows everything to everyone, as before."""
        return self.tenants.current.open

    def _timeout(self, context: grpc.aio.ServicerContext) -> float:
        remaining = context.time_remaining()
        return self.config.request_timeout if remaining is None else min(self.config.request_timeout, remaining)

    @staticmethod
    def _expired(context: grpc.aio.ServicerContext) -> Callable[[], bool]:
        """Whether a cancelled call was ended by its deadline: its client reads DEADLINE_EXCEEDED, and so should
        the gateway's outcome. gRPC tells the server only that the call was cancelled, and the client's deadline
        passes a little before the server's copy of it (counted from the call's arrival): a cancel within
        DEADLINE_SLACK_S of the deadline is the deadline."""
        return lambda: (remaining := context.time_remaining()) is not None and remaining <= DEADLINE_SLACK_S

    def _tenant(self, context: grpc.aio.ServicerContext) -> Tenant:
        """The calling tenant (the interceptor has let the call through, so there is one: on a gateway without user
        keys, `default`)."""
        tenant = self._auth.caller(context.invocation_metadata())
        if tenant is None:  # an admin-only method's caller cannot get here; kept safe all the same
            tenant = self.tenants.current.by_name.get("default") or Tenant("default")
        return tenant

    async def _admit(self, request: gateway_service_pb2.GenerateImagesRequest, context: grpc.aio.ServicerContext,
                     limits: Limits, partial_images: int = 0) -> tuple[Admitted, Ticket, int]:
        """The request's fields, its tenant's priority and quotas, in that order: a bad request counts against no
        quota. The ticket's rate-limit figures go out as the call's initial metadata."""
        tenant = self._tenant(context)
        admitted = self._check(request, limits, partial_images)
        priority = priority_of(request.priority, tenant)
        if request.response_format not in _RESPONSE_FORMATS:
            raise InvalidArgument("response_format", f"unknown response format {request.response_format}; use "
                                                     "RESPONSE_FORMAT_BYTES or RESPONSE_FORMAT_URL")
        if request.response_format == gateway_service_pb2.RESPONSE_FORMAT_URL:
            if self.keeper is None:
                raise InvalidArgument("response_format", "this gateway keeps no images: ask for bytes")
            await _kept(self.keeper.check_room(tenant, time.time()))
        ticket = await self.gate.admit(tenant, admitted.n)
        if ticket.headers:
            try:
                await context.send_initial_metadata(ticket.headers)
            except BaseException:  # (the caller went away meanwhile): the ticket is ended on this way out too
                ticket.end(sch.ErrorKind.CANCELLED.value)
                raise
        return admitted, ticket, priority

    def _generate(self, admitted: Admitted, ticket: Ticket, priority: int, context: grpc.aio.ServicerContext,
                  stream: StreamOptions | None = None):
        tenant = ticket.tenant
        return self.driver.generate(request_id_var.get(), admitted, self._timeout(context), stream=stream,
                                    expired=self._expired(context), tenant=tenant.name, weight=tenant.weight,
                                    priority=priority)

    def _ended(self, ticket: Ticket, outcome: Outcome | sch.RequestError | None, admitted: Admitted) -> None:
        """Every way out of a generation: the tenant's in-flight images freed, its outcome and usage counted."""
        if outcome is None:
            ticket.end(sch.ErrorKind.CANCELLED.value)
        elif isinstance(outcome, sch.RequestError):
            ticket.end(outcome.kind.value)
        else:
            ticket.end("ok", Usage.of(admitted.width, admitted.height, [img.steps_completed for img in outcome.images],
                                      sum(p.usage.prompt_tokens for p in outcome.priors),
                                      sum(p.usage.completion_tokens for p in outcome.priors)))

    async def GenerateImages(self, request, context: grpc.aio.ServicerContext):
        admitted, ticket, priority = await self._admit(request, context, self.driver.members.limits())
        outcome = None
        try:
            outcome = await self._generate(admitted, ticket, priority, context)
        except asyncio.CancelledError:
            log.info("client went away; request cancelled downstream")
            raise
        finally:
            self._ended(ticket, outcome, admitted)
        if isinstance(outcome, sch.RequestError):
            raise status_error(outcome)
        response = response_of(outcome, admitted, request_id_var.get())
        if request.response_format == gateway_service_pb2.RESPONSE_FORMAT_URL and self.keeper is not None:
            response = await _kept(self._keep(ticket.tenant.name, response))
        return response

    async def _keep(self, tenant: str, response: gateway_service_pb2.GenerateImagesResponse
                    ) -> gateway_service_pb2.GenerateImagesResponse:
        """response_format url: the images stored, counted against the tenant, answered as links."""
        now = time.time()
        stored, objects = await self.keeper.keep(tenant, response, now)
        await self.keeper.store.record_objects(objects)
        return self.keeper.present(stored, now, now + self.keeper.job_ttl)

    async def GenerateImagesStream(self, request, context: grpc.aio.ServicerContext
                                   ) -> AsyncIterator[gateway_service_pb2.GenerateImagesStreamResponse]:
        limits = self.driver.members.limits()
        check_partial_images(request.partial_images, limits)
        admitted, ticket, priority = await self._admit(request.request, context, limits, request.partial_images)
        relay = StreamRelay()
        outcome = None
        try:
            task = asyncio.ensure_future(self._generate(
                admitted, ticket, priority, context,
                StreamOptions(partial_images=request.partial_images, relay=relay.relay)))
            task.add_done_callback(lambda _: relay.end())
            # A client that goes away while this generator is parked at a yield does not cancel the generator's
            # frame, so the call's own end cancels the request too.
            context.add_done_callback(lambda _: task.cancel())
            try:
                async for event in relay.events():
                    yield event
                outcome = task.result()
            except asyncio.CancelledError:
                log.info("client went away; request cancelled downstream")
                raise
            finally:
                task.cancel()  # a no-op once done
        finally:
            self._ended(ticket, outcome, admitted)
        if isinstance(outcome, sch.RequestError):
            raise status_error(outcome)
        completed = response_of(outcome, admitted, request_id_var.get())  # (a stream's images are bytes)
        yield gateway_service_pb2.GenerateImagesStreamResponse(completed=completed)

    def _check(self, request: gateway_service_pb2.GenerateImagesRequest, limits: Limits,
               partial_images: int = 0) -> Admitted:
        """Within what the pool can do (``limits``: the union of its workers'), and run whole by one worker of each
        stage (``Members.capable``): else INVALID_ARGUMENT naming the field, before any quota is charged."""
        admitted = check_generate(request, limits, default_height=self.config.default_height,
                                  default_width=self.config.default_width,
                                  known_loras=self.driver.members.lora_catalogue() if request.loras else None)
        if (why := self.driver.members.capable(Needs.of(admitted, partial_images))) is not None:
            raise why
        return admitted

    async def GetLimits(self, request, context: grpc.aio.ServicerContext):
        """What the pool can do: the union of its workers' limits, within the gateway's flags (Members.limits)."""
        return gateway_service_pb2.GetLimitsResponse(limits=self.driver.members.limits().to_proto())

    async def GetStatus(self, request, context: grpc.aio.ServicerContext):
        """The queues and the pool. The workers' addresses, what they said and every request's id are the admin
        role's to see: any other caller gets the pool by position, role, state and health, and the ids of its own
        requests only (those it made with the same key)."""
        snap = self.driver.snapshot()
        caller = self._auth.caller(context.invocation_metadata())
        full = self._keyless or (caller is not None and caller.holds(ADMIN))

        def shown(job: sch.JobId | None) -> str:
            mine = (job is not None and caller is not None and not self.tenants.current.open_users
                    and self.driver.request_tenant(job.request_id) == caller.name)
            return job_label(job) if full or mine else ""

        workers = []
        for w in snap.workers:
            health = self.driver.members.health(w.address)
            # (Only while it runs a job, as the scheduler sees it: the stream may say a step of a job just ended.)
            step, total_steps = self.driver.members.progress(w.address) if w.inflight or w.held_elsewhere else (0, 0)
            platform = self.driver.members.platform(w.address) if full else Platform()
            workers.append(gateway_service_pb2.WorkerStatus(
                address=w.address if full else "", role=ROLE_TO_PROTO[w.role], state=STATE_TO_PROTO[w.state],
                inflight=w.inflight, current_job=shown(w.current_job), health=health.value, stuck=health.stuck,
                held_elsewhere=w.held_elsewhere, loras_loaded=sorted(w.loras), step=step, total_steps=total_steps,
                health_detail=self.driver.members.health_detail(w.address) if full else "",
                incompatible=health is WorkerHealth.INCOMPATIBLE,
                build=self.driver.members.build(w.address) if full else None, device=platform.device,
                compiled_sizes=[common_pb2.ImageSize(width=width, height=height)
                                for height, width in platform.compiled_sizes]))
        return gateway_service_pb2.GetStatusResponse(
            pending_ar_requests=snap.pending_ar_requests, pending_ar_outputs=snap.pending_ar_outputs,
            pending_denoise_outputs=snap.pending_denoise_outputs, active_requests=snap.active_requests,
            workers=workers, tenants=await self._tenant_status(snap, full, caller),
            gateway_build=gateway_build() if full else None)

    async def _tenant_status(self, snap: sch.Snapshot, full: bool, caller: Tenant | None
                       ) -> list[gateway_service_pb2.TenantStatus]:
        """Every tenant in force, with the admin role; else the caller's own tenant only."""
        seen = {t.name: t for t in getattr(snap, "tenants", ())}
        tenants = self.tenants.current.by_name
        if full:
            names = list(dict.fromkeys((*tenants, *seen)))
        else:
            names = [caller.name] if caller is not None else []
        rows = []
        for name in names:
            tenant = tenants.get(name) or (caller if caller is not None and caller.name == name else Tenant(name))
            queued = seen.get(name)
            remaining_requests, remaining_images, inflight = await self.gate.quotas.snapshot(name, quota_of(tenant))
            rows.append(gateway_service_pb2.TenantStatus(
                name=name, weight=tenant.weight, max_priority=PRIORITY_TO_PROTO[tenant.max_priority],
                pending_ar_requests=queued.pending_ar_requests if queued else 0,
                pending_denoise_outputs=queued.pending_denoise_outputs if queued else 0,
                active_requests=queued.active_requests if queued else 0,
                inflight_images=queued.active_outputs if queued else inflight,
                oldest_wait_seconds=queued.oldest_wait if queued else 0.0,
                requests_total=self.gate.requests_total.get(name, 0), images_total=self.gate.images_total.get(name, 0),
                requests_per_minute=tenant.requests_per_minute or 0, images_per_minute=tenant.images_per_minute or 0,
                max_inflight_images=tenant.max_inflight_images or 0,
                remaining_requests=remaining_requests or 0, remaining_images=remaining_images or 0))
        return rows

    async def AddWorker(self, request, context: grpc.aio.ServicerContext):
        # Who may call this is the interceptor's business (gateway.auth); what may be added is checked here, all of
        # it before anything is dialled.
        parsed = check_worker_address(request.address)
        address = parsed.target
        role = ROLE_FROM_PROTO.get(request.role)
        if role is None:
            raise InvalidArgument("role", "must be WORKER_ROLE_AR or WORKER_ROLE_DENOISER")
        if not self.config.worker_allow:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                "address: AddWorker accepts no address on this gateway: start it with --worker-allow "
                                "PATTERN (host glob or CIDR, optional port) to say which it may add")
        if (rule := allowed(parsed, self.config.worker_allow)) is None:
            log.warning("admin: AddWorker %s refused: outside --worker-allow", address)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"address: {address} matches no --worker-allow pattern of this gateway")
        known = self.driver.members.role(address)
        if known is not None and known is not role:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                f"address: {address} is already a {known.value.lower()} worker; remove it first")
        # The same worker dialled another way (tls:// or plaintext://, or neither) would be two members sending
        # it two jobs at once.
        if (other := next((a for a in parsed.spellings if a != address and self.driver.members.role(a)), None)):
            await context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                f"address: {address} is already a worker as {other}; remove it first")
        if known is None and len(self.driver.members) >= self.config.max_workers:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"the pool is full: it holds {len(self.driver.members)} workers, the most "
                                f"--max-workers={self.config.max_workers} allows; remove one first")
        self.driver.add_worker(address, role)
        log.info("admin: added %s worker %s (allowed by %s)", role.value.lower(), address, rule.text)
        return gateway_service_pb2.AddWorkerResponse()

    async def RemoveWorker(self, request, context: grpc.aio.ServicerContext):
        address = check_address(request.address)
        try:  # an AddWorker'd worker is listed under its canonical form ("Host:050061" -> "host:50061")
            canonical = parse_worker_address(address).target
        except ValueError:
            canonical = address
        if not self.driver.remove_worker(address) and not self.driver.remove_worker(canonical):
            # Echoed bounded: a status message travels in a header, and gRPC refuses ones past 16 KiB.
            shown = address if len(address) <= 300 else f"{address[:300]}... ({len(address)} characters)"
            await context.abort(grpc.StatusCode.NOT_FOUND, f"address: {shown} is not a worker of this gateway")
        log.info("admin: removed worker %s (draining)", address)
        return gateway_service_pb2.RemoveWorkerResponse()

    async def ListLoras(self, request, context: grpc.aio.ServicerContext):
        """The adapters requests may name, from the denoisers' listings re-read now; for the admin role (or on a
        gateway that checks no keys) also what each denoiser holds loaded."""
        placement = await self.loras.listing()
        full = self._keyless or self._auth.caller(context.invocation_metadata()).holds(ADMIN)
        return gateway_service_pb2.ListLorasResponse(loras=list(self.driver.members.lora_catalogue().values()),
                                                     placement=placement if full else [])

    async def LoadLoras(self, request, context: grpc.aio.ServicerContext):
        await self.loras.listing()  # a file just added to the adapter directory may be named at once
        check_names(request.names, self.driver.members.limits(), self.driver.members.lora_catalogue())
        workers = pick_workers(request.workers, self.driver.members.denoisers())
        placement = await self.loras.load(list(request.names), workers, self._timeout(context))
        return gateway_service_pb2.LoadLorasResponse(placement=placement)

    async def UnloadLoras(self, request, context: grpc.aio.ServicerContext):
        check_names(request.names, None, None)
        workers = pick_workers(request.workers, self.driver.members.denoisers())
        placement = await self.loras.load(list(request.names), workers, self._timeout(context), unload=True)
        return gateway_service_pb2.UnloadLorasResponse(placement=placement)
