"""Gateway settings (flags -> one frozen dataclass)."""
from __future__ import annotations

from dataclasses import dataclass, field

from gateway.membership import AllowRule
from gateway.scheduler import SchedulerConfig
from services.runtime.tls import ClientTls


@dataclass(frozen=True)
class GatewayConfig:
    ar_addresses: tuple[str, ...]
    denoiser_addresses: tuple[str, ...]
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    default_height: int = 256
    default_width: int = 256
    max_n: int = 10
    request_timeout: float = 300.0
    # Health watch re-connect backoff: short enough that a restarted worker is back within a second or two.
    health_retry_min: float = 0.1
    health_retry_max: float = 1.0
    # A health probe that does not answer in this time counts as a failure (a hung process keeps its socket open).
    health_probe_timeout: float = 1.0
    # Longest one denoise call may take before the job is retried elsewhere and the worker is probed.
    denoise_timeout: float = 600.0
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
