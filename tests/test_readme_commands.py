"""The shell commands of the README and the docs/ pages run as printed from the repo root, with `make run`'s `.venv`
and no activated venv.

Only `.venv/bin/` changes: it becomes the bin directory of the interpreter running the tests (the same `.venv`
under `make test`). The grpcurl commands have their own test (test_grpcurl.py); commands that need a running stack, a
cluster or network access are checked only as far as that is possible without one (their `--help`, `make -n`).
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
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]
SERVERS_PAGE = REPO / "docs" / "configuration.md"
SERVERS = "## Running the servers yourself"
MODULES = {"services.ar", "services.denoiser", "gateway", "rest"}


def sh_blocks(page: Path, section: str | None = None) -> list[str]:
    """The commands of a page's ```sh blocks (within `section`, up to the next `## ` heading, when given)."""
    text = page.read_text()
    if section is not None:
        start = text.find(section + "\n")
        assert start >= 0, f"{page.name} has no {section!r} section"
        body = text[start + len(section):]
        end = body.find("\n## ")
        text = body if end < 0 else body[:end]
    blocks = re.findall(r"^```sh\n(.*?)^```", text, flags=re.S | re.M)
    joined = (re.sub(r"\\\n\s*", " ", block) for block in blocks)  # a line ending in a backslash goes on
    return [line.strip() for block in joined for line in block.splitlines() if line.strip()]


def every_sh_line() -> list[tuple[str, str]]:
    """(page, line) for every ```sh line of the README and the docs/ pages."""
    return [(str(page.relative_to(REPO)), line) for page in PAGES for line in sh_blocks(page)]


def as_run_here(command: str) -> str:
    return command.replace(".venv/bin/", f"{Path(sys.executable).parent}/")


def no_venv_env() -> dict[str, str]:
    """The environment of a shell with no activated venv and no PYTHONPATH."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}


def help_commands() -> list[str]:
    return [c for c in sh_blocks(SERVERS_PAGE, SERVERS) if c.endswith(" --help")]


def test_servers_block_has_a_help_command_per_server_and_no_placeholders() -> None:
    lines = sh_blocks(SERVERS_PAGE, SERVERS)
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
    assert command != "(none found)", f"{SERVERS_PAGE.name}'s {SERVERS!r} block has no --help commands"
    done = subprocess.run(as_run_here(command), shell=True, cwd=REPO, env=no_venv_env(), capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 0, (command, done.stderr[-2000:])
    assert done.stdout.startswith("usage: "), done.stdout[:200]


def test_cli_commands_name_the_venv_binary() -> None:
    """`glmimage` and `python` are not on PATH without an activated venv: the pages spell `.venv/bin/`."""
    for page, line in every_sh_line():
        assert not re.match(r"(glmimage|python3?|pip)\s", line), (page, line)


def test_cli_help_runs_as_printed() -> None:
    clis = [line for _, line in every_sh_line() if line.startswith(".venv/bin/glmimage ")]
    assert clis, "neither README.md nor docs/ shows a .venv/bin/glmimage command"
    # Each as printed, with `--help` appended (they need a running stack otherwise; test_cli runs the CLI): every
    # flag and value before it must parse.
    for line in clis:
        argv = shlex.split(line.split("  #")[0])
        done = subprocess.run([as_run_here(argv[0]), *argv[1:], "--help"], cwd=REPO, env=no_venv_env(),
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, (line, done.stderr)
        assert done.stdout.startswith("usage: "), (line, done.stdout[:200])


def test_make_commands_name_real_targets_and_variables(tmp_path: Path) -> None:
    """`make` would take a misspelt variable silently, so each must be one the Makefile sets or reads; `make -n`
    with a venv that does not exist prints every recipe without running it."""
    makefile = (REPO / "Makefile").read_text()
    phony = {t for line in re.findall(r"^\.PHONY:(.*)$", makefile, re.M) for t in line.split()}
    variables = set(re.findall(r"^([A-Z_]+)\s*[?:]?=", makefile, re.M)) | set(re.findall(r"\$\(([A-Z_]+)\)", makefile))
    makes = [(page, line) for page, line in every_sh_line() if line.startswith("make ")]
    assert {"run", "test"} <= {shlex.split(line)[1] for _, line in makes}, makes
    for page, line in makes:
        argv = shlex.split(line.split("  #")[0])[1:]
        assert {a for a in argv if "=" not in a} <= phony, (page, line)
        assert {a.split("=")[0] for a in argv if "=" in a} <= variables, (page, line)
        done = subprocess.run(["make", "-n", "--no-print-directory", "-C", str(REPO), *argv, f"VENV={tmp_path}/v"],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, (page, line, done.stderr)


def test_docker_helm_and_node_commands_name_what_exists() -> None:
    """They need a daemon, a cluster or the network; what they name in the repository must be there."""
    stages = set(re.findall(r"^FROM \S+ AS (\S+)$", (REPO / "docker" / "Dockerfile").read_text(), re.M))
    seen = set()
    for page, line in every_sh_line():
        argv = shlex.split(line)
        if argv[:2] == ["docker", "build"]:
            assert (REPO / argv[argv.index("-f") + 1]).is_file() and argv[argv.index("--target") + 1] in stages, line
        elif argv[:2] == ["helm", "install"]:
            chart, values = argv[3], argv[argv.index("-f") + 1]
            assert (REPO / chart / "Chart.yaml").is_file() and (REPO / values).is_file(), (page, line)
        elif argv[:1] == ["cd"] and "node" in argv:
            script = next(a for a in argv if a.endswith(".js"))
            assert (REPO / argv[1] / script).is_file() and (REPO / argv[1] / "package-lock.json").is_file(), line
        else:
            continue
        seen.add(argv[0])
    assert seen == {"docker", "helm", "cd"}, seen


def _anchor(heading: str) -> str:
    """GitHub's id for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_links_lead_somewhere(page: Path) -> None:
    """Every relative link of the README and docs/ names a file that exists, and an anchor one of its headings."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        assert linked.exists(), f"{page.name}: {target} (no {linked.relative_to(REPO)})"
        if anchor:
            headings = re.findall(r"^#+ (.*)$", linked.read_text(), re.M)
            assert anchor in {_anchor(h) for h in headings}, f"{page.name}: {target}"
