"""The chart's LoRA adapters (loras.*, config.denoiser.maxLoadedLoras): off by default; with loras.source pvc or
hostPath a read-only volume at /loras in the denoiser pods only and --lora-dir=/loras, which the denoiser's own
parser accepts; the adapter cache size through the ConfigMap; bad values fail the render; strict schemas pass.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.chart import (
    CHART,
    CRD_KINDS,
    KUBE_VERSION,
    RELEASE,
    by_kind,
    container,
    documented_values,
    helm,
    kv,
    notes,
    render,
)
from tests.test_k8s import _expand

SOURCES: dict[str, dict[str, Any]] = {
    "pvc": {"loras": {"source": "pvc", "pvc": {"claimName": "my-loras"}}},
    "hostPath": {"loras": {"source": "hostPath", "hostPath": {"path": "/mnt/loras"}}},
}
VOLUMES = {"pvc": {"persistentVolumeClaim": {"claimName": "my-loras", "readOnly": True}},
           "hostPath": {"hostPath": {"path": "/mnt/loras", "type": "Directory"}}}


def _pods(docs: list[dict]) -> dict[str, dict]:
    return {name.removeprefix(f"{RELEASE}-glmimage-"): dep["spec"]["template"]["spec"]
            for name, dep in by_kind(docs, "Deployment").items()}


def _lora_volumes(spec: dict) -> list[dict]:
    return [v for v in spec["volumes"] if v["name"] == "loras"]


def _lora_mounts(spec: dict) -> dict[str, list[dict]]:
    return {c["name"]: [m for m in c.get("volumeMounts", []) if m["name"] == "loras" or m["mountPath"] == "/loras"]
            for c in spec["containers"] + spec.get("initContainers", [])}


def _lora_flags(spec: dict) -> list[str]:
    return [a for c in spec["containers"] for a in c.get("args", []) if a.startswith("--lora-dir")]


def _denoiser_args(docs: list[dict], lora_dir: Path):
    """The denoiser's args as Kubernetes expands them, through the denoiser's own parser (/loras is a local dir)."""
    from services.denoiser.__main__ import parse_args

    env = by_kind(docs, "ConfigMap")[f"{RELEASE}-glmimage-config"]["data"]
    args = _expand(container(docs, "denoiser", "denoiser")["args"], env)
    return parse_args([a.replace("=/loras", f"={lora_dir}") for a in args])


def test_off_by_default_no_volume_and_no_flag(documented_docs: dict[str, list[dict]], tmp_path: Path) -> None:
    """loras.source none (every documented set but the loras-* ones, the tiny model's too): no volume, no mount, no
    --lora-dir, so the denoiser serves no adapter (or, with the tiny model, its built-in demo adapter)."""
    sets = {name: docs for name, docs in documented_docs.items() if not name.startswith("loras-")}
    sets["tiny"] = render({"model": {"source": "tiny"}})
    for name, docs in sets.items():
        for role, spec in _pods(docs).items():
            assert _lora_volumes(spec) == [], (name, role)
            assert all(not m for m in _lora_mounts(spec).values()), (name, role)
            assert _lora_flags(spec) == [], (name, role)
    args = _denoiser_args(sets["tiny"], tmp_path)
    assert args.lora_dir is None and args.model_path is None  # the tiny model's demo adapter applies
    assert args.max_loaded_loras == 4  # the chart's default is the denoiser's


@pytest.mark.parametrize("source", sorted(SOURCES))
def test_a_source_mounts_read_only_at_loras_on_the_denoiser_only(source: str, tmp_path: Path) -> None:
    docs = render(SOURCES[source])
    pods = _pods(docs)
    assert set(pods) == {"ar", "denoiser", "gateway"}
    (volume,) = _lora_volumes(pods["denoiser"])
    assert {k: v for k, v in volume.items() if k != "name"} == VOLUMES[source]
    assert _lora_mounts(pods["denoiser"]) == {"denoiser": [{"name": "loras", "mountPath": "/loras",
                                                             "readOnly": True}]}
    assert _lora_flags(pods["denoiser"]) == ["--lora-dir=/loras"]
    for role in ("ar", "gateway"):  # never on the AR or the gateway pods (gateway and REST front containers)
        assert _lora_volumes(pods[role]) == [], role
        assert all(not m for m in _lora_mounts(pods[role]).values()), role
        assert _lora_flags(pods[role]) == [], role
    # The weights stay where they were, read-only too.
    mounts = {m["mountPath"]: m for m in container(docs, "denoiser", "denoiser")["volumeMounts"]}
    assert mounts["/models"]["readOnly"] is True
    args = _denoiser_args(docs, tmp_path)
    assert args.lora_dir == tmp_path and args.max_loaded_loras == 4


def test_sub_path_and_max_loaded_loras(documented_docs: dict[str, list[dict]], tmp_path: Path) -> None:
    docs = documented_docs["loras-pvc"]  # subPath adapters, maxLoadedLoras 8
    (mount,) = _lora_mounts(_pods(docs)["denoiser"])["denoiser"]
    assert mount == {"name": "loras", "mountPath": "/loras", "readOnly": True, "subPath": "adapters"}
    config = by_kind(docs, "ConfigMap")[f"{RELEASE}-glmimage-config"]["data"]
    assert config["GLMIMAGE_MAX_LOADED_LORAS"] == "8"
    # Through the ConfigMap like the other settings: the arg names the variable, so a change rolls the pods.
    assert "--max-loaded-loras=$(GLMIMAGE_MAX_LOADED_LORAS)" in container(docs, "denoiser", "denoiser")["args"]
    assert _denoiser_args(docs, tmp_path).max_loaded_loras == 8
    checksum = "checksum/config"
    before = by_kind(render(), "Deployment")[f"{RELEASE}-glmimage-denoiser"]
    after = by_kind(render({"config": {"denoiser": {"maxLoadedLoras": 8}}}), "Deployment")[
        f"{RELEASE}-glmimage-denoiser"]
    assert (before["spec"]["template"]["metadata"]["annotations"][checksum]
            != after["spec"]["template"]["metadata"]["annotations"][checksum])


@pytest.mark.parametrize("values,message", [
    ({"loras": {"source": "s3"}}, 'loras.source must be none, pvc or hostPath, not "s3"'),
    ({"loras": {"source": "PVC"}}, 'loras.source must be none, pvc or hostPath, not "PVC"'),
    ({"loras": {"source": "pvc", "pvc": {"claimName": ""}}}, "loras.source=pvc needs loras.pvc.claimName"),
    ({"loras": {"source": "hostPath", "hostPath": {"path": ""}}}, "loras.source=hostPath needs loras.hostPath.path"),
    ({"loras": {"source": "pvc", "subPath": "../models"}}, "loras.subPath must be a relative path"),
    ({"loras": {"source": "pvc", "subPath": "/adapters"}}, "loras.subPath must be a relative path"),
    ({"config": {"denoiser": {"maxLoadedLoras": 0}}}, "config.denoiser.maxLoadedLoras must be at least 1"),
])
def test_bad_values_fail_the_render_with_a_clear_message(values: dict, message: str) -> None:
    with pytest.raises(helm.HelmError, match=re.escape(message)):
        render(values)


@pytest.mark.parametrize("values_name", ["loras-pvc", "loras-host-path"])
def test_every_manifest_passes_strict_schema_validation_and_lint(values_name: str,
                                                        documented_docs: dict[str, list[dict]]) -> None:
    plain = [d for d in documented_docs[values_name] if d["kind"] not in CRD_KINDS]
    assert any(_lora_volumes(spec) for spec in _pods(plain).values())
    for doc in plain:
        kv.validate(doc, KUBE_VERSION, strict=True)  # raises on any unknown field or wrong type
    values = documented_values()[values_name]
    report = helm.lint(str(CHART), values, strict=True, kube_version=f"v{KUBE_VERSION}")
    assert report["errors"] == [] and [m for m in report["messages"] if m["severity"] >= 2] == []


def test_install_notes_name_the_claim_and_the_host_path_pod_security_cost() -> None:
    existing = notes({"loras": {"source": "pvc", "subPath": "adapters"}})
    assert "PersistentVolumeClaim glmimage-loras (adapters/) read-only at /loras" in existing
    assert "kubectl -n ml get pvc glmimage-loras" in existing
    host = notes({"loras": {"source": "hostPath"}})
    assert "loras.source=hostPath mounts /data/loras" in host and "restricted Pod Security" in host
    assert "LoRA" not in notes() and "loras" not in notes()


def test_the_commented_example_in_values_gpu_renders() -> None:
    """values-gpu.yaml's commented loras block, uncommented, is a working values set."""
    lines = (CHART / "values-gpu.yaml").read_text().splitlines()
    start = lines.index("# loras:")
    block = []
    for line in lines[start:]:
        if not line.startswith("#"):
            break
        block.append(line.removeprefix("# "))
    example = yaml.safe_load("\n".join(block))
    assert example["loras"]["source"] == "pvc"
    docs = render(example)
    (volume,) = _lora_volumes(_pods(docs)["denoiser"])
    assert volume["persistentVolumeClaim"]["claimName"] == example["loras"]["pvc"]["claimName"]
    assert _lora_flags(_pods(docs)["denoiser"]) == ["--lora-dir=/loras"]
