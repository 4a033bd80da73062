"""The Helm chart (k8s/glmimage): renders, lints, validates against the Kubernetes schemas, and wires what operators
rely on: denoiser discovery through a headless Service, native gRPC probes, the queue-depth HPA, resource requests.

Rendering and lint use helm-python-sdk (Helm's Go SDK, bundled); validation uses kubernetes-validate --strict.
The ServiceMonitor is a CRD with no bundled schema: it is checked here by hand and skipped by the validator.
"""
from __future__ import annotations

import base64
import copy
import json
import re
import subprocess
import sys
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from tests.support.certs import Pki

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "k8s" / "glmimage"
KUBE_VERSION = "1.37.0"
RELEASE, NAMESPACE = "demo", "ml"
CRD_KINDS = {"ServiceMonitor"}

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
    "metrics": {"serviceMonitor": {"enabled": True}},
    "ingress": {"enabled": True},
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


@pytest.fixture(scope="module")
def documented_docs() -> dict[str, list[dict]]:
    return {name: render(values) for name, values in documented_values().items()}


@pytest.fixture(scope="module")
def default_docs() -> list[dict]:
    return render()


@pytest.fixture(scope="module")
def gpu_docs() -> list[dict]:
    return render(gpu_values())


@pytest.fixture(scope="module")
def tls_docs() -> list[dict]:
    return render(TLS_VALUES)


