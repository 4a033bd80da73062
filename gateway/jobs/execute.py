"""A job's request run on this gateway's scheduler: the admission and driver call GenerateImages makes, with the
tenant's in-flight bound (its rates were charged when the job was accepted) and progress reported as it goes.

Knows the driver and the tenants, nothing of the job store: the runner (gateway.jobs.runner) decides what an
outcome means for the job."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.downstream import StreamOptions
from gateway.driver import Driver
from gateway.scheduler import types as sch
from gateway.servicer import response_of
from gateway.tenancy import TenantGate, Usage, priority_of
from glmimage.v1 import denoiser_service_pb2, gateway_service_pb2
from runtime.admission import Admitted, check_generate
from runtime.errors import ErrorKind, ServiceError
from runtime.tenants import Tenant, TenantsFile

log = logging.getLogger(__name__)

# What a job waits out instead of failing: no ready worker of a stage (a restart of the pool, a stage scaled to zero),
# a full queue, or the tenant's in-flight bound. The runner gives the job back to the store to be tried again after a
# backoff, up to the job's deadline.
TRANSIENT = frozenset({ErrorKind.UNAVAILABLE, ErrorKind.RESOURCE_EXHAUSTED})

Progress = Callable[[int, int], None]  # (steps done over all images, total steps)


@dataclass(frozen=True)
class Failure:
    kind: ErrorKind
    message: str
    field: str = ""
    retry_after: float | None = None  # a transient failure's own hint (a quota window)

    @property
    def code(self) -> str:
        """The gRPC status code's name ("INVALID_ARGUMENT"): what a synchronous call would have got."""
        return self.kind.name

    @property
    def transient(self) -> bool:
        return self.kind in TRANSIENT


@dataclass
class _Steps:
    """Per image the highest step seen (a retried denoise job starts again from step 1: progress never goes back)."""
    total_per_image: int
    n: int
    done: dict[int, int] = field(default_factory=dict)

    def see(self, index: int, step: int, total: int) -> bool:
        if total:
            self.total_per_image = total
        if step <= self.done.get(index, 0):
            return False
        self.done[index] = step
        return True

    @property
    def figures(self) -> tuple[int, int]:
        return sum(self.done.values()), self.total_per_image * self.n


class JobExecutor:
    def __init__(self, driver: Driver, gate: TenantGate, tenants: TenantsFile, default_height: int,
                 default_width: int) -> None:
        self.driver = driver
        self.gate = gate
        self.tenants = tenants
        self.default_height = default_height
        self.default_width = default_width

    def ready(self) -> bool:
        """Whether both stages have a worker that could take work now: a runner takes no job before (a restarted
        gateway would otherwise fail-fast what it takes while its workers are still starting)."""
        return self.driver.ready()

    def tenant(self, name: str) -> Tenant:
        """The job's tenant as the tenants file says now (its weight, quotas); one removed since keeps its name."""
        return self.tenants.current.by_name.get(name) or Tenant(name)

    def check(self, request: gateway_service_pb2.GenerateImagesRequest) -> Admitted:
        return check_generate(request, self.driver.members.limits(), default_height=self.default_height,
                              default_width=self.default_width,
                              known_loras=self.driver.members.lora_catalogue() if request.loras else None)

    async def run(self, request: gateway_service_pb2.GenerateImagesRequest, tenant_name: str, timeout: float,
                  progress: Progress) -> gateway_service_pb2.GenerateImagesResponse | Failure:
        """The job's images (with their bytes), or why not. Cancelling the awaiting task cancels the request
        downstream, as a disconnect does."""
        tenant = self.tenant(tenant_name)
        try:
            admitted = self.check(request)
            priority = priority_of(request.priority, tenant)
            ticket = await self.gate.admit_run(tenant, admitted.n)
        except ServiceError as exc:
            return Failure(exc.kind, exc.message, exc.field or "", exc.retry_after)
        steps = _Steps(request.num_inference_steps, admitted.n)

        def relay(index: int, message: denoiser_service_pb2.DenoiseStreamResponse) -> None:
            if message.WhichOneof("event") == "progress" and steps.see(index, message.progress.step,
                                                                       message.progress.total_steps):
                progress(*steps.figures)

        outcome = None
        try:
            outcome = await self.driver.generate(request.request_id, admitted, timeout,
                                                 stream=StreamOptions(partial_images=0, relay=relay),
                                                 tenant=tenant.name, weight=tenant.weight, priority=priority)
        except asyncio.CancelledError:
            ticket.end(ErrorKind.CANCELLED.value)
            raise
        if isinstance(outcome, sch.RequestError):
            ticket.end(outcome.kind.value)
            return Failure(outcome.kind, outcome.message, outcome.field or "")
        ticket.end("ok", Usage.of(admitted.width, admitted.height, [img.steps_completed for img in outcome.images],
                                  sum(p.usage.prompt_tokens for p in outcome.priors),
                                  sum(p.usage.completion_tokens for p in outcome.priors)))
        return response_of(outcome, admitted, request.request_id)
