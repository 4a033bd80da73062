"""The chart's pods: native gRPC probes, the queue-depth HPA, resource requests, restricted pod security, model
weights, install notes, config and secrets, and the ServiceMonitor.
"""
from __future__ import annotations

import pytest

from tests.support.chart import (
    KUBE_VERSION,
    NAMESPACE,
    RELEASE,
    by_kind,
    container,
    helm,
    kv,
    notes,
    render,
)


@pytest.mark.parametrize("deployment,service,port", [("ar", "glmimage.v1.ArService", 50051),
                                                     ("denoiser", "glmimage.v1.DenoiserService", 50061),
                                                     ("gateway", "glmimage.v1.GatewayService", 50050)])
def test_native_grpc_probes_on_grpc_health(default_docs: list[dict], deployment: str, service: str,
                                           port: int) -> None:
    c = container(default_docs, deployment, deployment)
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["grpc"] == {"port": port, "service": service}, probe
    startup = c["startupProbe"]
    # Model loading can take minutes: the startup probe must allow for it before liveness applies.
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300


def test_rest_front_probes(default_docs: list[dict]) -> None:
    rest = container(default_docs, "gateway", "rest")
    assert rest["readinessProbe"]["httpGet"]["path"] == "/health"
    assert rest["livenessProbe"]["httpGet"]["path"] == "/metrics"  # liveness must not depend on the workers


def test_denoiser_hpa_scales_on_the_gateway_queue_metric(gpu_docs: list[dict], default_docs: list[dict]) -> None:
    assert by_kind(default_docs, "HorizontalPodAutoscaler") == {}  # off by default: it needs prometheus-adapter
    hpa = by_kind(gpu_docs, "HorizontalPodAutoscaler")[f"{RELEASE}-glmimage-denoiser"]
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": f"{RELEASE}-glmimage-denoiser"}
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "External"
    assert metric["external"]["metric"] == {"name": "glmimage_gateway_queue_outputs",
                                            "selector": {"matchLabels": {"stage": "denoise"}}}
    assert metric["external"]["target"]["type"] == "AverageValue"
    # With the HPA on, the Deployment leaves the replica count to it.
    assert "replicas" not in by_kind(gpu_docs, "Deployment")[f"{RELEASE}-glmimage-denoiser"]["spec"]


def test_hpa_object_metric_variant() -> None:
    docs = render({"denoiser": {"autoscaling": {"enabled": True, "metricType": "Object"}}})
    hpa = by_kind(docs, "HorizontalPodAutoscaler")[f"{RELEASE}-glmimage-denoiser"]
    obj = hpa["spec"]["metrics"][0]["object"]
    assert obj["describedObject"] == {"apiVersion": "v1", "kind": "Service", "name": f"{RELEASE}-glmimage-gateway"}
    assert obj["metric"]["name"] == "glmimage_gateway_queue_outputs"
    kv.validate(hpa, KUBE_VERSION, strict=True)


def test_resource_requests(default_docs: list[dict], gpu_docs: list[dict]) -> None:
    for docs in (default_docs, gpu_docs):
        for dep, name in [("ar", "ar"), ("denoiser", "denoiser"), ("gateway", "gateway"), ("gateway", "rest")]:
            requests = container(docs, dep, name)["resources"]["requests"]
            assert {"cpu", "memory"} <= set(requests), (dep, name)
    for dep in ("ar", "denoiser"):
        res = container(gpu_docs, dep, dep)["resources"]
        # Extended resources: request and limit must be equal.
        assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"] == 1
        spec = by_kind(gpu_docs, "Deployment")[f"{RELEASE}-glmimage-{dep}"]["spec"]["template"]["spec"]
        assert spec["nodeSelector"] and spec["tolerations"][0]["key"] == "nvidia.com/gpu"
    ascend = render({"denoiser": {"resources": {"requests": {"cpu": "4", "memory": "32Gi", "huawei.com/Ascend910": 1},
                                                "limits": {"huawei.com/Ascend910": 1}}}})
    res = container(ascend, "denoiser", "denoiser")["resources"]
    assert res["requests"]["huawei.com/Ascend910"] == res["limits"]["huawei.com/Ascend910"] == 1


