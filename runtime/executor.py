"""Running blocking model calls off the event loop, one at a time per model."""
from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


class SerialExecutor:
    """A single worker thread: the models are not thread-safe (global RNG, per-call pipeline state),
    so calls are serialized, while the asyncio loop stays free to answer health checks and new RPCs."""

    def __init__(self, name: str) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def run(self, fn: Callable[..., T], *args, **kwargs) -> T:
        # copy_context carries the request id into the worker thread's log records.
        call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._pool, call)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
