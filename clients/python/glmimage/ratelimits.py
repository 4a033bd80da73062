"""The gateway's rate-limit metadata, read back: `RateLimits` from a call's metadata (initial when admitted, trailing
when refused), the wait a refusal asks for (google.rpc.RetryInfo, else ``retry-after``) and which quota refused.

The keys are OpenAI's response headers (``x-ratelimit-limit-requests`` ...), sent by a gateway only for a tenant
with quotas; reset values are OpenAI's durations ("1m0s", "12s", "250ms"). Pure functions over metadata pairs, so
both clients read them the same way. The SDK needs only grpcio and protobuf: google.rpc's Status and RetryInfo are
decoded through wire-compatible messages of a private descriptor pool, not googleapis-common-protos.
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError

__all__ = ["QUOTA_KEY", "RATE_LIMIT_KEYS", "RETRY_AFTER_KEY", "RateLimits", "parse_duration", "quota_of",
           "retry_after_of"]

RETRY_AFTER_KEY = "retry-after"
QUOTA_KEY = "x-glmimage-quota"  # requests_per_minute, images_per_minute or max_inflight_images; absent: queue full
STATUS_DETAILS_KEY = "grpc-status-details-bin"
RETRY_INFO_TYPE = "google.rpc.RetryInfo"


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


# --- google.rpc.Status and RetryInfo, wire-compatible ----------------------------------------------------------------


def _message_classes() -> tuple[type, type]:
    """Status {int32 code = 1; string message = 2; repeated Any details = 3} and RetryInfo {Duration retry_delay =
    1}, with Any and Duration as their two fields each: the same bytes as google.rpc's, in a pool of our own so a
    process that also loads googleapis-common-protos sees no clash."""
    T = descriptor_pb2.FieldDescriptorProto
    optional, repeated = T.LABEL_OPTIONAL, T.LABEL_REPEATED

    def message(name: str, *specs: tuple[str, int, int, int, str]) -> descriptor_pb2.DescriptorProto:
        return descriptor_pb2.DescriptorProto(name=name, field=[
            T(name=f, number=n, type=t, label=label, **({"type_name": ref} if ref else {}))
            for f, n, t, label, ref in specs])

    pkg = "glmimage.sdk.rpc"
    file = descriptor_pb2.FileDescriptorProto(name="glmimage/sdk/rpc_status.proto", package=pkg, syntax="proto3")
    file.message_type.extend([
        message("Any", ("type_url", 1, T.TYPE_STRING, optional, ""), ("value", 2, T.TYPE_BYTES, optional, "")),
        message("Duration", ("seconds", 1, T.TYPE_INT64, optional, ""), ("nanos", 2, T.TYPE_INT32, optional, "")),
        message("Status", ("code", 1, T.TYPE_INT32, optional, ""), ("message", 2, T.TYPE_STRING, optional, ""),
                ("details", 3, T.TYPE_MESSAGE, repeated, f".{pkg}.Any")),
        message("RetryInfo", ("retry_delay", 1, T.TYPE_MESSAGE, optional, f".{pkg}.Duration")),
    ])
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return tuple(message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{pkg}.{name}"))
                 for name in ("Status", "RetryInfo"))  # type: ignore[return-value]


_Status, _RetryInfo = _message_classes()


def _retry_info_delay(status_bytes: bytes) -> float | None:
    try:
        status = _Status.FromString(status_bytes)
        for detail in status.details:
            if detail.type_url.rsplit("/", 1)[-1] == RETRY_INFO_TYPE:
                delay = _RetryInfo.FromString(detail.value).retry_delay
                return delay.seconds + delay.nanos / 1e9
    except DecodeError:  # not a Status: nothing we can trust in it
        return None
    return None
