"""The Helm chart (k8s/glmimage) rendered for the tests/test_k8s*.py files: the documented values sets, a render of
any of them into Kubernetes objects, and look-ups in those objects.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "k8s" / "glmimage"
KUBE_VERSION = "1.37.0"
RELEASE, NAMESPACE = "demo", "ml"
CRD_KINDS = {"ServiceMonitor", "PrometheusRule"}

helm = pytest.importorskip("helm_python", reason="helm-python-sdk comes with the dev extra")
kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate comes with the dev extra")

TLS_VALUES: dict[str, Any] = {
    "tls": {"enabled": True, "mutual": True, "cert": "CERT", "key": "KEY", "ca": "CA",
            "serverName": "demo-glmimage-denoiser"},
    "apiKeys": {"keys": ["k1", "k2"]},
    "adminKeys": {"keys": ["admin-1"]},
    "config": {"gateway": {"workerAllow": ["*.demo-glmimage-denoiser.ml.svc.cluster.local:50061", "10.0.0.0/8"]}},
    "model": {"source": "tiny"},
    "ar": {"discovery": "dns"},
    "metrics": {"serviceMonitor": {"enabled": True}, "grafanaDashboard": {"enabled": True},
                "prometheusRule": {"enabled": True, "labels": {"release": "kube-prom"}}},
    "ingress": {"enabled": True},
    "tracing": {"otlpEndpoint": "http://otel-collector.observability:4317"},
}


def gpu_values() -> dict[str, Any]:
    return helm.values_from_yaml((CHART / "values-gpu.yaml").read_text())


def documented_values() -> dict[str, dict[str, Any]]:
    """Every values set the docs and these tests describe; an upgrade may go from any of them to any other."""
    gpu = gpu_values()
    return {
        "default": {},
        "gpu": gpu,
        "gpu-ar-dns": helm_merge(gpu, {"ar": {"discovery": "dns"}}),
        "ar-dns": {"ar": {"discovery": "dns"}},
        "tls": TLS_VALUES,
        "tls-ar-service": helm_merge(TLS_VALUES, {"ar": {"discovery": "service"}}),
        "internal-token-existing": {"internalToken": {"existingSecret": "my-token", "secretKey": "value"}},
        "internal-token-off": {"internalToken": {"enabled": False}},
        "hpa-object": {"denoiser": {"autoscaling": {"enabled": True, "metricType": "Object"}}},
        "host-path": {"model": {"source": "hostPath", "hostPath": {"path": "/mnt/glm"}}},
        "pvc-create": {"model": {"pvc": {"create": True}}},
        # LoRA adapters for the denoisers (tests/test_k8s_loras.py): an existing claim, or a node directory.
        "loras-pvc": {"loras": {"source": "pvc", "subPath": "adapters"}, "config": {"denoiser": {"maxLoadedLoras": 8}}},
        "loras-host-path": {"loras": {"source": "hostPath", "hostPath": {"path": "/mnt/loras"}}},
        # k8s/README.md: one gateway, with a budget that lets drains take it.
        "one-gateway": {"gateway": {"replicas": 1, "pdb": {"minAvailable": None, "maxUnavailable": 1}}},
        "placement": {
            "ar": {"podAntiAffinityPreset": "hard", "affinity": {"nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{"matchExpressions": [
                    {"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64"]}]}]}}}},
            "denoiser": {"podAntiAffinityPreset": "soft", "topologySpreadConstraints": [
                {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "ScheduleAnyway"}]},
            "gateway": {"podAntiAffinityPreset": "soft", "topologySpreadConstraints": [
                {"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "DoNotSchedule",
                 "labelSelector": {"matchLabels": {"app.kubernetes.io/instance": "someone-else"}}}]},
        },
    }


def helm_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Values of `-f base -f override`: maps merge key by key, anything else is replaced."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = helm_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def notes(values: dict[str, Any] | None = None) -> str:
    with helm.Chart.load(CHART) as chart:
        out = chart.render(values=values or {}, name=RELEASE, namespace=NAMESPACE, is_install=True)
    return next(text for name, text in out.items() if name.endswith("NOTES.txt"))


def render(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    with helm.Chart.load(CHART) as chart:
        out = chart.render(values=values or {}, name=RELEASE, namespace=NAMESPACE, is_install=True)
    docs = []
    for name, text in sorted(out.items()):
        if name.endswith(".yaml"):
            docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def container(docs: list[dict], deployment: str, name: str) -> dict:
    dep = by_kind(docs, "Deployment")[f"{RELEASE}-glmimage-{deployment}"]
    return next(c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == name)


def pod_spec(docs: list[dict], deployment: str) -> dict:
    return by_kind(docs, "Deployment")[f"{RELEASE}-glmimage-{deployment}"]["spec"]["template"]["spec"]


GATEWAY_HEADLESS = f"{RELEASE}-glmimage-gateway-headless"
GATEWAYS_TARGET = f"dns:///{GATEWAY_HEADLESS}.{NAMESPACE}.svc.cluster.local:50050"
