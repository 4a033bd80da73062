"""The REST front's per-request overhead: no route dependency runs in FastAPI's thread pool.

A plain ``def`` dependency is called through anyio's worker threads, one thread hop per dependency per request;
with four on the generation route that cost about 30% of the front's throughput at concurrency 32
(`make bench-compare`). Each must be a coroutine function.
"""
from __future__ import annotations

import inspect
from collections.abc import Iterator

from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute

from rest.edits import router as edits_router
from rest.routes import router


def _calls(dependant: Dependant) -> Iterator[object]:
    for dep in dependant.dependencies:
        yield dep.call
        yield from _calls(dep)


def test_every_route_dependency_is_a_coroutine() -> None:
    routes = [r for rt in (router, edits_router) for r in rt.routes if isinstance(r, APIRoute)]
    assert routes
    sync = {f"{r.path}: {getattr(call, '__name__', call)}" for r in routes for call in _calls(r.dependant)
            if call is not None and not inspect.iscoroutinefunction(call)}
    assert not sync, f"dependencies that would run in the thread pool: {sorted(sync)}"