@pytest.mark.parametrize("values_name", ["default", "gpu", "tls"])
def test_helm_lint_is_clean(values_name: str) -> None:
    values = {"default": {}, "gpu": gpu_values(), "tls": TLS_VALUES}[values_name]
    report = helm.lint(str(CHART), values, strict=True, kube_version=f"v{KUBE_VERSION}")
    assert report["errors"] == []
    # Severity 2 = warning, 3 = error; info (1) is only "icon is recommended".
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("values_name", ["default", "gpu", "tls", "placement", "one-gateway"])
def test_every_manifest_passes_strict_schema_validation(values_name: str, tmp_path: Path, request) -> None:
    docs = (request.getfixturevalue(f"{values_name}_docs") if values_name in ("default", "gpu", "tls")
            else request.getfixturevalue("documented_docs")[values_name])
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "ConfigMap", "PodDisruptionBudget", "ServiceAccount"} <= kinds
    plain = [d for d in docs if d["kind"] not in CRD_KINDS]
    for doc in plain:
        kv.validate(doc, KUBE_VERSION, strict=True)  # raises on any unknown field or wrong type
    # The same check through the CLI, as an operator would run it on `helm template` output.
    manifest = tmp_path / "rendered.yaml"
    manifest.write_text(yaml.safe_dump_all(plain))
    cli = Path(sys.executable).parent / "kubernetes-validate"
    done = subprocess.run([str(cli), "--strict", "-k", KUBE_VERSION, str(manifest)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("passed for resource") == len(plain)
    assert "WARN" not in done.stdout and "ERROR" not in done.stdout


def test_strict_validation_rejects_a_misspelt_field(default_docs: list[dict]) -> None:
    """The validator really is strict: an unknown field in a probe fails."""
    dep = copy.deepcopy(by_kind(default_docs, "Deployment")[f"{RELEASE}-glmimage-denoiser"])
    dep["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["servce"] = "x"
    with pytest.raises(kv.utils.ValidationError):
        kv.validate(dep, KUBE_VERSION, strict=True)


def test_denoisers_are_discovered_through_a_headless_service(default_docs: list[dict]) -> None:
    svc = by_kind(default_docs, "Service")[f"{RELEASE}-glmimage-denoiser"]
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"]["app.kubernetes.io/component"] == "denoiser"
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {"grpc": 50061, "metrics": 9090}
    args = container(default_docs, "gateway", "gateway")["args"]
    assert f"--denoiser-dns={RELEASE}-glmimage-denoiser.{NAMESPACE}.svc.cluster.local:50061" in args
    assert f"--ar={RELEASE}-glmimage-ar.{NAMESPACE}.svc.cluster.local:50051" in args
    assert by_kind(default_docs, "Service")[f"{RELEASE}-glmimage-ar"]["spec"].get("clusterIP") != "None"


def test_ar_dns_discovery_uses_a_headless_service_of_its_own_name(tls_docs: list[dict]) -> None:
    services = by_kind(tls_docs, "Service")
    assert services[f"{RELEASE}-glmimage-ar-headless"]["spec"]["clusterIP"] == "None"
    assert f"{RELEASE}-glmimage-ar" not in services  # the ClusterIP one goes: one AR Service, one scrape target
    args = container(tls_docs, "gateway", "gateway")["args"]
    assert f"--ar-dns={RELEASE}-glmimage-ar-headless.{NAMESPACE}.svc.cluster.local:50051" in args


GATEWAY_HEADLESS = f"{RELEASE}-glmimage-gateway-headless"
GATEWAYS_TARGET = f"dns:///{GATEWAY_HEADLESS}.{NAMESPACE}.svc.cluster.local:50050"


def test_two_gateways_by_default_with_a_pdb_that_keeps_one_and_soft_anti_affinity(
        default_docs: list[dict], gpu_docs: list[dict]) -> None:
    for docs in (default_docs, gpu_docs):
        assert by_kind(docs, "Deployment")[f"{RELEASE}-glmimage-gateway"]["spec"]["replicas"] == 2
        pdbs = {name: pdb["spec"] for name, pdb in by_kind(docs, "PodDisruptionBudget").items()}
        gateway = pdbs[f"{RELEASE}-glmimage-gateway"]
        assert gateway["minAvailable"] == 1 and "maxUnavailable" not in gateway
        for component in ("ar", "denoiser"):
            assert pdbs[f"{RELEASE}-glmimage-{component}"]["maxUnavailable"] == 1
            assert "minAvailable" not in pdbs[f"{RELEASE}-glmimage-{component}"]
        anti = pod_spec(docs, "gateway")["affinity"]["podAntiAffinity"]
        (term,) = anti["preferredDuringSchedulingIgnoredDuringExecution"]
        assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
        assert "requiredDuringSchedulingIgnoredDuringExecution" not in anti


def test_every_pdb_takes_exactly_one_of_min_available_and_max_unavailable(
        documented_docs: dict[str, list[dict]]) -> None:
    """The API server refuses a budget with both (the OpenAPI schema cannot say so: kubernetes-validate accepts
    it), and one with neither means nothing. minAvailable wins when values give both; null turns it off."""
    sets = {**documented_docs, "ar-min-available": render({"ar": {"pdb": {"minAvailable": 1}}})}
    for name, docs in sets.items():
        pdbs = by_kind(docs, "PodDisruptionBudget")
        assert len(pdbs) == 3, name
        for pdb_name, pdb in pdbs.items():
            assert len({"minAvailable", "maxUnavailable"} & pdb["spec"].keys()) == 1, (name, pdb_name, pdb["spec"])
    ar = by_kind(sets["ar-min-available"], "PodDisruptionBudget")[f"{RELEASE}-glmimage-ar"]["spec"]
    assert ar["minAvailable"] == 1
    one = by_kind(documented_docs["one-gateway"], "PodDisruptionBudget")[f"{RELEASE}-glmimage-gateway"]["spec"]
    assert one["maxUnavailable"] == 1
    with pytest.raises(helm.HelmError, match="gateway.pdb needs minAvailable or maxUnavailable"):
        render({"gateway": {"pdb": {"minAvailable": None}}})
    off = by_kind(render({"gateway": {"pdb": {"enabled": False}}}), "PodDisruptionBudget")
    assert set(off) == {f"{RELEASE}-glmimage-ar", f"{RELEASE}-glmimage-denoiser"}


def test_rest_fronts_reach_every_gateway_through_a_headless_service(documented_docs: dict[str, list[dict]]) -> None:
    for name, docs in documented_docs.items():
        services = by_kind(docs, "Service")
        svc = services[GATEWAY_HEADLESS]
        spec = svc["spec"]
        # Not-ready pods too: a gateway pod's readiness waits on its REST front reaching a gateway through it.
        assert spec["clusterIP"] == "None" and spec["publishNotReadyAddresses"] is True, name
        deployments = by_kind(docs, "Deployment")
        gateway = deployments[f"{RELEASE}-glmimage-gateway"]
        assert spec["selector"] == gateway["spec"]["selector"]["matchLabels"], name
        selected = [d for d, dep in deployments.items()
                    if spec["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()]
        assert selected == [f"{RELEASE}-glmimage-gateway"], name
        assert spec["ports"] == [{"name": "grpc", "port": 50050, "targetPort": "grpc", "protocol": "TCP",
                                  "appProtocol": "grpc"}], name
        assert "glmimage.io/scrape" not in svc["metadata"]["labels"]  # scraped once, through the gRPC Service
        for service_name, service in services.items():
            ports = service["spec"]["ports"]
            assert len({p["name"] for p in ports}) == len({p["port"] for p in ports}) == len(ports), service_name
        rest_args = container(docs, "gateway", "rest")["args"]
        assert [a for a in rest_args if a.startswith("--gateway-address=")] == [f"--gateway-address={GATEWAYS_TARGET}"]
        # The gRPC Service for clients is as it was: ClusterIP, same name.
        assert services[f"{RELEASE}-glmimage-gateway"]["spec"]["type"] == "ClusterIP"
    moved = render({"clusterDomain": "corp.example", "gateway": {"port": 50070}})
    assert (f"--gateway-address=dns:///{GATEWAY_HEADLESS}.{NAMESPACE}.svc.corp.example:50070"
            in container(moved, "gateway", "rest")["args"])
    assert by_kind(moved, "Service")[GATEWAY_HEADLESS]["spec"]["ports"][0]["port"] == 50070


def test_one_gateway_still_works(documented_docs: dict[str, list[dict]]) -> None:
    docs = documented_docs["one-gateway"]
    assert by_kind(docs, "Deployment")[f"{RELEASE}-glmimage-gateway"]["spec"]["replicas"] == 1
    assert by_kind(docs, "Service")[GATEWAY_HEADLESS]["spec"]["clusterIP"] == "None"
    assert f"--gateway-address={GATEWAYS_TARGET}" in container(docs, "gateway", "rest")["args"]
    one = render({"gateway": {"replicas": 1}})
    for doc in one:
        if doc["kind"] not in CRD_KINDS:
            kv.validate(doc, KUBE_VERSION, strict=True)
    # The default budget then keeps the only gateway: the notes say drains would wait on it, and how to fix it.
    assert "WARNING: the gateway PodDisruptionBudget keeps 1 of 1" in notes({"gateway": {"replicas": 1}})
    assert "WARNING: the gateway PodDisruptionBudget" not in notes(documented_values()["one-gateway"])
    default = notes()
    assert "Gateways: 2, each with its own queue" in default and "WARNING: the gateway" not in default
    assert GATEWAY_HEADLESS in default and "resubmits" in default


def test_with_tls_the_rest_front_checks_a_name_the_certificate_carries(tls_docs: list[dict],
                                                                       default_docs: list[dict]) -> None:
    """It dials the headless FQDN, which the certificate need not carry: it checks localhost (as the probes do)."""
    args = container(tls_docs, "gateway", "rest")["args"]
    assert f"--gateway-address={GATEWAYS_TARGET}" in args
    assert "--gateway-tls-server-name=localhost" in args
    custom = render(helm_merge(TLS_VALUES, {"gateway": {"rest": {"tlsServerName": "demo-glmimage-gateway.ml.svc"}}}))
    assert "--gateway-tls-server-name=demo-glmimage-gateway.ml.svc" in container(custom, "gateway", "rest")["args"]
    assert not any(a.startswith("--gateway-tls") for a in container(default_docs, "gateway", "rest")["args"])


def _storage_bytes(quantity: str) -> float:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
    number, unit = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", quantity).groups()
    return float(number) * units.get(unit, 1)


def _immutable_changes(old: dict[str, dict], new: dict[str, dict]) -> list[str]:
    """What the API server refuses when `helm upgrade` patches old into new (same kind, same name)."""
    problems = []
    for key in old.keys() & new.keys():
        kind, name = key
        a, b = old[key].get("spec", {}), new[key].get("spec", {})
        if kind == "Service":
            # Absent (or "") means "allocate one"; "None" is headless. A ClusterIP cannot become None or back.
            if (a.get("clusterIP") == "None") != (b.get("clusterIP") == "None"):
                problems.append(f"{name}: clusterIP {a.get('clusterIP')!r} -> {b.get('clusterIP')!r}")
            if a.get("clusterIPs") != b.get("clusterIPs") and "clusterIPs" in a:
                problems.append(f"{name}: clusterIPs")
        elif kind in ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet"):
            if a["selector"] != b["selector"]:
                problems.append(f"{name}: spec.selector")
        elif kind == "PersistentVolumeClaim":
            for field in ("accessModes", "storageClassName", "volumeName", "volumeMode", "selector", "dataSource"):
                if a.get(field) != b.get(field):
                    problems.append(f"{name}: spec.{field}")
            before, after = (_storage_bytes(s["resources"]["requests"]["storage"]) for s in (a, b))
            if after < before:  # claims may only grow
                problems.append(f"{name}: storage shrinks")
        elif kind == "Job" and a["template"] != b["template"]:
            problems.append(f"{name}: Job spec.template")
    for key in old.keys() & new.keys():
        if old[key].get("immutable") and old[key].get("data") != new[key].get("data"):
            problems.append(f"{key[1]}: immutable {key[0]} data")
    return problems


def test_no_upgrade_between_documented_values_changes_an_immutable_field(
        documented_docs: dict[str, list[dict]]) -> None:
    """`helm upgrade` from any documented values set to any other: the API server accepts every patch."""
    keyed = {name: {(d["kind"], d["metadata"]["name"]): d for d in docs} for name, docs in documented_docs.items()}
    failures = []
    for old_name, old in keyed.items():
        for new_name, new in keyed.items():
            if old_name != new_name:
                failures += [f"{old_name} -> {new_name}: {p}" for p in _immutable_changes(old, new)]
    assert failures == []
    # The gateways' headless Service is in every set, under a name of its own: the gRPC Service clients use keeps
    # its ClusterIP (and its name), so an upgrade from the one-gateway chart only adds the headless one.
    for name, docs in keyed.items():
        assert docs[("Service", GATEWAY_HEADLESS)]["spec"]["clusterIP"] == "None", name
        assert docs[("Service", f"{RELEASE}-glmimage-gateway")]["spec"].get("clusterIP") != "None", name
    # The check bites: the chart's old single AR Service, ClusterIP or headless by discovery, is refused.
    ar = ("Service", f"{RELEASE}-glmimage-ar")
    headless = copy.deepcopy(keyed["default"][ar])
    headless["spec"]["clusterIP"] = "None"
    assert _immutable_changes({ar: keyed["default"][ar]}, {ar: headless}) != []
    pvc = ("PersistentVolumeClaim", "glmimage-models")
    bigger = copy.deepcopy(keyed["pvc-create"][pvc])
    bigger["spec"]["resources"]["requests"]["storage"] = "200Gi"
    assert _immutable_changes({pvc: keyed["pvc-create"][pvc]}, {pvc: bigger}) == []  # claims may grow
    assert _immutable_changes({pvc: bigger}, {pvc: keyed["pvc-create"][pvc]}) == ["glmimage-models: storage shrinks"]


def test_switching_ar_discovery_replaces_the_service(documented_docs: dict[str, list[dict]]) -> None:
    for service_set, dns_set in [("default", "ar-dns"), ("gpu", "gpu-ar-dns"), ("tls-ar-service", "tls")]:
        before, after = by_kind(documented_docs[service_set], "Service"), by_kind(documented_docs[dns_set], "Service")
        assert f"{RELEASE}-glmimage-ar" in before and f"{RELEASE}-glmimage-ar-headless" not in before
        assert f"{RELEASE}-glmimage-ar-headless" in after and f"{RELEASE}-glmimage-ar" not in after
        # Both select the same pods, and the Deployment itself is untouched by the switch.
        assert (before[f"{RELEASE}-glmimage-ar"]["spec"]["selector"]
                == after[f"{RELEASE}-glmimage-ar-headless"]["spec"]["selector"])


def _spreading_selectors(pod_spec: dict) -> list[dict]:
    """The label selectors of a pod's anti-affinity terms and topology spread constraints."""
    anti = pod_spec.get("affinity", {}).get("podAntiAffinity", {})
    terms = anti.get("requiredDuringSchedulingIgnoredDuringExecution", []) + [
        t["podAffinityTerm"] for t in anti.get("preferredDuringSchedulingIgnoredDuringExecution", [])]
    return [t["labelSelector"] for t in terms] + [c["labelSelector"]
                                                  for c in pod_spec.get("topologySpreadConstraints", [])]


def test_anti_affinity_and_spread_count_only_this_release_and_role(documented_docs: dict[str, list[dict]]) -> None:
    """A selector on the component alone would let another release's pods repel (or skew) this release's."""
    checked = set()
    for name, docs in documented_docs.items():
        for dep in by_kind(docs, "Deployment").values():
            template = dep["spec"]["template"]
            component = template["metadata"]["labels"]["app.kubernetes.io/component"]
            for selector in _spreading_selectors(template["spec"]):
                labels = selector["matchLabels"]
                assert labels["app.kubernetes.io/instance"] == RELEASE, (name, component, selector)
                assert labels["app.kubernetes.io/component"] == component, (name, component, selector)
                # and the selector matches the pods it is meant to keep apart
                assert labels.items() <= template["metadata"]["labels"].items(), (name, component, selector)
                checked.add((name, component))
    assert {("gpu", "denoiser"), ("placement", "ar"), ("placement", "denoiser"), ("placement", "gateway")} <= checked
    placement = documented_docs["placement"]
    ar = pod_spec(placement, "ar")["affinity"]
    assert "nodeAffinity" in ar and len(ar["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]) == 1
    (spread,) = pod_spec(placement, "denoiser")["topologySpreadConstraints"]
    assert spread["topologyKey"] == "topology.kubernetes.io/zone" and spread["maxSkew"] == 1
    with pytest.raises(helm.HelmError, match="podAntiAffinityPreset"):
        render({"denoiser": {"podAntiAffinityPreset": "always"}})


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
    """What the NOTES promise: only model.source=hostPath falls below restricted (and baseline)."""
    for name, docs in documented_docs.items():
        for dep in by_kind(docs, "Deployment").values():
            spec = dep["spec"]["template"]["spec"]
            where = (name, dep["metadata"]["name"])
            types = {k for v in spec["volumes"] for k in v if k != "name"}
            if name == "host-path" and dep["metadata"]["name"] != f"{RELEASE}-glmimage-gateway":
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


TOKEN_DIR = "/etc/glmimage/internal"
TOKEN_FLAG = f"--internal-token-file={TOKEN_DIR}/token"
TOKEN_HOLDERS = [("ar", "ar"), ("denoiser", "denoiser"), ("gateway", "gateway")]


def pod_spec(docs: list[dict], deployment: str) -> dict:
    return by_kind(docs, "Deployment")[f"{RELEASE}-glmimage-{deployment}"]["spec"]["template"]["spec"]


def test_internal_token_is_on_by_default_as_a_generated_secret_mounted_as_a_file(default_docs: list[dict]) -> None:
    secret = by_kind(default_docs, "Secret")[f"{RELEASE}-glmimage-internal-token"]
    token = base64.b64decode(secret["data"]["token"]).decode()
    assert len(token) == 48 and token.isalnum()
    for deployment, name in TOKEN_HOLDERS:
        c = container(default_docs, deployment, name)
        assert TOKEN_FLAG in c["args"], name
        mount = next(m for m in c["volumeMounts"] if m["mountPath"] == TOKEN_DIR)
        assert mount["readOnly"] is True
        volume = next(v for v in pod_spec(default_docs, deployment)["volumes"] if v["name"] == mount["name"])
        assert volume["secret"]["secretName"] == f"{RELEASE}-glmimage-internal-token"
        assert volume["secret"]["items"] == [{"key": "token", "path": "token"}]
    rest = container(default_docs, "gateway", "rest")
    assert not any("internal-token" in a for a in rest["args"])
    assert TOKEN_DIR not in [m["mountPath"] for m in rest["volumeMounts"]]
    # Never on a command line or in an env value: only the Secret holds it.
    deployments = json.dumps(list(by_kind(default_docs, "Deployment").values()))
    assert token not in deployments and secret["data"]["token"] not in deployments
    # Random per install (lookup keeps it across upgrades on a cluster; offline renders cannot look it up).
    again = base64.b64decode(by_kind(render(), "Secret")[f"{RELEASE}-glmimage-internal-token"]["data"]["token"])
    assert again.decode() != token


def test_internal_token_from_an_existing_secret_or_off() -> None:
    docs = render({"internalToken": {"existingSecret": "my-token", "secretKey": "value"}})
    assert by_kind(docs, "Secret") == {}
    for deployment, name in TOKEN_HOLDERS:
        assert TOKEN_FLAG in container(docs, deployment, name)["args"]
        volume = next(v for v in pod_spec(docs, deployment)["volumes"] if v["name"] == "internal-token")
        assert volume["secret"]["secretName"] == "my-token"
        assert volume["secret"]["items"] == [{"key": "value", "path": "token"}]
    off = render({"internalToken": {"enabled": False}})
    assert by_kind(off, "Secret") == {}
    for deployment, name in TOKEN_HOLDERS:
        c = container(off, deployment, name)
        assert not any("internal-token" in a for a in c["args"])
        assert TOKEN_DIR not in [m["mountPath"] for m in c["volumeMounts"]]


def test_admin_keys_reach_only_the_gateway_and_must_differ_from_user_keys(tls_docs: list[dict],
                                                                          default_docs: list[dict]) -> None:
    env = {e["name"]: e for e in container(tls_docs, "gateway", "gateway")["env"]}
    assert env["GLMIMAGE_ADMIN_KEYS"]["valueFrom"]["secretKeyRef"] == {"name": f"{RELEASE}-glmimage-admin-keys",
                                                                       "key": "GLMIMAGE_ADMIN_KEYS"}
    assert "GLMIMAGE_ADMIN_KEYS" not in {e["name"] for e in container(tls_docs, "gateway", "rest")["env"]}
    # Off by default: no admin Secret, no env, so the gateway keeps AddWorker/RemoveWorker off.
    assert "GLMIMAGE_ADMIN_KEYS" not in {e["name"] for e in container(default_docs, "gateway", "gateway")["env"]}
    existing = render({"adminKeys": {"existingSecret": "ops-admin"}})
    env = {e["name"]: e for e in container(existing, "gateway", "gateway")["env"]}
    assert env["GLMIMAGE_ADMIN_KEYS"]["valueFrom"]["secretKeyRef"]["name"] == "ops-admin"
    with pytest.raises(helm.HelmError, match="admin keys must differ"):
        render({"apiKeys": {"keys": ["same", "k2"]}, "adminKeys": {"keys": ["same"]}})
    with pytest.raises(helm.HelmError, match="admin keys must differ"):
        render({"apiKeys": {"existingSecret": "keys"}, "adminKeys": {"existingSecret": "keys",
                                                                     "secretKey": "GLMIMAGE_API_KEYS"}})


def test_gateway_pool_limits_and_rest_credentials(tls_docs: list[dict], default_docs: list[dict]) -> None:
    args = container(tls_docs, "gateway", "gateway")["args"]
    assert [a for a in args if a.startswith("--worker-allow")] == [
        "--worker-allow=*.demo-glmimage-denoiser.ml.svc.cluster.local:50061", "--worker-allow=10.0.0.0/8"]
    assert "--max-workers=$(GLMIMAGE_MAX_WORKERS)" in args
    assert by_kind(tls_docs, "ConfigMap")[f"{RELEASE}-glmimage-config"]["data"]["GLMIMAGE_MAX_WORKERS"] == "256"
    assert not any(a.startswith("--worker-allow") for a in container(default_docs, "gateway", "gateway")["args"])
    # Gateway and REST front share the user keys; the front forwards each client's header.
    assert "--gateway-auth=forward" in container(default_docs, "gateway", "rest")["args"]


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


def _expand(args: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' $(VAR) expansion in container args."""
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in args]


def test_rest_front_slow_client_values_reach_its_flags(default_docs: list[dict]) -> None:
    """config.rest's deadlines and connection bound become the REST front's own flags; the chart's defaults are
    the front's."""
    from gateway.rest.__main__ import guards_from_args, parse_args
    from gateway.rest.connections import ConnectionGuards

    def guards(docs: list[dict]) -> ConnectionGuards:
        env = by_kind(docs, "ConfigMap")[f"{RELEASE}-glmimage-config"]["data"]
        return guards_from_args(parse_args(_expand(container(docs, "gateway", "rest")["args"], env)))

    assert guards(default_docs) == ConnectionGuards()
    given = {"headerTimeout": 7, "bodyTimeout": 45, "bodyMinRate": 4096, "keepAliveTimeout": 75,
             "maxConnections": 300}
    assert guards(render({"config": {"rest": given}})) == ConnectionGuards(
        header_timeout=7, body_timeout=45, body_min_rate=4096, keep_alive_timeout=75, max_connections=300)


@pytest.mark.parametrize("values_name", ["default", "tls"])
def test_rendered_args_are_accepted_by_the_servers(values_name: str, request) -> None:
    """Every flag the chart passes exists: each container's args go through that server's own argument parser."""
    from gateway.__main__ import parse_args as gateway_args
    from gateway.rest.__main__ import parse_args as rest_args
    from services.ar.__main__ import parse_args as ar_args
    from services.denoiser.__main__ import parse_args as denoiser_args

    docs = request.getfixturevalue(f"{values_name}_docs")
    env = by_kind(docs, "ConfigMap")[f"{RELEASE}-glmimage-config"]["data"]
    parsers = {"services.ar": ar_args, "services.denoiser": denoiser_args, "gateway": gateway_args,
               "gateway.rest": rest_args}
    seen = set()
    for dep in by_kind(docs, "Deployment").values():
        for c in dep["spec"]["template"]["spec"]["containers"]:
            assert c["command"][:2] == ["python", "-m"]
            module = c["command"][2]
            args = parsers[module](_expand(c["args"], env))
            assert args.host == "0.0.0.0"
            seen.add(module)
    assert seen == set(parsers)


def test_tls_probe_script_checks_health_over_mutual_tls(tls_docs: list[dict], pki: Pki, tmp_path: Path) -> None:
    """With TLS the probes exec a script (kubelet's gRPC probe is plaintext only): run it against a real mTLS server."""
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    probe = container(tls_docs, "denoiser", "denoiser")["readinessProbe"]
    assert "grpc" not in probe
    command = probe["exec"]["command"]
    assert command[:2] == ["python", "-c"]
    tls_dir = tmp_path / "tls"
    tls_dir.mkdir()
    for name, pem in {"tls.crt": pki.client_cert, "tls.key": pki.client_key, "ca.crt": pki.ca}.items():
        (tls_dir / name).write_bytes(pem.read_bytes())

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_secure_port("127.0.0.1:0", pki.server_credentials(mutual=True))
    server.start()
    try:
        script = command[2].replace("/etc/glmimage/tls/", f"{tls_dir}/").replace("localhost:50061", f"localhost:{port}")
        assert script != command[2]

        def probe_exit() -> int:
            return subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60).returncode

        servicer.set("glmimage.v1.DenoiserService", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert probe_exit() == 1
        servicer.set("glmimage.v1.DenoiserService", health_pb2.HealthCheckResponse.SERVING)
        assert probe_exit() == 0
    finally:
        server.stop(None)
