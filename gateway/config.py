"""Gateway settings (flags -> one frozen dataclass)."""
from __future__ import annotations

import os
import secrets
import socket
from dataclasses import dataclass, field

from gateway.membership import AllowRule
from gateway.scheduler.types import SchedulerConfig
from gateway.timeouts import TimeoutPolicy
from runtime.tls import ClientTls


def new_instance_id() -> str:
    """This gateway process's name on its denoise jobs (DenoiseRequest.owner): unique per process, so several
    gateways (and a restarted one) over one pool tell their own jobs from each other's, and readable in logs."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


@dataclass(frozen=True)
class GatewayConfig:
    ar_addresses: tuple[str, ...]
    denoiser_addresses: tuple[str, ...]
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    default_height: int = 256
    default_width: int = 256
    # The gateway's own --max-* flags (runtime.limits field -> bound): they only ever lower what the
    # workers advertise. Empty: admit what the workers apply.
    own_limits: tuple[tuple[str, float], ...] = ()
    request_timeout: float = 300.0
    # Health watch re-connect backoff: short enough that a restarted worker is back within a second or two.
    health_retry_min: float = 0.1
    health_retry_max: float = 1.0
    # A health probe that does not answer in this time counts as a failure (a hung process keeps its socket open).
    health_probe_timeout: float = 1.5
    # Every member is probed this often besides its health Watch: a hung (SIGSTOPped) process keeps its connection
    # and its Watch open but answers nothing, and only a probe notices. This many failures in a row sideline it.
    health_probe_interval: float = 1.0
    health_probe_failures: int = 3
    # A worker that refuses the gateway's credential (its internal token) is checked again this often, with a
    # GetLimits carrying it: fixing it takes an operator (a token file, a restart), and each check is a refusal in
    # the worker's log, so this is slower than the health retries.
    credential_recheck_interval: float = 5.0
    # How long one AR batch / denoise call may take before it is retried elsewhere and its worker is sidelined
    # until it answers a health probe: adaptive (a margin over recent calls, capped) unless fixed.
    ar_timeout: TimeoutPolicy = field(default_factory=TimeoutPolicy)
    denoise_timeout: TimeoutPolicy = field(default_factory=TimeoutPolicy)
    # NAME:PORT targets whose A/AAAA records list workers (Kubernetes headless Services), re-resolved periodically.
    ar_dns: tuple[str, ...] = ()
    denoiser_dns: tuple[str, ...] = ()
    dns_interval: float = 5.0
    client_tls: ClientTls | None = None  # how the gateway dials AR and denoisers; None: plaintext
    api_keys: tuple[str, ...] = ()  # GatewayService callers must present one; empty: auth off
    admin_keys: tuple[str, ...] = ()  # AddWorker/RemoveWorker need one; empty: those RPCs are off for everyone
    # Addresses AddWorker may add (--worker-allow); empty: AddWorker refuses every address.
    worker_allow: tuple[AllowRule, ...] = ()
    # The most workers the pool holds, both roles and every source (static, DNS, AddWorker) together.
    max_workers: int = 256
    # Extra metadata on every GenerateBatch/Denoise/DenoiseStream call to a worker (the internal token);
    # health probes go without it.
    worker_metadata: tuple[tuple[str, str], ...] = ()
    # The owner this gateway names on its denoise jobs; the denoisers' occupancy streams say whose job holds them.
    instance_id: str = field(default_factory=new_instance_id)
