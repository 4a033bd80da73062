"""Steady load through the REST front and the launcher's `ctl` for the rolling-restart tests (issue 32)."""
from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx

from tests.support.cluster import StackRun
from tests.support.waiting import until

CLIENTS = 3


@dataclass
class Load:
    """Client threads posting small requests to the REST front until stopped; every answer is kept."""

    rest: str
    ok: int = 0
    failed: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self, i: int) -> None:
        with httpx.Client(timeout=120) as client:
            seed = 0
            while not self.stop.is_set():
                seed += 1
                try:
                    r = client.post(f"http://{self.rest}/v1/images/generations",
                                    json={"prompt": f"roll {i}", "size": "64x64", "num_inference_steps": 2,
                                          "seed": 1000 * i + seed})
                except httpx.HTTPError as exc:
                    self.failed.append(f"client {i}: {type(exc).__name__}: {exc}")
                    continue
                if r.status_code == 200 and len(r.json()["data"]) == 1:
                    self.ok += 1
                else:
                    self.failed.append(f"client {i}: {r.status_code} {r.text[:300]}")


@contextlib.contextmanager
def steady_load(rest: str) -> Iterator[Load]:
    load = Load(rest)
    threads = [threading.Thread(target=load.run, args=(i,), daemon=True) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    until(lambda: load.ok >= CLIENTS, 60, "the load to get its first answers")
    try:
        yield load
    finally:
        load.stop.set()
        for t in threads:
            t.join(150)


def ctl(stack: StackRun, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.launcher", "ctl", "--socket", stack.addresses["control"],
                           *args], capture_output=True, text=True, timeout=300)
