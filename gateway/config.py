"""Gateway settings (flags -> one frozen dataclass)."""
from __future__ import annotations

from dataclasses import dataclass, field

from gateway.scheduler import SchedulerConfig


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
