"""The chart's tenants: the tenants file from a Secret (the chart's, from tenants.file, or an existing one), mounted
read-only into the gateway pods, --tenants on the gateway and the REST front, a checksum that rolls the gateway pods
on a change, the REST fronts' own key for /health, and --quota-store for the gateways' shared quota counters.
"""
from __future__ import annotations

import base64
import re
from pathlib import Path

import pytest

from runtime.tenants import parse_tenants
from tests.support.chart import (
    CHART,
    CRD_KINDS,
    KUBE_VERSION,
    RELEASE,
    by_kind,
    container,
    helm,
    kv,
    notes,
    pod_spec,
    render,
)

REPO = Path(__file__).resolve().parents[1]
TENANTS_DIR = "/etc/glmimage/tenants"
TENANTS_FLAG = f"--tenants={TENANTS_DIR}/tenants.toml"
GATEWAY = f"{RELEASE}-glmimage-gateway"


def _docs_example() -> str:
    """The tenants file docs/operating.md#tenants shows."""
    text = (REPO / "docs" / "operating.md").read_text()
    section = text.split("\n## Tenants\n", 1)[1]
    return re.search(r"```toml\n(.*?)```", section, re.S).group(1)


FILE = _docs_example()
ON = {"tenants": {"file": FILE, "restKey": {"key": "sk-alpha-1"}}, "quotaStore": {"url": "redis://redis:6379/0"}}
EXISTING = {"tenants": {"existingSecret": "team-tenants", "secretKey": "file", "revision": "7",
                        "restKey": {"existingSecret": "team-probe-key"}}}


@pytest.fixture(scope="module")
def on_docs() -> list[dict]:
    return render(ON)


@pytest.fixture(scope="module")
def existing_docs() -> list[dict]:
    return render(EXISTING)


def _annotations(docs: list[dict], deployment: str) -> dict[str, str]:
    return by_kind(docs, "Deployment")[f"{RELEASE}-glmimage-{deployment}"]["spec"]["template"]["metadata"][
        "annotations"]


def _tenants_volume(docs: list[dict]) -> dict:
    return next(v for v in pod_spec(docs, "gateway")["volumes"] if v["name"] == "tenants")


def test_the_file_goes_into_a_secret_mounted_read_only_in_both_containers_with_the_flag(on_docs: list[dict]) -> None:
    secret = by_kind(on_docs, "Secret")[f"{RELEASE}-glmimage-tenants"]
    text = base64.b64decode(secret["data"]["tenants.toml"]).decode()
    assert text == FILE  # byte for byte
    tenants = parse_tenants(text)  # what the gateway will load from the mount
    assert set(tenants.by_name) == {"alpha", "beta"} and tenants.by_name["beta"].weight == 2
    volume = _tenants_volume(on_docs)
    assert volume["secret"] == {"secretName": f"{RELEASE}-glmimage-tenants", "defaultMode": 0o440,
                                "items": [{"key": "tenants.toml", "path": "tenants.toml"}]}
    for name in ("gateway", "rest"):
        c = container(on_docs, "gateway", name)
        assert c["args"].count(TENANTS_FLAG) == 1, name
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == "tenants"]
        # The directory, not a subPath: an edited Secret reaches the file in place, for a SIGHUP to reload.
        assert mount == {"name": "tenants", "mountPath": TENANTS_DIR, "readOnly": True}, name
    # The file is the gateway pods' only: the model servers never see it, and do not roll on a change.
    for deployment in ("ar", "denoiser"):
        assert "tenants" not in str(pod_spec(on_docs, deployment)), deployment
        assert "checksum/tenants" not in _annotations(on_docs, deployment)


def test_the_rest_fronts_present_their_own_key_from_a_secret(on_docs: list[dict], existing_docs: list[dict]) -> None:
    secret = by_kind(on_docs, "Secret")[f"{RELEASE}-glmimage-rest-key"]
    assert secret["stringData"] == {"GLMIMAGE_GATEWAY_API_KEY": "sk-alpha-1"}
    for docs, name in ((on_docs, f"{RELEASE}-glmimage-rest-key"), (existing_docs, "team-probe-key")):
        env = {e["name"]: e for e in container(docs, "gateway", "rest")["env"]}
        assert env["GLMIMAGE_GATEWAY_API_KEY"]["valueFrom"]["secretKeyRef"] == {
            "name": name, "key": "GLMIMAGE_GATEWAY_API_KEY"}
        # The gateway checks keys against the file; it is given no key of its own, and no key list at all.
        names = {e["name"] for e in container(docs, "gateway", "gateway")["env"]}
        assert not names & {"GLMIMAGE_GATEWAY_API_KEY", "GLMIMAGE_API_KEYS", "GLMIMAGE_ADMIN_KEYS"}
    # Never on a command line.
    assert "sk-alpha-1" not in str(by_kind(on_docs, "Deployment"))


def test_an_existing_secret_is_mounted_and_the_chart_makes_none(existing_docs: list[dict]) -> None:
    assert set(by_kind(existing_docs, "Secret")) == {f"{RELEASE}-glmimage-internal-token"}
    assert _tenants_volume(existing_docs)["secret"]["secretName"] == "team-tenants"
    assert _tenants_volume(existing_docs)["secret"]["items"] == [{"key": "file", "path": "tenants.toml"}]
    for name in ("gateway", "rest"):
        assert TENANTS_FLAG in container(existing_docs, "gateway", name)["args"], name


