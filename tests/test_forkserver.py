"""The fork server the tests start model servers from (tests/support/forkserver.py): a forked child must look, to
the test and to itself, like the `python -m` subprocess it replaces, or the suite would test something else."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import forkserver
from tests.support.waiting import until as wait_until

ARGV = [sys.executable, "-m", "tests.support.forked_child"]


def env(**extra: str) -> dict[str, str]:
    return {**os.environ, **extra}


def seen(log: Path) -> dict:
    wait_until(lambda: log.exists() and log.read_text().strip(), 60, "the child's first line")
    return json.loads(log.read_text().splitlines()[0])


def test_a_child_sees_what_python_m_would(tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    child = forkserver.spawn([*ARGV, "exit", "7"], log, env(GLMIMAGE_FORKED="yes"))
    assert isinstance(child, forkserver.Forked)
    assert child.wait(60) == 7 and child.poll() == 7
    view = seen(log)
    assert view["argv"][1:] == ["exit", "7"] and view["argv"][0].endswith("forked_child.py")
    assert view["name"] == "__main__" and view["setting"] == "yes" and view["pid"] == child.pid
    assert Path(view["cwd"]) == forkserver.REPO and view["stdin"] == ""
    # The libraries come preloaded; this project's modules are imported afresh by each child.
    assert view["torch"] and not view["runtime"]


def test_every_way_a_child_ends_gives_the_status_a_subprocess_would(tmp_path: Path) -> None:
    for mode, code, text in [("message", 1, "a message for stderr"), ("raise", 1, "an error nobody caught"),
                             ("interrupt", -signal.SIGINT, "")]:
        log = tmp_path / f"{mode}.log"
        plain = subprocess.run([*ARGV, mode], capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=60,
                               cwd=forkserver.REPO)
        child = forkserver.spawn([*ARGV, mode], log, env())
        assert child.wait(60) == code == plain.returncode, (mode, log.read_text())
        assert text in log.read_text() and text in plain.stderr


def test_signals_reach_the_child_itself(tmp_path: Path) -> None:
    child = forkserver.spawn([*ARGV, "wait"], tmp_path / "stop.log", env())
    seen(tmp_path / "stop.log")
    child.send_signal(signal.SIGSTOP)
    wait_until(lambda: Path(f"/proc/{child.pid}/stat").read_text().split(") ")[1][0] == "T", 30, "stopped")
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(0.2)  # a stopped child has not exited
    child.send_signal(signal.SIGCONT)
    child.terminate()
    assert child.wait(60) == -signal.SIGTERM
    child.kill()  # after its exit: a no-op, as Popen's

    handled = forkserver.spawn([*ARGV, "wait", "handle"], tmp_path / "handled.log", env())
    seen(tmp_path / "handled.log")
    handled.terminate()
    assert handled.wait(60) == 3

    killed = forkserver.spawn([*ARGV, "wait"], tmp_path / "killed.log", env())
    seen(tmp_path / "killed.log")
    started = time.monotonic()
    killed.kill()
    assert killed.wait(60) == -signal.SIGKILL
    assert time.monotonic() - started < 30


def test_a_start_a_fork_cannot_reproduce_runs_as_a_subprocess(tmp_path: Path) -> None:
    # The interpreter and the libraries read PYTHON* and the like while starting: those starts are not forked.
    child = forkserver.spawn([*ARGV, "exit", "0"], tmp_path / "plain.log", env(PYTHONHASHSEED="5"))
    assert isinstance(child, subprocess.Popen)
    assert child.wait(60) == 0 and seen(tmp_path / "plain.log")["argv"][1:] == ["exit", "0"]


def test_the_light_fork_server_has_no_torch_and_passes_fds(tmp_path: Path) -> None:
    """Gateways and REST fronts come from the light fork server, which never imported torch; a start's passed fds
    (a REST front's listening socket, from the launcher) arrive under the numbers the command line names."""
    import torch  # noqa: F401  # what torch sets in the environment as it is imported is no other environment

    read, write = os.pipe()
    os.write(write, b"through the fork server")
    os.close(write)
    log = tmp_path / "light.log"
    with open(log, "ab") as out:  # the fork server receives it under another number: the child gets this one
        child = forkserver.server("light").client.spawn([*ARGV, "read", str(read)], env(), out.fileno(),
                                                        out.fileno(), (read,))
    os.close(read)
    assert isinstance(child, forkserver.Forked), forkserver.server("light").client.refused
    assert child.wait(60) == 0, log.read_text()
    first, second = (json.loads(line) for line in log.read_text().splitlines()[:2])
    assert not first["torch"] and not first["runtime"]
    assert second == {"read": "through the fork server"}
    assert forkserver.kind_of([sys.executable, "-m", "rest"]) == "light"
    assert forkserver.kind_of([sys.executable, "-m", "services.ar"]) == "model"
    assert forkserver.kind_of([sys.executable, "-m", "services.launcher"]) is None


def test_a_launcher_forks_its_servers_from_the_right_fork_server(tmp_path: Path) -> None:
    """The launcher's supervisor asks the fork server that ENV_SOCKET names for its AR and denoisers, the one that
    ENV_LIGHT_SOCKET names for gateways and REST fronts, and neither for anything else; the child it gets back ends
    with the status a plain one would, seen through asyncio."""
    import asyncio

    from runtime.forkclient import ENV_LIGHT_SOCKET, ENV_SOCKET, AsyncForked
    from services.supervisor import Child, Supervisor

    forkserver.export()
    assert os.environ[ENV_SOCKET] == str(forkserver.server().path)
    assert os.environ[ENV_LIGHT_SOCKET] == str(forkserver.server("light").path)

    async def scenario() -> list[tuple[object, int]]:
        sup = Supervisor("127.0.0.1", "INFO")
        children = [Child(name, [sys.executable, "-m", module, "--help"], tmp_path / f"{name}.port", None)
                    for name, module in (("ar", "services.ar"), ("gw", "gateway"),
                                         ("other", "services.launcher"))]
        for child in children:
            await sup._spawn(child)
        return [(child.process, await child.process.wait()) for child in children]

    (model, model_code), (gateway, gateway_code), (other, other_code) = asyncio.run(scenario())
    assert isinstance(model, AsyncForked) and model_code == 0 and model.returncode == 0
    assert isinstance(gateway, AsyncForked) and gateway_code == 0
    assert forkserver.started_by(os.getpid()) == {}  # both exited: no record left
    assert not isinstance(other, AsyncForked) and other_code == 0


def test_a_launcher_whose_fork_server_is_gone_starts_plain_processes(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A socket that names no fork server (its test ended, say) costs the launcher nothing but the fork."""
    import asyncio

    from runtime.forkclient import ENV_SOCKET, AsyncForked
    from services.supervisor import Child, Supervisor

    monkeypatch.setenv(ENV_SOCKET, str(tmp_path / "no-such-socket"))

    async def scenario() -> tuple[object, int]:
        sup = Supervisor("127.0.0.1", "INFO")
        model = Child("ar", [sys.executable, "-m", "services.ar", "--help"], tmp_path / "ar.port", None)
        await sup._spawn(model)
        return model.process, await model.process.wait()

    process, code = asyncio.run(scenario())
    assert not isinstance(process, AsyncForked) and code == 0


def test_a_child_in_another_tree_imports_that_trees_code_as_python_m_there_would(tmp_path: Path) -> None:
    """Another checkout of the project (the version-skew test's previous release): the child's sys.path is built as
    the interpreter builds it there (the directory, then PYTHONPATH), so its code is that tree's, not this one's."""
    tree, extra = tmp_path / "tree", tmp_path / "extra"
    (tree / "tests" / "support").mkdir(parents=True)
    extra.mkdir()
    for package in (tree / "tests", tree / "tests" / "support"):
        (package / "__init__.py").write_text("")
    (tree / "tests" / "support" / "forked_child.py").write_text(
        "import json, sys\nprint(json.dumps({'file': __file__, 'path': sys.path[:2]}))\n")
    log = tmp_path / "tree.log"
    child = forkserver.spawn([*ARGV], log, env(PYTHONPATH=str(extra)), cwd=tree)
    assert isinstance(child, forkserver.Forked), forkserver.server().client.refused
    assert child.wait(60) == 0, log.read_text()
    view = seen(log)
    assert view["file"] == str(tree / "tests" / "support" / "forked_child.py")
    assert view["path"] == [str(tree), str(extra)]
