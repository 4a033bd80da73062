"""The gateway's rate-limit figures as HTTP headers, and what a quota refusal says (pure: metadata in, strings out).

A gateway call of a tenant with quotas carries OpenAI's six ``x-ratelimit-*`` figures: in its initial metadata when
admitted, in its trailing metadata when refused. The front relays them as headers on every answer of that call (the
JSON, the event stream's response, the error). A refusal by a quota also names it (``x-glmimage-quota``) and says
when to retry (``retry-after``, whole seconds, beside a google.rpc.RetryInfo); a queue-full refusal names none.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

from runtime.details import QUOTA_KEY, RATE_LIMIT_HEADERS, RETRY_AFTER_KEY

# The openai SDK honours Retry-After on 429; one second is the gateway's usual backoff.
DEFAULT_RETRY_AFTER_S = 1
# A figure is a count or a duration ("1m0s"); anything longer or not printable ASCII is not relayed.
_VALUE_RE = re.compile(r"[\x21-\x7e]{1,64}")

Metadata = Iterable[tuple[str, str | bytes]] | None


def _text_entries(metadata: Metadata) -> Iterable[tuple[str, str]]:
    for key, value in metadata or ():
        if isinstance(value, str):  # binary (-bin) entries hold no figure
            yield key.lower(), value


def rate_limit_headers(*metadata: Metadata) -> dict[str, str]:
    """The x-ratelimit-* entries of a call's metadata (initial, then trailing: a later one wins), as headers in
    OpenAI's order; none when the call carried none (a tenant without quotas)."""
    found: dict[str, str] = {}
    for entries in metadata:
        for key, value in _text_entries(entries):
            if key in RATE_LIMIT_HEADERS and _VALUE_RE.fullmatch(value):
                found[key] = value
    return {name: found[name] for name in RATE_LIMIT_HEADERS if name in found}


def quota_of(trailing: Metadata) -> str | None:
    """Which quota refused the call (requests_per_minute, images_per_minute, max_inflight_images); None when none
    did (the queue was full, or the call was not refused)."""
    for key, value in _text_entries(trailing):
        if key == QUOTA_KEY and re.fullmatch(r"[a-z_]{1,64}", value):
            return value
    return None


def retry_after(trailing: Metadata, delay: float | None = None) -> str:
    """Retry-After for a 429: the gateway's trailing ``retry-after``, else its RetryInfo ``delay`` (seconds) rounded
    up, else the default; whole seconds, at least one."""
    for key, value in _text_entries(trailing):
        if key == RETRY_AFTER_KEY and value.isascii() and value.isdigit():
            return str(max(1, min(int(value), 86_400)))
    if delay is not None and math.isfinite(delay):
        return str(max(1, min(math.ceil(delay), 86_400)))
    return str(DEFAULT_RETRY_AFTER_S)
