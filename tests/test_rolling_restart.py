"""Rolling restarts with nothing lost (issue 32): the stack (`python -m services.launcher`: one AR, one denoiser,
two gateways behind the REST front) under steady load from a few client threads while `ctl restart ROLE` rolls
every server of a role in turn, or a server is SIGTERMed from outside (the launcher starts it again). No request
fails: a draining AR's batches finish and count, a draining gateway finishes what it admitted while the REST front
sends new requests to the other one. The denoisers' turn: tests/test_rolling_restart_workers.py.

With one AR there is no elsewhere during its restart: the launcher runs its gateways with --queue-without-workers
(every worker of its is supervised, so one missing is one coming back), and requests wait for it instead of failing
fast (docs/operating.md, rolling restarts). With one REST front, its restart refuses no connection: the launcher
holds the front's listening socket and hands it to each REST process, so connections wait in its backlog."""
from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.launcher_control import restart_targets, role_of
from services.supervisor import Supervisor
from tests.support.cluster import StackRun, launcher_child, running_stack
from tests.support.rolling import CLIENTS, ctl, steady_load
from tests.support.waiting import until

pytestmark = [pytest.mark.e2e, pytest.mark.chaos]


@pytest.fixture(scope="module")
def stack(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackRun]:
    with running_stack(tmp_path_factory.mktemp("rolling"), denoisers=1, gateways=2) as run:
        yield run


def restart_under_load(stack: StackRun, word: str, names: list[str]) -> None:
    """`ctl restart WORD` under load: each of ``names`` is a new process, back, and no request failed."""
    before = {n: launcher_child(stack.proc.pid, n) for n in names}
    with steady_load(stack.addresses["rest"]) as load:
        done = ctl(stack, "restart", word)
        served = load.ok
        until(lambda: load.ok >= served + CLIENTS, 60, "answers after the restart")
    assert done.returncode == 0, done.stderr
    assert all(f"{n} is back on" in done.stdout for n in names), done.stdout
    after = {n: launcher_child(stack.proc.pid, n) for n in names}
    assert all(after[n] not in (None, before[n]) for n in names), (before, after)
    assert load.failed == [], load.failed


def test_ctl_restart_gateway_rolls_both_under_load_and_fails_nothing(stack: StackRun) -> None:
    restart_under_load(stack, "gateway", ["gateway-1", "gateway-2"])


def test_ctl_restart_of_the_only_ar_under_load_fails_nothing(stack: StackRun) -> None:
    restart_under_load(stack, "ar", ["ar"])


def test_ctl_restart_of_the_only_rest_front_under_load_fails_nothing(stack: StackRun) -> None:
    restart_under_load(stack, "rest", ["rest"])


def test_a_gateway_sigtermed_from_outside_under_load_fails_nothing(stack: StackRun) -> None:
    pid = launcher_child(stack.proc.pid, "gateway-2")
    assert pid is not None
    with steady_load(stack.addresses["rest"]) as load:
        os.kill(pid, signal.SIGTERM)
        until(lambda: launcher_child(stack.proc.pid, "gateway-2") not in (None, pid), 60, "gateway-2 restarted")
        served = load.ok
        until(lambda: load.ok >= served + CLIENTS, 60, "answers after the restart")
    assert load.failed == [], load.failed


def test_ctl_restart_refuses_an_unknown_name(stack: StackRun) -> None:
    done = ctl(stack, "restart", "denoiser-7")
    assert done.returncode == 1 and "no server or role named 'denoiser-7'" in done.stderr


def test_a_role_names_its_servers_in_start_order(tmp_path: Path) -> None:
    sup = Supervisor("127.0.0.1", "INFO")
    for name in ("ar", "denoiser-0", "denoiser-1", "denoiser-10", "gateway", "rest"):
        sup.child(name, "x", 0, [], None)
    assert [c.name for c in restart_targets(sup, "denoiser")] == ["denoiser-0", "denoiser-1", "denoiser-10"]
    assert [c.name for c in restart_targets(sup, "denoiser-1")] == ["denoiser-1"]  # a name before a role
    assert [c.name for c in restart_targets(sup, "gateway")] == ["gateway"]
    assert restart_targets(sup, "model") == [] and restart_targets(sup, "denoiser-2") == []
    assert role_of("gateway-2") == "gateway" and role_of("rest") == "rest"
