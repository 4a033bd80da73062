"""Logging with request ids: a contextvar set per RPC and a filter that stamps every record."""
from __future__ import annotations

import asyncio
import contextvars
import logging
import re
import uuid
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"


# The request id's name on every hop: the REST front's header and the gRPC metadata key.
REQUEST_ID_KEY = "x-request-id"
MAX_REQUEST_ID_CHARS = 128
# A client's id is echoed, logged and sent on to the next hop: visible ASCII only (no space, control character,
# CR/LF or non-ASCII byte can forge a log line or a header), bounded.
_CLIENT_ID_RE = re.compile(rf"[\x21-\x7e]{{1,{MAX_REQUEST_ID_CHARS}}}")


def new_request_id() -> str:
    """A fresh id, the same form on every hop: the REST front's and a gRPC server's alike."""
    return f"req-{uuid.uuid4().hex}"


def accepted_request_id(value: str | bytes | None) -> str | None:
    """The client's id if it is fit to keep, else None: the one rule of the REST front and every gRPC server.
    Bytes are read as latin-1, so a non-ASCII byte stays a character outside the allowed set."""
    if value is None:
        return None
    text = value if isinstance(value, str) else value.decode("latin-1")
    return text if _CLIENT_ID_RE.fullmatch(text) else None


def request_id_or_new(value: str | bytes | None) -> str:
    """The client's id when accepted_request_id keeps it; a fresh one in place of a missing or hostile one."""
    return accepted_request_id(value) or new_request_id()


def spawn(coro: Coroutine[Any, Any, T], *, name: str | None = None, request_id: str = "-") -> asyncio.Task[T]:
    """A task that logs as ``request_id``, whatever context it was started from. A task copies its creator's
    context: a health watch restarted from inside a failed call kept that call's id in every line for as long as
    it ran, and a batch of several requests showed whichever one's call dispatched it."""
    context = contextvars.Context()
    context.run(request_id_var.set, request_id)
    return asyncio.create_task(coro, name=name, context=context)


def without_request_id() -> contextvars.Context:
    """A context for callbacks (timers) that act for no request in particular."""
    return contextvars.Context()


class RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = request_id_var.get()
        return True


def configure_logging(level: str = "INFO") -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    handler.addFilter(RequestIdFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # Library progress chatter is noise in server logs.
    for noisy in ("httpx", "urllib3", "diffusers", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
