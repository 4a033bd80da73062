"""A pytest plugin that writes, per test file, the CPU seconds it cost and its wall seconds, one JSON line a file.

The suite is CPU-bound on CI's 2-core machine (its workers together keep both cores busy), so a file's wall time on
a loaded worker says little about what it costs; its CPU does. Counted: the worker's own CPU and that of the child
processes it reaped while the file ran (the servers a file starts are reaped by its fixtures' teardown, which runs
within the file's last test), and that of the servers its fork server forked and reaped meanwhile, for the tests or
for their launchers (tests/support/forkserver.py: they are the fork server's children). Off unless loaded:

    GLMIMAGE_TEST_CPU_LOG=/tmp/cpu.jsonl .venv/bin/python -m pytest -n 3 --dist loadfile -p tests.support.cpu_profile
"""
from __future__ import annotations

import json
import os
import resource
import time
from dataclasses import dataclass

import pytest

from tests.support import forkserver


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    forked = forkserver.children_cpu_seconds()  # the servers forked for this worker are the fork server's children
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + forked


@dataclass
class _File:
    name: str
    cpu0: float
    wall0: float


_current: _File | None = None


def _finish() -> None:
    if _current is None:
        return
    line = {"file": _current.name, "cpu": round(_cpu_seconds() - _current.cpu0, 2),
            "wall": round(time.monotonic() - _current.wall0, 2)}
    with open(os.environ.get("GLMIMAGE_TEST_CPU_LOG", "test-cpu.jsonl"), "a", encoding="utf-8") as out:
        out.write(json.dumps(line) + "\n")


def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    global _current
    if _current is None or _current.name != item.path.name:
        _finish()
        _current = _File(item.path.name, _cpu_seconds(), time.monotonic())


def pytest_sessionfinish(session: pytest.Session) -> None:
    _finish()
