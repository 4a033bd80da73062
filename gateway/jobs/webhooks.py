"""What a webhook says and how it is signed: the Standard Webhooks scheme (OpenAI's webhooks use it), through the
``standardwebhooks`` package, so a receiver verifies with any of that scheme's libraries."""
from __future__ import annotations

import base64
import binascii
import datetime
import hashlib
import hmac
import json
import math

from standardwebhooks import Webhook

from gateway.jobs.model import CANCELLED, COMPLETED, FAILED

SECRET_PREFIX = "whsec_"
EVENT_TYPES = {COMPLETED: "image.job.completed", FAILED: "image.job.failed", CANCELLED: "image.job.cancelled"}
_DERIVE_LABEL = b"glmimage-webhook\0"


def validate_webhook_secret(value: str) -> str:
    """A tenants file's ``webhook_secret``: ``whsec_`` then base64 of at least 16 bytes (ValueError otherwise), so a
    typo fails at load rather than at every delivery."""
    if not value.startswith(SECRET_PREFIX):
        raise ValueError(f"a webhook secret starts with {SECRET_PREFIX!r}")
    try:
        key = base64.b64decode(value[len(SECRET_PREFIX):], validate=True)
    except binascii.Error:
        raise ValueError(f"a webhook secret is {SECRET_PREFIX!r} then standard base64") from None
    if len(key) < 16:
        raise ValueError("a webhook secret carries at least 16 bytes")
    return value


def webhook_secret_for(tenant_name: str, configured: str | None, master: bytes) -> str:
    """The tenant's signing secret: its configured one, else one derived from the gateway's master secret, so every
    gateway sharing the master signs a tenant's webhooks alike and none keeps a per-tenant secret anywhere."""
    if configured:
        return validate_webhook_secret(configured)
    if len(master) < 16:
        raise ValueError("the webhook master secret must be at least 16 bytes")
    digest = hmac.new(master, _DERIVE_LABEL + tenant_name.encode(), hashlib.sha256).digest()
    return SECRET_PREFIX + base64.b64encode(digest).decode()


def event_body(delivery_id: str, job_object: dict, now: float) -> bytes:
    """The exact bytes POSTed (and signed at each try): ``{"id": "evt_...", "object": "event", "type", "created_at",
    "data": <the REST job object>}``. The event id follows the delivery id, so both name one event."""
    status = job_object.get("status")
    if status not in EVENT_TYPES:
        raise ValueError(f"no webhook event for a job that is {status!r}")
    event = {"id": "evt_" + delivery_id.removeprefix("msg_"), "object": "event", "type": EVENT_TYPES[status],
             "created_at": int(now), "data": job_object}
    return json.dumps(event, separators=(",", ":"), ensure_ascii=False).encode()


def sign_headers(secret: str, msg_id: str, timestamp: float, body: bytes) -> dict[str, str]:
    """The Standard Webhooks headers for one try: the id is the same over every try (receivers deduplicate on it),
    the timestamp is this try's (receivers refuse stale ones)."""
    when = datetime.datetime.fromtimestamp(math.floor(timestamp), tz=datetime.UTC)
    signature = Webhook(secret).sign(msg_id, when, body.decode())
    return {"webhook-id": msg_id, "webhook-timestamp": str(math.floor(timestamp)), "webhook-signature": signature,
            "content-type": "application/json"}
