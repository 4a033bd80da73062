"""Logging with request ids: a contextvar set per RPC and a filter that stamps every record."""
from __future__ import annotations

import asyncio
import contextvars
import logging
import uuid
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex[:16]}"


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
