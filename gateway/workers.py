"""The members of the gateway's pool: a channel and stub per worker, and the watch that follows its health.

Health is followed with grpc.health.v1 Watch plus periodic probes beside it: a hung (SIGSTOPped) process keeps its
connection and its Watch open but silent, so only unanswered probes reveal it. What the watch learns reaches the
scheduler as WorkerHealthy / WorkerUnhealthy / WorkerNotServing events through the driver's feed.
"""
from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.compat import incompatibility
from gateway.config import GatewayConfig
from gateway.scheduler import types as sch
from glmimage.v1 import ar_service_pb2, ar_service_pb2_grpc, common_pb2, denoiser_service_pb2, denoiser_service_pb2_grpc
from runtime import keepalive
from runtime.capability import Capabilities
from runtime.limits import advertised
from runtime.logs import spawn
from runtime.tls import make_channel

log = logging.getLogger("gateway.driver")

@dataclass(frozen=True)
class Platform:
    """What a worker runs on, as its GetLimits said: kept per worker and shown in GetStatus (admin role only). No
    placement follows it (a job of a size not warmed up compiles once, on whichever denoiser it runs)."""

    device: str = ""  # "cpu", "cuda:0", ...; "srt": an AR whose model another server runs; "": not said
    compiled_sizes: tuple[tuple[int, int], ...] = ()  # a denoiser with --compile: the (height, width) warmed up

    @classmethod
    def of(cls, reply: ar_service_pb2.ArServiceGetLimitsResponse | denoiser_service_pb2.DenoiserServiceGetLimitsResponse
           ) -> Platform:
        sizes = getattr(reply, "compiled_sizes", ())  # (an AR's reply has none)
        return cls(reply.device, tuple((size.height, size.width) for size in sizes))

    def __str__(self) -> str:
        sizes = ",".join(f"{width}x{height}" for height, width in self.compiled_sizes)
        return (self.device or "a device it does not say") + (f", compiled for {sizes}" if sizes else "")


class Feed(Protocol):
    """The driver's way in to the scheduler. ``quiet``: publish nothing unless the event caused actions."""

    def __call__(self, event: sch.Event, quiet: bool = False) -> None: ...

AR_SERVICE = ar_service_pb2.DESCRIPTOR.services_by_name["ArService"].full_name
DENOISER_SERVICE = denoiser_service_pb2.DESCRIPTOR.services_by_name["DenoiserService"].full_name
# This hop's own channel arguments. make_channel adds the shared keepalive (its pings find a worker whose node
# vanished without closing the connection: the health Watch then breaks and the worker is marked unhealthy) and the
# short capped reconnect backoff (a restarted worker is reached within about a second): glmimage.wire.keepalive, and
# how they agree with what the workers accept, runtime.keepalive.
CHANNEL_OPTIONS = keepalive.message_size_options(64 * 1024 * 1024, 64 * 1024 * 1024)


class WorkerHealth(enum.Enum):
    """Why a member is (not) usable, as the gateway last saw it: shown in GetStatus and /health."""

    UNKNOWN = "not yet checked"
    SERVING = "serving"
    NOT_SERVING = "not serving (draining)"
    UNREACHABLE = "unreachable"
    HUNG = "not answering health checks (hung)"
    TIMED_OUT = "a call to it timed out"
    # Its health is open, so it looks serving, but it refuses every call that needs the internal token: a wrong
    # token file, or a rotation half done (see docs/operating.md, the internal token).
    CREDENTIAL_REFUSED = "refuses the gateway's credential"
    # It speaks no contract revision this gateway does (gateway.compat): its GetLimits said so.
    INCOMPATIBLE = "speaks no contract revision this gateway does (incompatible)"

    @property
    def held_back(self) -> bool:
        """It answers, yet gets no work until a fresh check of it passes (what health_detail says is why)."""
        return self in (WorkerHealth.CREDENTIAL_REFUSED, WorkerHealth.INCOMPATIBLE)

    @property
    def stuck(self) -> bool:
        """Connected but not answering: the process is there and holds its work, yet makes no progress."""
        return self in (WorkerHealth.HUNG, WorkerHealth.TIMED_OUT)

    @property
    def down(self) -> sch.WorkerDown:
        """Why it takes no work, in the scheduler's terms (what the client's message says)."""
        if self is WorkerHealth.CREDENTIAL_REFUSED:
            return sch.WorkerDown.CREDENTIAL_REFUSED
        if self is WorkerHealth.INCOMPATIBLE:
            return sch.WorkerDown.INCOMPATIBLE
        if self is WorkerHealth.TIMED_OUT:
            return sch.WorkerDown.TIMED_OUT
        return sch.WorkerDown.HUNG if self is WorkerHealth.HUNG else sch.WorkerDown.GONE