def test_pods_run_non_root_with_a_read_only_root(default_docs: list[dict]) -> None:
    for dep in by_kind(default_docs, "Deployment").values():
        spec = dep["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] != 0
        assert spec["automountServiceAccountToken"] is False
        mounts_by_volume = {v["name"]: v for v in spec["volumes"]}
        for c in spec["containers"]:
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"]["drop"] == ["ALL"]
            mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
            assert "emptyDir" in mounts_by_volume[mounts["/tmp"]]
    for dep in ("ar", "denoiser"):
        c = container(default_docs, dep, dep)
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        assert mounts["/models"]["readOnly"] is True and mounts["/cache"]["name"] == "cache"
        assert "--model-path=/models/GLM-Image" in c["args"]


def test_model_weights_from_pvc_or_hostpath(default_docs: list[dict]) -> None:
    vols = {v["name"]: v for v in by_kind(default_docs, "Deployment")[f"{RELEASE}-glmimage-denoiser"]["spec"][
        "template"]["spec"]["volumes"]}
    assert vols["models"]["persistentVolumeClaim"] == {"claimName": "glmimage-models", "readOnly": True}
    host = render({"model": {"source": "hostPath", "hostPath": {"path": "/mnt/glm"}}})
    vols = {v["name"]: v for v in by_kind(host, "Deployment")[f"{RELEASE}-glmimage-ar"]["spec"]["template"]["spec"][
        "volumes"]}
    assert vols["models"]["hostPath"] == {"path": "/mnt/glm", "type": "Directory"}
    with pytest.raises(helm.HelmError, match="model.source"):
        render({"model": {"source": "s3"}})


def test_install_notes_name_the_weights_prerequisite_and_the_host_path_pod_security_cost() -> None:
    existing = notes()
    assert "PersistentVolumeClaim glmimage-models must already exist in ml" in existing
    assert f"kubectl -n {NAMESPACE} get pvc glmimage-models" in existing
    assert "claim glmimage-models empty" in notes({"model": {"pvc": {"create": True}}})
    host = notes({"model": {"source": "hostPath"}})
    assert "baseline and restricted Pod" in host and "/data/models" in host
    assert "PersistentVolumeClaim" not in host
    tiny = notes({"model": {"source": "tiny"}})
    assert "Weights:" not in tiny and "WARNING" not in tiny and "Pod Security" not in existing


# Volume types the restricted Pod Security Standard allows (baseline allows more, but never hostPath).
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}


def test_pods_meet_restricted_pod_security_except_host_path(documented_docs: dict[str, list[dict]]) -> None:
    """What the NOTES promise: only model.source=hostPath (the AR and denoisers) and loras.source=hostPath (the
    denoisers) fall below restricted (and baseline)."""
    host_path_pods = {"host-path": {f"{RELEASE}-glmimage-ar", f"{RELEASE}-glmimage-denoiser"},
                      "loras-host-path": {f"{RELEASE}-glmimage-denoiser"}}
    for name, docs in documented_docs.items():
        for dep in by_kind(docs, "Deployment").values():
            spec = dep["spec"]["template"]["spec"]
            where = (name, dep["metadata"]["name"])
            types = {k for v in spec["volumes"] for k in v if k != "name"}
            if dep["metadata"]["name"] in host_path_pods.get(name, ()):
                assert types - RESTRICTED_VOLUMES == {"hostPath"}, where
            else:
                assert types <= RESTRICTED_VOLUMES, where
            assert spec["securityContext"]["runAsNonRoot"] is True, where
            assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, where
            assert not any(spec.get(k) for k in ("hostNetwork", "hostPID", "hostIPC")), where
            for c in spec["containers"]:
                sc = c["securityContext"]
                assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}, where
                assert not sc.get("privileged") and not any(p.get("hostPort") for p in c.get("ports", [])), where


def test_pdbs_configmap_and_secrets(default_docs: list[dict], tls_docs: list[dict]) -> None:
    pdbs = by_kind(default_docs, "PodDisruptionBudget")
    assert set(pdbs) == {f"{RELEASE}-glmimage-{c}" for c in ("ar", "denoiser", "gateway")}
    # No keys, no TLS: only the generated internal token is secret.
    assert set(by_kind(default_docs, "Secret")) == {f"{RELEASE}-glmimage-internal-token"}
    config = by_kind(default_docs, "ConfigMap")[f"{RELEASE}-glmimage-config"]["data"]
    assert config["GLMIMAGE_DEVICE"] == "auto"
    secrets = by_kind(tls_docs, "Secret")
    assert secrets[f"{RELEASE}-glmimage-api-keys"]["stringData"] == {"GLMIMAGE_API_KEYS": "k1,k2"}
    assert secrets[f"{RELEASE}-glmimage-admin-keys"]["stringData"] == {"GLMIMAGE_ADMIN_KEYS": "admin-1"}
    assert set(secrets[f"{RELEASE}-glmimage-tls"]["data"]) == {"tls.crt", "tls.key", "ca.crt"}
    for name in ("gateway", "rest"):
        env = {e["name"]: e for e in container(tls_docs, "gateway", name)["env"]}
        assert env["GLMIMAGE_API_KEYS"]["valueFrom"]["secretKeyRef"]["name"] == f"{RELEASE}-glmimage-api-keys"


def test_service_monitor_scrapes_every_metrics_port(tls_docs: list[dict], default_docs: list[dict]) -> None:
    assert by_kind(default_docs, "ServiceMonitor") == {}
    (sm,) = by_kind(tls_docs, "ServiceMonitor").values()
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert {(e["port"], e["path"]) for e in sm["spec"]["endpoints"]} == {("metrics", "/metrics"), ("http", "/metrics")}
    selected = [s for s in by_kind(tls_docs, "Service").values()
                if all(s["metadata"]["labels"].get(k) == v for k, v in sm["spec"]["selector"]["matchLabels"].items())]
    ports = sorted((s["metadata"]["name"], p["name"]) for s in selected for p in s["spec"]["ports"]
                   if p["name"] in ("metrics", "http"))
    assert ports == [(f"{RELEASE}-glmimage-{c}", p) for c, p in
                     [("ar-headless", "metrics"), ("denoiser", "metrics"), ("gateway", "metrics"), ("rest", "http")]]