def test_a_change_of_the_tenants_rolls_the_gateway_pods_and_nothing_else_does() -> None:
    def checksum(values: dict) -> str:
        return _annotations(render(values), "gateway")["checksum/tenants"]

    base = checksum(ON)
    edited = {**ON, "tenants": {**ON["tenants"], "file": FILE.replace("weight = 2", "weight = 3")}}
    assert checksum(edited) != base
    assert checksum({**ON, "quotaStore": {"url": "redis://other:6379/1"}}) == base  # the args change instead
    # An existing Secret's content is out of the chart's sight: its revision (or its name) stands for it.
    existing = checksum(EXISTING)
    assert checksum({"tenants": {**EXISTING["tenants"], "revision": "8"}}) != existing
    assert checksum({"tenants": {**EXISTING["tenants"], "existingSecret": "team-tenants-v2"}}) != existing
    assert checksum(EXISTING) == existing  # stable across renders


def test_no_tenants_no_flag_no_mount_no_annotation(default_docs: list[dict]) -> None:
    assert "checksum/tenants" not in _annotations(default_docs, "gateway")
    assert "tenants" not in [v["name"] for v in pod_spec(default_docs, "gateway")["volumes"]]
    for name in ("gateway", "rest"):
        c = container(default_docs, "gateway", name)
        assert not any(a.startswith(("--tenants", "--quota-store")) for a in c["args"]), name
        assert "tenants" not in [m["name"] for m in c["volumeMounts"]], name
        assert "GLMIMAGE_GATEWAY_API_KEY" not in {e["name"] for e in c["env"]}, name
    assert not any("tenants" in n or "rest-key" in n for n in by_kind(default_docs, "Secret"))


def test_the_quota_store_reaches_the_gateway_only(on_docs: list[dict], existing_docs: list[dict]) -> None:
    assert [a for a in container(on_docs, "gateway", "gateway")["args"] if a.startswith("--quota-store")] == [
        "--quota-store=redis://redis:6379/0"]
    assert not any(a.startswith("--quota-store") for a in container(on_docs, "gateway", "rest")["args"])
    # Absent: each gateway counts its tenants' quotas on its own.
    assert not any(a.startswith("--quota-store") for a in container(existing_docs, "gateway", "gateway")["args"])


@pytest.mark.parametrize("values,message", [
    ({"tenants": {"file": FILE, "existingSecret": "x", "restKey": {"key": "k"}}}, "not both"),
    ({"tenants": {"file": FILE, "restKey": {"key": "k", "existingSecret": "x"}}}, "not both"),
    ({"tenants": {"file": FILE}}, "tenants.restKey"),
    ({**ON, "apiKeys": {"keys": ["k1"]}}, "leave apiKeys and adminKeys empty"),
    ({**ON, "adminKeys": {"existingSecret": "ops-admin"}}, "leave apiKeys and adminKeys empty"),
    ({"tenants": {"file": "[tenants.alpha\nkeys = 1", "restKey": {"key": "k"}}}, "not valid TOML"),
    ({"tenants": {"file": 'title = "no tenants"', "restKey": {"key": "k"}}}, "names no tenant"),
    ({**ON, "quotaStore": {"url": "redis:6379"}}, "redis://HOST:PORT/N"),
    ({"quotaStore": {"url": "redis://redis:6379/0"}}, "set tenants.file or tenants.existingSecret"),
])
def test_misconfigurations_stop_the_render_with_the_value_named(values: dict, message: str) -> None:
    with pytest.raises(helm.HelmError, match=re.escape(message)):
        render(values)


def test_without_the_rest_front_no_rest_key_is_needed() -> None:
    docs = render({"tenants": {"existingSecret": "team-tenants"}, "gateway": {"rest": {"enabled": False}}})
    assert TENANTS_FLAG in container(docs, "gateway", "gateway")["args"]
    assert not any("rest-key" in n for n in by_kind(docs, "Secret"))


@pytest.mark.parametrize("values", [ON, EXISTING], ids=["file", "existing-secret"])
def test_lint_and_strict_schema_validation(values: dict) -> None:
    report = helm.lint(str(CHART), values, strict=True, kube_version=f"v{KUBE_VERSION}")
    assert report["errors"] == [] and [m for m in report["messages"] if m["severity"] >= 2] == []
    for doc in render(values):
        if doc["kind"] not in CRD_KINDS:
            kv.validate(doc, KUBE_VERSION, strict=True)  # raises on any unknown field or wrong type


def test_the_servers_accept_the_tenant_flags(on_docs: list[dict]) -> None:
    """The gateway and the REST front parse their args, --tenants and --quota-store included."""
    from gateway.__main__ import parse_args as gateway_args
    from rest.__main__ import parse_args as rest_args
    from tests.test_k8s import _expand

    env = by_kind(on_docs, "ConfigMap")[f"{RELEASE}-glmimage-config"]["data"]
    gateway = gateway_args(_expand(container(on_docs, "gateway", "gateway")["args"], env))
    assert (str(gateway.tenants), gateway.quota_store) == (f"{TENANTS_DIR}/tenants.toml", "redis://redis:6379/0")
    rest = rest_args(_expand(container(on_docs, "gateway", "rest")["args"], env))
    assert str(rest.tenants) == f"{TENANTS_DIR}/tenants.toml"


def test_install_notes_say_where_the_tenants_are_and_how_quotas_count() -> None:
    on, existing = notes(ON), notes(EXISTING)
    assert f"Secret {RELEASE}-glmimage-tenants (key tenants.toml)" in on
    assert "Quotas are counted in redis://redis:6379/0" in on and "tenants.revision" not in on
    assert "Secret team-tenants (key file)" in existing and "counts the quotas on its own" in existing
    assert "tenants.revision, or send them SIGHUP" in existing
    assert "Tenants:" not in notes()
