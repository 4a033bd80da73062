"""The chart's credentials: the internal token between the servers, admin keys apart from user keys, and what the
gateway and the REST front are given.
"""
from __future__ import annotations

import base64
import json

import pytest

from tests.support.chart import (
    RELEASE,
    by_kind,
    container,
    helm,
    pod_spec,
    render,
)

TOKEN_DIR = "/etc/glmimage/internal"
TOKEN_FLAG = f"--internal-token-file={TOKEN_DIR}/token"
TOKEN_HOLDERS = [("ar", "ar"), ("denoiser", "denoiser"), ("gateway", "gateway")]


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


def test_admin_keys_reach_only_the_gateway_pod_and_must_differ_from_user_keys(tls_docs: list[dict],
                                                                              default_docs: list[dict]) -> None:
    # The gateway (AddWorker, RemoveWorker) and its REST front in the same pod (the live pool page's data).
    for name in ("gateway", "rest"):
        env = {e["name"]: e for e in container(tls_docs, "gateway", name)["env"]}
        assert env["GLMIMAGE_ADMIN_KEYS"]["valueFrom"]["secretKeyRef"] == {
            "name": f"{RELEASE}-glmimage-admin-keys", "key": "GLMIMAGE_ADMIN_KEYS"}
    workers = [d for d in tls_docs if d["kind"] in ("Deployment", "StatefulSet")
               and not d["metadata"]["name"].endswith("-gateway")]
    assert workers and not any("GLMIMAGE_ADMIN_KEYS" in str(d) for d in workers)
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
