"""The Helm chart (k8s/glmimage): renders, lints, validates against the Kubernetes schemas, upgrades between any two
documented values sets, and passes only flags the servers accept.

Rendering and lint use helm-python-sdk (Helm's Go SDK, bundled); validation uses kubernetes-validate --strict.
The ServiceMonitor is a CRD with no bundled schema: it is checked by hand (tests/test_k8s_pods.py) and skipped by
the validator. The rendered objects are shared fixtures (tests/conftest.py); the chart helpers are in
tests/support/chart.py.
"""
from __future__ import annotations

import copy
import re
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import yaml

from tests.support.certs import Pki
from tests.support.chart import (
    CHART,
    CRD_KINDS,
    GATEWAY_HEADLESS,
    KUBE_VERSION,
    RELEASE,
    TLS_VALUES,
    by_kind,
    container,
    gpu_values,
    helm,
    kv,
    render,
)


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


def _expand(args: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' $(VAR) expansion in container args."""
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in args]


def test_rest_front_slow_client_values_reach_its_flags(default_docs: list[dict]) -> None:
    """config.rest's deadlines and connection bound become the REST front's own flags; the chart's defaults are
    the front's."""
    from rest.__main__ import guards_from_args, parse_args
    from rest.connections import ConnectionGuards

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
    from rest.__main__ import parse_args as rest_args
    from services.ar.__main__ import parse_args as ar_args
    from services.denoiser.__main__ import parse_args as denoiser_args

    docs = request.getfixturevalue(f"{values_name}_docs")
    env = by_kind(docs, "ConfigMap")[f"{RELEASE}-glmimage-config"]["data"]
    parsers = {"services.ar": ar_args, "services.denoiser": denoiser_args, "gateway": gateway_args,
               "rest": rest_args}
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


def test_tracing_endpoint_reaches_every_container(default_docs: list[dict], tls_docs: list[dict]) -> None:
    """tracing.otlpEndpoint becomes every server's --otlp-endpoint (the tls set names one); empty: no flag, off."""
    def endpoints(docs: list[dict]) -> dict[str, list[str]]:
        return {c["name"]: [a for a in c["args"] if a.startswith("--otlp-endpoint")]
                for dep in by_kind(docs, "Deployment").values() for c in dep["spec"]["template"]["spec"]["containers"]}

    assert set(endpoints(default_docs)) == {"ar", "denoiser", "gateway", "rest"}
    assert all(not flags for flags in endpoints(default_docs).values())
    flag = f"--otlp-endpoint={TLS_VALUES['tracing']['otlpEndpoint']}"
    assert all(flags == [flag] for flags in endpoints(tls_docs).values()), endpoints(tls_docs)
