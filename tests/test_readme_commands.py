"""The README's shell commands run as printed from the repo root, with `make run`'s `.venv` and no activated venv.

Only `.venv/bin/` changes: it becomes the bin directory of the interpreter running the tests (the same `.venv`
under `make test`). The grpcurl commands have their own test (test_grpcurl.py).
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
SERVERS = "## Running the servers yourself"
MODULES = {"services.ar", "services.denoiser", "gateway", "gateway.rest"}


def sh_blocks(section: str | None = None) -> list[str]:
    """The lines of the README's ```sh blocks (within `section`, up to the next `## ` heading, when given)."""
    text = README.read_text()
    if section is not None:
        start = text.find(section + "\n")
        assert start >= 0, f"README.md has no {section!r} section"
        body = text[start + len(section):]
        end = body.find("\n## ")
        text = body if end < 0 else body[:end]
    blocks = re.findall(r"^```sh\n(.*?)^```", text, flags=re.S | re.M)
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip()]


def as_run_here(command: str) -> str:
    return command.replace(".venv/bin/", f"{Path(sys.executable).parent}/")


def no_venv_env() -> dict[str, str]:
    """The environment of a shell with no activated venv and no PYTHONPATH."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}


def help_commands() -> list[str]:
    return [c for c in sh_blocks(SERVERS) if c.endswith(" --help")]


def test_servers_block_has_a_help_command_per_server_and_no_placeholders() -> None:
    lines = sh_blocks(SERVERS)
    helped = {shlex.split(c)[2] for c in help_commands()}
    assert helped == MODULES, help_commands()
    for line in lines:
        command = line.split("  #")[0]
        argv = shlex.split(command)
        assert argv[:2] == [".venv/bin/python", "-m"] and argv[2] in MODULES, line
        # Runnable as printed: no `[optional]` flags, no `a|b` alternatives.
        assert not re.search(r"[\[\]|]", command), line


@pytest.mark.parametrize("command", help_commands() or ["(none found)"])
def test_servers_help_commands_run_from_the_repo_root(command: str) -> None:
    assert command != "(none found)", f"README.md's {SERVERS!r} block has no --help commands"
    done = subprocess.run(as_run_here(command), shell=True, cwd=REPO, env=no_venv_env(), capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 0, (command, done.stderr[-2000:])
    assert done.stdout.startswith("usage: "), done.stdout[:200]


def test_cli_commands_name_the_venv_binary() -> None:
    """`glmimage` and `python` are not on PATH without an activated venv: the README spells `.venv/bin/`."""
    for line in sh_blocks():
        assert not re.match(r"(glmimage|python3?|pip)\s", line), line


def test_readme_cli_help_runs_as_printed() -> None:
    clis = [line for line in sh_blocks() if line.startswith(".venv/bin/glmimage ")]
    assert clis, "README.md shows no .venv/bin/glmimage command"
    # Each as printed, only asking for its help (they need a running stack otherwise; test_cli runs the CLI).
    for line in clis:
        argv = shlex.split(line.split("  #")[0])
        done = subprocess.run([as_run_here(argv[0]), argv[1], "--help"], cwd=REPO, env=no_venv_env(),
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, (line, done.stderr)
