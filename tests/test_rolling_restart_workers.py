"""Rolling restarts of the denoisers with nothing lost (issue 32; the other roles: tests/test_rolling_restart.py):
under steady load through the REST front, `ctl restart denoiser` drains each denoiser in turn with SIGTERM
(NOT_SERVING first: the gateway sends new work to the other one; its job finishes and counts), and waits until the
gateway takes work from it again before the next. No request fails. (A SIGTERM from outside, which the launcher
follows with a restart, drains the same way: tests/test_rolling_restart.py does it to a gateway.)"""
from __future__ import annotations

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


def test_ctl_restart_denoiser_rolls_each_in_turn_under_load_and_fails_nothing(stack: StackRun) -> None:
    names = ["denoiser-0", "denoiser-1"]
    before = {n: launcher_child(stack.proc.pid, n) for n in names}
    with steady_load(stack.addresses["rest"]) as load:
        done = ctl(stack, "restart", "denoiser")
        served = load.ok
        until(lambda: load.ok >= served + CLIENTS, 60, "answers after the restart")
    assert done.returncode == 0, (done.stdout, done.stderr)
    # In start order, each back (and taken again by the gateway) before the next was stopped.
    assert done.stdout.index("denoiser-0 is back on") < done.stdout.index("denoiser-1 stopped"), done.stdout
    assert all(launcher_child(stack.proc.pid, n) not in (None, before[n]) for n in names)
    assert load.failed == [], load.failed
