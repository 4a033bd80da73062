"""A pytest plugin that writes, per test file and per test, the CPU seconds it cost (``cpu``; ``own``: the part the
worker itself spent) and its wall seconds, one JSON line each (``{"file": ...}`` or ``{"test": ...}``).

The suite is CPU-bound on CI's 2-core machine (its workers together keep both cores busy), so a file's wall time on
a loaded worker says little about what it costs; its CPU does. Counted: the worker's own CPU and that of the child
processes it reaped while the file ran (the servers a file starts are reaped by its fixtures' teardown, which runs
within the file's last test), and that of the servers its fork server forked and reaped meanwhile, for the tests or
for their launchers (tests/support/forkserver.py: they are the fork server's children), and what every live
descendant (a module's servers, the fork server and its children) spent so far, so that a test is charged for the
work its module-scoped servers did during it. Off unless loaded:

    GLMIMAGE_TEST_CPU_LOG=/tmp/cpu.jsonl .venv/bin/python -m pytest -n 3 --dist loadfile -p tests.support.cpu_profile
"""
from __future__ import annotations

import contextlib
import json
import os
import resource
import time
from dataclasses import dataclass

import psutil
import pytest


def _own_seconds() -> float:
    """This process's CPU alone: what a file's tests cost in the worker itself (in-process engines, gateways,
    hypothesis), apart from its servers."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    return own.ru_utime + own.ru_stime


def _cpu_seconds() -> float:
    """This process's CPU, its reaped children's, and every live descendant's with what each has reaped: a process
    that ends between two readings moves from the live sum to its parent's reaped figure, and is counted once. The
    fork server is a live descendant: its reaped figure holds the forked servers'."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = _own_seconds() + children.ru_utime + children.ru_stime
    for proc in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            t = proc.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
    return total


@dataclass
class _File:
    name: str
    cpu0: float
    wall0: float
    own0: float


_current: _File | None = None


def _write(key: str, span: _File) -> None:
    line = {key: span.name, "cpu": round(_cpu_seconds() - span.cpu0, 2),
            "own": round(_own_seconds() - span.own0, 2), "wall": round(time.monotonic() - span.wall0, 2)}
    with open(os.environ.get("GLMIMAGE_TEST_CPU_LOG", "test-cpu.jsonl"), "a", encoding="utf-8") as out:
        out.write(json.dumps(line) + "\n")


def _finish() -> None:
    if _current is not None:
        _write("file", _current)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):  # noqa: ANN201 (a hook wrapper)
    global _current
    if _current is None or _current.name != item.path.name:
        _finish()
        _current = _File(item.path.name, _cpu_seconds(), time.monotonic(), _own_seconds())
    test = _File(item.nodeid, _cpu_seconds(), time.monotonic(), _own_seconds())
    yield
    _write("test", test)


def pytest_sessionfinish(session: pytest.Session) -> None:
    _finish()
