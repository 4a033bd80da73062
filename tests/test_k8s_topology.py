"""How the chart wires its parts: denoiser and AR discovery through headless Services, two gateways with their
disruption budget, REST fronts reaching every gateway, and anti-affinity that counts only this release and role.
"""
from __future__ import annotations

import pytest

from tests.support.chart import (
    CRD_KINDS,
    GATEWAY_HEADLESS,
    GATEWAYS_TARGET,
    KUBE_VERSION,
    NAMESPACE,
    RELEASE,
    TLS_VALUES,
    by_kind,
    container,
    documented_values,
    helm,
    helm_merge,
    kv,
    notes,
    pod_spec,
    render,
)


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
