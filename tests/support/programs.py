"""Running the clients as a user would: the `glmimage` CLI, the Node client and docs/grpcurl.md's edit, as
subprocesses."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GRPCURL_PAGE = REPO / "docs" / "grpcurl.md"
GENERATE_JS = REPO / "clients" / "node" / "generate.js"


def glmimage(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`python -m glmimage.cli ARGS` in ``cwd``, without the caller's GLMIMAGE_* settings (plus ``env``)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("GLMIMAGE_")} | (env or {})
    # Bytes, decoded here: text mode would turn the progress bar's carriage returns into newlines.
    done = subprocess.run([sys.executable, "-m", "glmimage.cli", *args], capture_output=True, timeout=60, cwd=cwd,
                          env=environ)
    return subprocess.CompletedProcess(done.args, done.returncode, done.stdout.decode(), done.stderr.decode())


def run_node(node: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`node clients/node/generate.js ARGS`."""
    return subprocess.run([node, str(GENERATE_JS), *args], capture_output=True, text=True, timeout=timeout)


def readme_grpcurl_edit() -> str:
    """docs/grpcurl.md's edit: the one shell line that pipes reference_images JSON into grpcurl."""
    lines = [ln for ln in GRPCURL_PAGE.read_text().splitlines() if "grpcurl " in ln and "reference_images" in ln
             and not ln.startswith("grpcurl ")]
    assert len(lines) == 1, lines
    return lines[0]


def run_readme_grpcurl_edit(address: str, cwd: Path, reference: bytes) -> dict:
    """docs/grpcurl.md's example as printed, in a shell, with `address` for make run's gateway and `reference` as the
    file it reads; grpcurl comes from the interpreter's bin directory (the dev extra), as in test_grpcurl."""
    command = readme_grpcurl_edit()
    (path,) = re.findall(r"base64 < (\S+)", command)
    (cwd / path).parent.mkdir(parents=True, exist_ok=True)
    (cwd / path).write_bytes(reference)
    env = os.environ | {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(["bash", "-c", command.replace("127.0.0.1:50050", address)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{command}\n{done.stderr}"
    return json.loads(done.stdout)
