"""The .proto files are the single source of truth: lint them and keep the committed stubs in sync."""
from __future__ import annotations

import filecmp
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

STUBS = REPO / "clients" / "python" / "glmimage" / "v1"


def test_committed_stubs_match_make_protos(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(REPO / "protos" / "gen_python.py"), "--out", str(tmp_path)], check=True)
    fresh = tmp_path / "glmimage" / "v1"
    generated = sorted(p.name for p in fresh.iterdir() if p.is_file())
    committed = sorted(p.name for p in STUBS.iterdir() if p.is_file())
    assert generated == committed, "stub files differ from the .proto files: run `make protos`"
    _, mismatch, errors = filecmp.cmpfiles(fresh, STUBS, generated, shallow=False)
    assert not mismatch and not errors, f"stale stubs {mismatch + errors}: run `make protos` and commit"


def _buf() -> str:
    buf = shutil.which("buf", path=str(Path(sys.executable).parent))
    if buf is None:
        pytest.fail("buf is not installed (it comes with the dev extra: buf-bin)")
    return buf


def test_buf_lint_standard_is_clean() -> None:
    result = subprocess.run([_buf(), "lint"], cwd=REPO / "protos", capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("source, against", [(None, "HEAD"), ("HEAD", "HEAD~1")],
                         ids=["worktree-vs-HEAD", "HEAD-vs-previous"])
def test_protos_are_wire_compatible_with_the_previous_commit(tmp_path: Path, source: str | None,
                                                             against: str) -> None:
    # buf's FILE rules (protos/buf.yaml): no field renumbered, retyped or removed, so old clients keep working.
    if subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", "--quiet", against],
                      capture_output=True).returncode:
        pytest.skip(f"no {against} in this checkout (a shallow clone)")
    protos = REPO / "protos"
    if source is not None:  # that commit's protos, exported
        subprocess.run(f"git -C {REPO} archive {source} protos | tar -x -C {tmp_path}", shell=True, check=True)
        protos = tmp_path / "protos"
    result = subprocess.run([_buf(), "breaking", str(protos), "--against", f"{REPO}/.git#ref={against},subdir=protos"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_gateway_and_clients_do_not_import_torch() -> None:
    code = ("import sys, gateway.__main__, rest.app, gateway.driver, glmimage.v1.gateway_service_pb2_grpc; "
            "heavy = [m for m in ('torch', 'diffusers', 'transformers') if m in sys.modules]; "
            "print(heavy); sys.exit(1 if heavy else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, f"torch-free parts imported {result.stdout}{result.stderr}"


def test_ruff_is_clean() -> None:
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent))
    assert ruff, "ruff comes with the dev extra"
    result = subprocess.run([ruff, "check", "services", "gateway", "rest", "runtime", "tests", "protos"], cwd=REPO,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