# A worker's refusal of the gateway's credential: the only codes our workers answer for a bad or missing token.
CREDENTIAL_CODES = frozenset({grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED})
_DETAIL_CHARS = 300  # of a worker's text, kept for GetStatus and the log


def refusal(err: grpc.aio.AioRpcError) -> str:
    """A worker's refusal of the credential as GetStatus (health_detail) and the log show it: code and text."""
    return f"{err.code().name}: {(err.details() or '')[:_DETAIL_CHARS]}"


class _NotServing(Exception):
    """A health probe answered, but not SERVING."""


class _CredentialRefused(Exception):
    """The check with the gateway's credential (GetLimits) was refused; the message is the worker's answer."""


class _Incompatible(Exception):
    """Its GetLimits named contract revisions this gateway does not speak; the message says which."""


class Worker:
    """One member of the pool: its channel and stub, and its health as a watch of its own follows it."""

    def __init__(self, address: str, role: sch.WorkerRole, config: GatewayConfig) -> None:
        self.address = address
        self.role = role
        self.channel = make_channel(address, config.client_tls, CHANNEL_OPTIONS)
        self.config = config
        self.watch_task: asyncio.Task | None = None
        self.occupancy_task: asyncio.Task | None = None  # denoisers: follows who holds the slot
        self.health = WorkerHealth.UNKNOWN
        # What the worker said, when that says more than ``health`` (its refusal of the credential); else "".
        self.health_detail = ""
        # Why the scheduler was last told it is down (WorkerUnhealthy.why); None since it was last told healthy.
        self._told: sch.WorkerDown | None = None
        self.checked = asyncio.Event()  # its first health check has an answer, whichever
        # The bounds it applies, as its GetLimits last said (read each time it comes up, before it gets work: a
        # restarted worker may run with other flags); None until then.
        self.limits: dict[str, float] | None = None
        # Its release and contract revisions, as that GetLimits said (empty: it said none, an older release).
        self.build = common_pb2.BuildInfo()
        self.platform = Platform()  # what it runs on, as that GetLimits said
        self._on_limits: Callable[[], None] = lambda: None
        # Denoisers: the adapters of its adapter directory by name, as its ListLoras last said (read with its limits,
        # and again at each GatewayService.ListLoras); None until then. What admission knows adapter names from, and
        # with ``limits`` what the scheduler places its jobs by (capabilities()).
        self.loras: dict[str, common_pb2.LoraInfo] | None = None
        # Denoisers: the steps done of the job holding its slot, and of how many, as its occupancy stream says.
        self.progress: tuple[int, int] = (0, 0)
        if role is sch.WorkerRole.AR:
            self.stub = ar_service_pb2_grpc.ArServiceStub(self.channel)
            self.service = AR_SERVICE
            self._limits_request = ar_service_pb2.ArServiceGetLimitsRequest
        else:
            self.stub = denoiser_service_pb2_grpc.DenoiserServiceStub(self.channel)
            self.service = DENOISER_SERVICE
            self._limits_request = denoiser_service_pb2.DenoiserServiceGetLimitsRequest

    def capabilities(self) -> Capabilities:
        """What it can run, as its GetLimits (and a denoiser's ListLoras) last said (the defaults before then)."""
        return Capabilities.of(self.role.value, self.limits or {}, frozenset(self.loras or ()))

    def watch(self, feed: Feed, closed: Callable[[], bool], on_limits: Callable[[], None] = lambda: None) -> None:
        """Start following its health; every change reaches the scheduler through ``feed``, and a change of its
        limits calls ``on_limits``."""
        self._feed, self._closed, self._on_limits = feed, closed, on_limits
        self.watch_task = spawn(self._watch(feed, closed), name=f"health:{self.address}")
        if self.role is sch.WorkerRole.DENOISER:
            self.occupancy_task = spawn(self._follow_occupancy(feed, closed), name=f"occupancy:{self.address}")

    def tasks(self) -> list[asyncio.Task]:
        """The watches it runs, to cancel when it leaves the pool or the gateway closes."""
        return [t for t in (self.watch_task, self.occupancy_task) if t is not None]

    async def _follow_occupancy(self, feed: Feed, closed: Callable[[], bool]) -> None:
        """Mirror who holds the denoiser's slot: a job another gateway sent makes it busy here too, so this gateway
        does not send it a job it would refuse. Its own jobs it follows itself. If the stream breaks, the denoiser
        counts as free again (a refusal, sent elsewhere at once, corrects that) until the stream is back."""
        cfg = self.config
        backoff = cfg.health_retry_min
        while not closed():
            elsewhere = False  # what this stream last told the scheduler
            told: int | None = None  # the sequence of the state it last told
            try:
                call = self.stub.WatchOccupancy(denoiser_service_pb2.WatchOccupancyRequest(),
                                                metadata=cfg.worker_metadata)
                async for state in call:
                    backoff = cfg.health_retry_min
                    self.progress = (state.step, state.total_steps) if state.busy else (0, 0)
                    if state.sequence == told:
                        continue  # a step of the same job: for GetStatus only, nothing for the scheduler
                    told = state.sequence
                    now_elsewhere = state.busy and state.owner != cfg.instance_id
                    # Every state goes in (its sequence orders the busy refusals against it), but free after free
                    # (this gateway's own jobs coming and going) changes nothing to publish.
                    feed(sch.DenoiserOccupancy(now=time.monotonic(), worker=self.address, elsewhere=now_elsewhere,
                                               sequence=state.sequence, loras=frozenset(state.loras_loaded)),
                         quiet=not (now_elsewhere or elsewhere))
                    elsewhere = now_elsewhere
            except grpc.aio.AioRpcError as err:
                if err.code() is grpc.StatusCode.UNIMPLEMENTED:
                    # An older denoiser: its busy refusals still send the job elsewhere at once, that is all.
                    log.warning("denoiser %s has no WatchOccupancy; jobs of other gateways show only as refusals",
                                self.address)
                    return
                if err.code() in CREDENTIAL_CODES:
                    # The health watch's check with the same token marks it (it gets no work meanwhile): say it
                    # once, and ask again only as often as that check does.
                    level = logging.DEBUG if self.health is WorkerHealth.CREDENTIAL_REFUSED else logging.WARNING
                    log.log(level, "denoiser %s refused its occupancy stream: %s", self.address, err.code().name)
                    backoff = max(backoff, cfg.credential_recheck_interval)
            except Exception:  # noqa: BLE001 - like the health watch: the mirror must outlive any surprise
                log.exception("occupancy stream of %s failed unexpectedly", self.address)
            self.progress = (0, 0)
            if elsewhere:
                feed(sch.DenoiserOccupancy(now=time.monotonic(), worker=self.address, elsewhere=False))
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, cfg.health_retry_max)

    def sideline(self, why: WorkerHealth, detail: str = "") -> None:
        """Unhealthy now (a call to it failed, or refused the credential: ``detail`` is what it said), until a
        fresh health check answers: the watch starts over, after --credential-recheck-interval for a refusal (a
        worker that passes the check yet refuses the call must not take every job in turn)."""
        if self.watch_task is None:
            return
        refused = why is WorkerHealth.CREDENTIAL_REFUSED
        if refused:
            self._refused(detail)
        else:
            self.health, self.health_detail = why, ""
        self.watch_task.cancel()
        self._told = why.down
        self._feed(sch.WorkerUnhealthy(now=time.monotonic(), worker=self.address, why=why.down))
        delay = self.config.credential_recheck_interval if refused else 0.0
        # Usually from inside the failed call: the watch must not log as that call's request from now on.
        self.watch_task = spawn(self._watch(self._feed, self._closed, delay), name=f"health:{self.address}")

    def _refused(self, detail: str) -> None:
        """It refuses the gateway's credential: say so once (and again if what it says changes)."""
        if self.health is not WorkerHealth.CREDENTIAL_REFUSED or self.health_detail != detail:
            log.warning("%s %s refuses the gateway's credential (%s): it gets no work until a check with the "
                        "credential passes (every %gs)", self.role.name.lower(), self.address, detail,
                        self.config.credential_recheck_interval)
        self.health, self.health_detail = WorkerHealth.CREDENTIAL_REFUSED, detail

    async def answers_probe(self) -> bool:
        """Whether it answers a health check SERVING within the probe timeout, now: a call to it overran, and this
        tells a slow job (it answers) from a hung or vanished worker (it does not)."""
        try:
            reply = await health_pb2_grpc.HealthStub(self.channel).Check(
                health_pb2.HealthCheckRequest(service=self.service), timeout=self.config.health_probe_timeout)
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def _read_limits(self) -> None:
        """Learn what it applies before it gets work, so admission refuses what it would refuse. The call carries
        the gateway's credential, so it is also the check that the worker accepts it: _CredentialRefused if not."""
        try:
            reply = await self.stub.GetLimits(self._limits_request(), timeout=self.config.health_probe_timeout,
                                              metadata=self.config.worker_metadata)
            limits = advertised(reply.limits)
            self.build = reply.build
            platform = Platform.of(reply)
        except grpc.aio.AioRpcError as err:
            if err.code() in CREDENTIAL_CODES:
                # Health is open, so it looks serving; but it would refuse every job sent to it, at once, and so be
                # the first one free for every next job too. Not serving until this check passes.
                raise _CredentialRefused(refusal(err)) from None
            if err.code() is not grpc.StatusCode.UNIMPLEMENTED:
                raise  # unreachable or hung: the watch treats it like a failed probe
            # A server without GetLimits advertises nothing: the defaults stand in for it (and its credential is
            # checked by the first call that needs it).
            log.warning("%s %s: GetLimits: %s %s; assuming the default limits", self.role.name.lower(), self.address,
                        err.code().name, err.details())
            limits = {}
            self.build = common_pb2.BuildInfo()
            platform = Platform()
        if platform != self.platform:
            log.info("%s %s runs on %s", self.role.name.lower(), self.address, platform)
            self.platform = platform
        if why := incompatibility(self.build):
            raise _Incompatible(why)
        if limits != self.limits:
            log.info("%s %s applies %s", self.role.name.lower(), self.address,
                     ", ".join(f"{k}={v:g}" for k, v in sorted(limits.items())) or "no advertised limits")
            self.limits = limits
            self._on_limits()
        if self.role is sch.WorkerRole.DENOISER:
            await self.read_loras()

    async def read_loras(self) -> denoiser_service_pb2.DenoiserServiceListLorasResponse:
        """Its adapter directory (and what it holds loaded), kept in ``loras``; a change calls ``on_limits`` (the
        catalogue merges like the limits). A denoiser without ListLoras (an older one) serves no adapters."""
        try:
            reply = await self.stub.ListLoras(denoiser_service_pb2.DenoiserServiceListLorasRequest(),
                                              timeout=self.config.health_probe_timeout,
                                              metadata=self.config.worker_metadata)
        except grpc.aio.AioRpcError as err:
            if err.code() is not grpc.StatusCode.UNIMPLEMENTED:
                raise
            reply = denoiser_service_pb2.DenoiserServiceListLorasResponse()
        loras = {info.name: info for info in reply.available}
        if loras != self.loras:
            log.info("denoiser %s serves %d LoRA adapter(s)%s", self.address, len(loras),
                     f": {', '.join(sorted(loras)[:20])}" if loras else "")
            self.loras = loras
            self._on_limits()
        return reply

    async def _probe(self, stub: health_pb2_grpc.HealthStub) -> None:
        """Return once the worker failed ``health_probe_failures`` probes in a row (it is hung or gone)."""
        cfg = self.config
        request = health_pb2.HealthCheckRequest(service=self.service)
        failures = 0
        while failures < cfg.health_probe_failures:
            await asyncio.sleep(cfg.health_probe_interval)
            try:
                await stub.Check(request, timeout=cfg.health_probe_timeout)
                failures = 0
            except grpc.aio.AioRpcError as err:
                failures += 1
                log.info("%s %s: health probe %d failed: %s", self.role.name.lower(), self.address, failures,
                         err.code().name)
                if err.code() is not grpc.StatusCode.DEADLINE_EXCEEDED:
                    return  # refused or broken: gone, not hung; the Watch breaks too
        self.health = WorkerHealth.HUNG

    async def _watch(self, feed: Feed, closed: Callable[[], bool], delay: float = 0.0) -> None:
        """Follow grpc.health.v1 Watch, with periodic probes beside it; any break in the stream, or probes that
        go unanswered, count as unhealthy until it says SERVING again. ``delay``: wait that long first.

        NOT_SERVING from a worker that was serving means it is draining (SIGTERM): it takes no new work, but what
        it holds is left to finish, as its shutdown grace promises. Only if it then goes away is that work lost.

        A worker that refuses the gateway's credential (the GetLimits read before it gets work) is not serving
        either: the scheduler hears it once, with that reason, and it is checked again every
        --credential-recheck-interval until it accepts the credential.
        """
        stub = health_pb2_grpc.HealthStub(self.channel)
        backoff = self.config.health_retry_min
        healthy = False  # what the scheduler was last told: WorkerHealthy (True) or WorkerUnhealthy (False)
        serving = False
        if delay:
            await asyncio.sleep(delay)
        while not closed():
            prober: asyncio.Task | None = None
            try:
                # A Check with a deadline first: a hung process keeps its connection open, so only an answer
                # within the probe timeout proves it is alive; the Watch below then follows changes.
                probe = await stub.Check(health_pb2.HealthCheckRequest(service=self.service),
                                         timeout=self.config.health_probe_timeout)
                if probe.status != health_pb2.HealthCheckResponse.SERVING:
                    raise _NotServing
                await self._read_limits()
                call = stub.Watch(health_pb2.HealthCheckRequest(service=self.service))
                # A hung process keeps the Watch open but silent: the probes end it.
                prober = asyncio.create_task(self._probe(stub), name=f"probe:{self.address}")
                prober.add_done_callback(lambda _t, c=call: c.cancel())
                async for reply in call:
                    now_serving = reply.status == health_pb2.HealthCheckResponse.SERVING
                    self.health = WorkerHealth.SERVING if now_serving else WorkerHealth.NOT_SERVING
                    if now_serving and not (healthy and serving):
                        log.info("%s %s is SERVING", self.role.name.lower(), self.address)
                        self.health_detail, self._told = "", None
                        feed(sch.WorkerHealthy(now=time.monotonic(), worker=self.address))
                        healthy = True
                    elif not now_serving and healthy and serving:
                        log.info("%s %s is not serving (draining): no new work, its current work may finish",
                                 self.role.name.lower(), self.address)
                        feed(sch.WorkerNotServing(now=time.monotonic(), worker=self.address))
                    serving = now_serving
                    backoff = self.config.health_retry_min
                    self.checked.set()
                # The server ended the Watch (a drained process exits): gone, whatever it said last.
                self.health = WorkerHealth.UNREACHABLE
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is None or task.cancelling() or prober is None or not prober.done():
                    return  # this watch itself is cancelled (closing, or a fresh one replaces it)
                # Else the probes ended the Watch (gRPC raises CancelledError for a cancelled call): hung, or gone.
                if self.health is not WorkerHealth.HUNG:
                    self.health = WorkerHealth.UNREACHABLE
            except grpc.aio.AioRpcError as err:
                if prober is not None and prober.done() and self.health is WorkerHealth.HUNG:
                    pass  # the probes went unanswered and ended the Watch
                elif err.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
                    if self.health is not WorkerHealth.TIMED_OUT:  # still the reason it was sidelined for
                        self.health = WorkerHealth.HUNG
                else:
                    self.health = WorkerHealth.UNREACHABLE
            except _NotServing:
                self.health = WorkerHealth.NOT_SERVING
            except _CredentialRefused as refused:
                self._refused(str(refused))
            except _Incompatible as incompatible:
                if self.health is not WorkerHealth.INCOMPATIBLE or self.health_detail != str(incompatible):
                    log.warning("%s %s %s: it gets no work", self.role.name.lower(), self.address, incompatible)
                self.health, self.health_detail = WorkerHealth.INCOMPATIBLE, str(incompatible)
            except Exception:  # noqa: BLE001 - the watch must outlive any surprise, or the worker's state freezes
                log.exception("health watch of %s failed unexpectedly", self.address)
                self.health = WorkerHealth.UNREACHABLE
            finally:
                if prober is not None:
                    prober.cancel()
                self.checked.set()
            serving = False
            refused = self.health.held_back
            if not refused:
                self.health_detail = ""  # what it said when it refused no longer holds
            down = self.health.down
            # Also told while down, when why changes: a worker that never was healthy but refuses the credential
            # (it joined with another token), or one down for a reason that no longer holds. Only the messages of
            # requests that find no worker of its stage read it; a recheck that says the same tells nothing.
            if healthy or (down is not self._told and (self._told is not None or refused)):
                if healthy and not refused:  # (a refusal was logged with what the worker said)
                    log.warning("%s %s is %s", self.role.name.lower(), self.address, self.health.value)
                healthy = False
                self._told = down
                feed(sch.WorkerUnhealthy(now=time.monotonic(), worker=self.address, why=down))
            if refused:
                await asyncio.sleep(self.config.credential_recheck_interval)
                continue
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.config.health_retry_max)
