"""Rolling restarts of the denoisers with nothing lost (issue 32; the other roles: tests/test_rolling_restart.py):
under steady load through the REST front, `ctl restart denoiser-1` and a SIGTERM from outside each drain a
denoiser (NOT_SERVING first: the gateway sends new work to the other one; its job finishes and counts), and the
launcher's restart waits until the gateway takes work from it again. No request fails."""
from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cluster import StackRun, launcher_child, running_stack
from tests.support.rolling import CLIENTS, ctl, steady_load
from tests.support.waiting import until

pytestmark = [pytest.mark.e2e, pytest.mark.chaos]


@pytest.fixture(scope="module")
def stack(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackRun]:
    with running_stack(tmp_path_factory.mktemp("rolling-workers"), denoisers=2) as run:
        yield run


def test_ctl_restart_of_a_denoiser_under_load_fails_nothing(stack: StackRun) -> None:
    before = launcher_child(stack.proc.pid, "denoiser-1")
    with steady_load(stack.addresses["rest"]) as load:
        done = ctl(stack, "restart", "denoiser-1")
        served = load.ok
        until(lambda: load.ok >= served + CLIENTS, 60, "answers after the restart")
    assert done.returncode == 0 and "denoiser-1 is back on" in done.stdout, (done.stdout, done.stderr)
    assert launcher_child(stack.proc.pid, "denoiser-1") not in (None, before)
    assert load.failed == [], load.failed


def test_a_denoiser_sigtermed_from_outside_under_load_fails_nothing(stack: StackRun) -> None:
    pid = launcher_child(stack.proc.pid, "denoiser-0")
    assert pid is not None
    with steady_load(stack.addresses["rest"]) as load:
        os.kill(pid, signal.SIGTERM)
        until(lambda: launcher_child(stack.proc.pid, "denoiser-0") not in (None, pid), 60, "denoiser-0 restarted")
        served = load.ok
        until(lambda: load.ok >= served + CLIENTS, 60, "answers after the restart")
    assert load.failed == [], load.failed
