"""The SDK's one error type: a failed call, with what its status and trailing metadata say."""
from __future__ import annotations

import grpc

from glmimage.ratelimits import RateLimits, quota_of, retry_after_of


class GlmImageError(Exception):
    """A call failed; ``code`` is the final gRPC status, ``attempts`` how many calls were made.

    A quota refusal (RESOURCE_EXHAUSTED) also says which ``quota`` refused (``requests_per_minute``,
    ``images_per_minute`` or ``max_inflight_images``; None for a full queue), the ``retry_after`` seconds the gateway
    asked for, and the tenant's ``rate_limits`` as they stood (empty when the gateway reported none)."""

    def __init__(self, code: grpc.StatusCode, details: str, attempts: int = 1, *,
                 rate_limits: RateLimits | None = None, retry_after: float | None = None,
                 quota: str | None = None) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.attempts = attempts
        self.rate_limits = RateLimits() if rate_limits is None else rate_limits
        self.retry_after = retry_after
        self.quota = quota

    @classmethod
    def from_rpc(cls, exc: grpc.RpcError, attempts: int) -> GlmImageError:
        """The error of a failed call, with what its trailing metadata says about quotas."""
        trailing = _trailing(exc)
        return cls(exc.code(), exc.details() or "", attempts, rate_limits=RateLimits.from_metadata(trailing),
                   retry_after=retry_after_of(trailing), quota=quota_of(trailing))


def _trailing(exc: grpc.RpcError) -> list[tuple[str, object]]:
    """A failed call's trailing metadata (grpc's own failures, e.g. a refused connection, may have none)."""
    method = getattr(exc, "trailing_metadata", None)
    return list((method() if callable(method) else None) or ())
