"""The gateway's rate-limit metadata, read back: `RateLimits` from a call's metadata (initial when admitted, trailing
when refused), the wait a refusal asks for (google.rpc.RetryInfo, else ``retry-after``) and which quota refused.

The keys are OpenAI's response headers (``x-ratelimit-limit-requests`` ...), sent by a gateway only for a tenant
with quotas; reset values are OpenAI's durations ("1m0s", "12s", "250ms"). Pure functions over metadata pairs, so
both clients read them the same way. google.rpc's Status and RetryInfo come from googleapis-common-protos.
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Any

from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2

__all__ = ["QUOTA_KEY", "RATE_LIMIT_KEYS", "RETRY_AFTER_KEY", "RateLimits", "parse_duration", "quota_of",
           "retry_after_of"]

RETRY_AFTER_KEY = "retry-after"
QUOTA_KEY = "x-glmimage-quota"  # requests_per_minute, images_per_minute or max_inflight_images; absent: queue full
STATUS_DETAILS_KEY = "grpc-status-details-bin"


@dataclass(frozen=True)
class RateLimits:
    """A tenant's quotas as the gateway reported them with a call; each None when it did not say (no quota of that
    kind, or a gateway without quotas). ``reset_*`` are seconds until the window frees up again, ``reset_*_raw`` the
    strings as sent ("1m0s")."""

    limit_requests: int | None = None
    remaining_requests: int | None = None
    reset_requests: float | None = None
    limit_images: int | None = None
    remaining_images: int | None = None
    reset_images: float | None = None
    reset_requests_raw: str | None = None
    reset_images_raw: str | None = None

    @property
    def empty(self) -> bool:
        """Nothing was reported."""
        return all(getattr(self, f.name) is None for f in fields(self))

    @classmethod
    def from_metadata(cls, metadata: Iterable[tuple[str, Any]] | None) -> RateLimits:
        """The ``x-ratelimit-*`` entries of ``metadata``; a value that does not parse counts as absent (the raw
        reset string is kept all the same)."""
        md = _text_entries(metadata)
        values: dict[str, Any] = {}
        for kind in ("requests", "images"):
            values[f"limit_{kind}"] = _count(md.get(f"x-ratelimit-limit-{kind}"))
            values[f"remaining_{kind}"] = _count(md.get(f"x-ratelimit-remaining-{kind}"))
            raw = md.get(f"x-ratelimit-reset-{kind}")
            values[f"reset_{kind}"] = None if raw is None else parse_duration(raw)
            values[f"reset_{kind}_raw"] = raw
        return cls(**values)


RATE_LIMIT_KEYS = tuple(f"x-ratelimit-{what}-{kind}" for kind in ("requests", "images")
                        for what in ("limit", "remaining", "reset"))

_UNIT_SECONDS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|us|µs|ns|h|m|s)")


def parse_duration(text: str) -> float | None:
    """Seconds in an OpenAI (Go-style) duration: number-unit parts, units h, m, s, ms, us, ns ("1m0s" -> 60.0,
    "250ms" -> 0.25, "1h2m3.5s"); None for anything else."""
    text = text.strip()
    if not text:
        return None
    total, end = 0.0, 0
    for part in _DURATION_PART.finditer(text):
        if part.start() != end:
            return None
        total += float(part.group(1)) * _UNIT_SECONDS[part.group(2)]
        end = part.end()
    return total if end == len(text) else None


def quota_of(trailing: Iterable[tuple[str, Any]] | None) -> str | None:
    """Which quota refused the call (``x-glmimage-quota``); None for any other failure, a full queue included."""
    return _text_entries(trailing).get(QUOTA_KEY) or None


def retry_after_of(trailing: Iterable[tuple[str, Any]] | None) -> float | None:
    """Seconds the server asked the caller to wait: the google.rpc.RetryInfo of the rich status, else the whole
    seconds of ``retry-after``; None when it asked for nothing (or said it in a form this cannot read)."""
    entries = list(trailing or ())
    for key, value in entries:
        if key == STATUS_DETAILS_KEY and isinstance(value, bytes):
            delay = _retry_info_delay(value)
            if delay is not None:
                return delay
    seconds = _count(_text_entries(entries).get(RETRY_AFTER_KEY))
    return None if seconds is None else float(seconds)


def _text_entries(metadata: Iterable[tuple[str, Any]] | None) -> dict[str, str]:
    """The string-valued entries, first one of a key winning (binary ``-bin`` entries are bytes: skipped)."""
    out: dict[str, str] = {}
    for key, value in metadata or ():
        if isinstance(value, str):
            out.setdefault(key.lower(), value)
    return out


def _count(text: str | None) -> int | None:
    text = None if text is None else text.strip()
    return int(text) if text and text.isascii() and text.isdigit() else None


def _retry_info_delay(status_bytes: bytes) -> float | None:
    """Seconds of the google.rpc.RetryInfo in a call's status details (None: none, or not a Status)."""
    try:
        status = status_pb2.Status.FromString(status_bytes)
    except DecodeError:  # not a Status: nothing we can trust in it
        return None
    for detail in status.details:
        info = error_details_pb2.RetryInfo()
        if detail.Unpack(info):
            return info.retry_delay.seconds + info.retry_delay.nanos / 1e9
    return None
