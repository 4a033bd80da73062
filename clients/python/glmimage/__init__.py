"""GLM-Image serving: the protocol (generated contracts in ``glmimage.v1``, shared wire helpers in
``glmimage.wire``) and the Python SDK above it. Needs only grpcio, protobuf and googleapis-common-protos.

The SDK names below load on first use (PEP 562), so a server that imports ``glmimage.v1`` or ``glmimage.wire``
never loads the client.
"""
from __future__ import annotations

from importlib import import_module
from typing import Any

__all__ = [
    "DEFAULT_RETRY",
    "NO_RETRY",
    "AsyncClient",
    "Client",
    "Completed",
    "GenerationResult",
    "GlmImageError",
    "ImageFetchError",
    "Job",
    "JobError",
    "JobImage",
    "JobPage",
    "JobProgress",
    "JobWaitTimeout",
    "Limits",
    "Lora",
    "LoraCatalogue",
    "LoraInfo",
    "LoraPlacement",
    "PartialImage",
    "Progress",
    "RateLimits",
    "RetryPolicy",
    "Status",
    "StreamEvent",
    "TenantInfo",
    "TlsConfig",
    "Usage",
    "WorkerInfo",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        value = getattr(import_module("glmimage.client"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'glmimage' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
