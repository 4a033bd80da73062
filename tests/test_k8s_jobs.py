"""The chart's jobs (jobs.*): off by default (--jobs-db=none); on, one job store and one image store shared by every
gateway pod: PostgreSQL's DSN from a Secret as GLMIMAGE_JOBS_DB, images on S3 (credentials from a Secret) or on a
shared volume the REST fronts serve; the URL signing secret in the gateway and REST front, the webhook master secret
in the gateway only; the job flags; and a refusal to render what cannot work (SQLite or a disk store on one pod's
disk under several gateways).
"""
from __future__ import annotations

import base64
import re
from collections import Counter
from typing import Any

import pytest

from tests.support.chart import (
    CHART,
    CRD_KINDS,
    KUBE_VERSION,
    RELEASE,
    by_kind,
    container,
    gpu_values,
    helm,
    helm_merge,
    kv,
    notes,
    pod_spec,
    render,
)

GATEWAY = f"{RELEASE}-glmimage-gateway"
URL_SECRET = "--url-secret-file=/etc/glmimage/url-secret/secret"
WEBHOOK_SECRET = "--webhook-secret-file=/etc/glmimage/webhook-secret/secret"
IMAGES_DIR = "/var/lib/glmimage/images"
# What a job flag starts with: the gateway's job store, image store and job settings; the REST front's two.
JOB_FLAGS = ("--jobs-db", "--image-store", "--s3-endpoint", "--public-url", "--url-secret-file",
             "--webhook-secret-file", "--url-ttl", "--job-ttl", "--job-timeout", "--job-concurrency",
             "--max-stored-bytes", "--webhook-retry-for", "--webhook-allow")
ONE_GATEWAY = {"replicas": 1, "pdb": {"minAvailable": None, "maxUnavailable": 1}}

# Two gateways on PostgreSQL and a bucket (values-gpu.yaml's jobs), with an endpoint and every setting given.
POSTGRES_S3: dict[str, Any] = {"jobs": {
    "enabled": True, "db": {"existingSecret": "team-jobs-db", "secretKey": "url"},
    "imageStore": "s3://images/glm/jobs", "s3": {"endpoint": "https://s3.example.com", "region": "eu-west-1",
                                                 "existingSecret": "team-s3"},
    "publicUrl": "https://glmimage.example.com", "webhookAllow": ["*.example.com", "https://10.1.2.0/24:8443"],
    "urlTtl": 1800, "ttl": 7200.5, "timeout": 900, "concurrency": 4, "maxStoredBytes": 5 * 2**30,
    "webhookRetryFor": 600}}
# Two gateways on PostgreSQL and the disk store on a ReadWriteMany claim, with existing signing secrets.
POSTGRES_DISK: dict[str, Any] = {"jobs": {
    "enabled": True, "db": {"existingSecret": "team-jobs-db"}, "imageVolume": {"existingClaim": "glm-images"},
    "urlSecret": {"existingSecret": "team-url-secret", "secretKey": "key"},
    "webhookSecret": {"existingSecret": "team-webhook-secret"}}}
# One gateway, SQLite and images on its own volumes: a claim for the database, an emptyDir for the images.
LOCAL: dict[str, Any] = {"gateway": ONE_GATEWAY, "jobs": {
    "enabled": True, "db": {"allowLocal": True, "localVolume": {"existingClaim": "glm-jobs"}}}}
SETS = {"postgres-s3": POSTGRES_S3, "postgres-disk": POSTGRES_DISK, "local": LOCAL,
        "local-empty-dir": {"gateway": ONE_GATEWAY, "jobs": {"enabled": True, "db": {"allowLocal": True}}},
        "gpu": gpu_values(), "off": {}}


@pytest.fixture(scope="module")
def docs() -> dict[str, list[dict]]:
    return {name: render(values) for name, values in SETS.items()}


def _job_args(docs: list[dict], name: str) -> list[str]:
    return [a for a in container(docs, "gateway", name)["args"] if a.startswith(JOB_FLAGS)]


def _env(docs: list[dict], name: str) -> dict[str, dict]:
    return {e["name"]: e for e in container(docs, "gateway", name)["env"]}


def _volumes(docs: list[dict]) -> dict[str, dict]:
    return {v["name"]: v for v in pod_spec(docs, "gateway")["volumes"]}


def _mounts(docs: list[dict], name: str) -> dict[str, dict]:
    return {m["name"]: m for m in container(docs, "gateway", name)["volumeMounts"]}


def _annotations(docs: list[dict]) -> dict[str, str]:
    return by_kind(docs, "Deployment")[GATEWAY]["spec"]["template"]["metadata"]["annotations"]


def test_off_by_default_the_gateways_keep_no_jobs(docs: dict[str, list[dict]]) -> None:
    """Off, each gateway is told to keep no job store: left to its default it would keep one on its own disk, and a
    job submitted through one gateway would be unknown to the others."""
    from gateway.jobs.setup import JOBS_OFF

    off = docs["off"]
    assert _job_args(off, "gateway") == [f"--jobs-db={JOBS_OFF}"]
    assert _job_args(off, "rest") == []
    assert not {"jobs-db", "job-images", "url-secret", "webhook-secret"} & set(_volumes(off))
    assert "checksum/jobs" not in _annotations(off)
    # The chart's surge-first roll (tests/test_k8s_rolling.py), not the stop-first one of a local job store.
    assert by_kind(off, "Deployment")[GATEWAY]["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1,
                                                                                        "maxUnavailable": 0}
    assert set(by_kind(off, "Secret")) == {f"{RELEASE}-glmimage-internal-token"}
    assert "Jobs are off (jobs.enabled=false)" in notes()


def test_postgres_dsn_and_s3_credentials_come_from_secrets_as_the_gateway_s_environment(
        docs: dict[str, list[dict]]) -> None:
    d = docs["postgres-s3"]
    env = _env(d, "gateway")
    assert env["GLMIMAGE_JOBS_DB"]["valueFrom"]["secretKeyRef"] == {"name": "team-jobs-db", "key": "url"}
    assert env["AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"] == {"name": "team-s3", "key": "AWS_ACCESS_KEY_ID"}
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "team-s3",
                                                                         "key": "AWS_SECRET_ACCESS_KEY"}
    assert env["AWS_DEFAULT_REGION"] == {"name": "AWS_DEFAULT_REGION", "value": "eu-west-1"}
    # The REST front never touches the job store or the bucket.
    assert not {"GLMIMAGE_JOBS_DB", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} & set(_env(d, "rest"))
    # The DSN reaches the gateway by environment only: no --jobs-db, which would win over it.
    assert _job_args(d, "gateway") == [
        "--image-store=s3://images/glm/jobs", "--s3-endpoint=https://s3.example.com",
        "--public-url=https://glmimage.example.com", URL_SECRET, WEBHOOK_SECRET, "--url-ttl=1800",
        "--job-ttl=7200.5", "--job-timeout=900", "--job-concurrency=4",
        f"--max-stored-bytes={5 * 2**30}",  # an integer, not Helm's 5.36870912e+09
        "--webhook-retry-for=600", "--webhook-allow=*.example.com", "--webhook-allow=https://10.1.2.0/24:8443"]
    # A bucket serves its presigned URLs itself: the REST front gets neither a store nor the signing secret.
    assert _job_args(d, "rest") == []
    assert "job-images" not in _volumes(d) and "url-secret" not in _mounts(d, "rest")
    # The signing secrets the chart made, mounted read-only as files in the gateway.
    secrets = by_kind(d, "Secret")
    for name, volume in (("url-secret", "url-secret"), ("webhook-secret", "webhook-secret")):
        value = base64.b64decode(secrets[f"{RELEASE}-glmimage-{name}"]["data"]["secret"]).decode()
        assert re.fullmatch(r"[A-Za-z0-9]{64}", value), name
        assert _volumes(d)[volume]["secret"] == {"secretName": f"{RELEASE}-glmimage-{name}", "defaultMode": 0o440,
                                                 "items": [{"key": "secret", "path": "secret"}]}
        assert _mounts(d, "gateway")[volume] == {"name": volume, "mountPath": f"/etc/glmimage/{name}",
                                                 "readOnly": True}
    assert "webhook-secret" not in _mounts(d, "rest")
    text = notes(POSTGRES_S3)
    assert "Jobs: in the PostgreSQL of Secret team-jobs-db (key url)." in text
    assert "Images: s3://images/glm/jobs (presigned URLs)." in text and "Webhooks are refused" not in text


def test_the_disk_store_on_a_shared_claim_is_served_by_every_rest_front(docs: dict[str, list[dict]]) -> None:
    d = docs["postgres-disk"]
    assert _volumes(d)["job-images"] == {"name": "job-images", "persistentVolumeClaim": {"claimName": "glm-images"}}
    # The gateway writes (and expires) the images; the REST front only reads and serves them.
    assert _mounts(d, "gateway")["job-images"] == {"name": "job-images", "mountPath": IMAGES_DIR}
    assert _mounts(d, "rest")["job-images"] == {"name": "job-images", "mountPath": IMAGES_DIR, "readOnly": True}
    assert _job_args(d, "rest") == [f"--image-store={IMAGES_DIR}", URL_SECRET]
    assert f"--image-store={IMAGES_DIR}" in _job_args(d, "gateway")
    # One secret signs and checks the URLs: the same Secret in both containers; the webhook one in the gateway only.
    assert _volumes(d)["url-secret"]["secret"]["secretName"] == "team-url-secret"
    assert _volumes(d)["url-secret"]["secret"]["items"] == [{"key": "key", "path": "secret"}]
    assert _mounts(d, "rest")["url-secret"] == _mounts(d, "gateway")["url-secret"]
    assert _volumes(d)["webhook-secret"]["secret"]["secretName"] == "team-webhook-secret"
    assert "webhook-secret" not in _mounts(d, "rest")
    # Existing Secrets: the chart makes none of its own.
    assert set(by_kind(d, "Secret")) == {f"{RELEASE}-glmimage-internal-token"}
    assert "AWS_ACCESS_KEY_ID" not in _env(d, "gateway") and not any("s3" in a for a in _job_args(d, "gateway"))


def test_one_gateway_may_keep_sqlite_on_its_own_volume_and_rolls_stop_first(docs: dict[str, list[dict]]) -> None:
    for name, volume in (("local", {"persistentVolumeClaim": {"claimName": "glm-jobs"}}),
                         ("local-empty-dir", {"emptyDir": {"sizeLimit": "1Gi"}})):
        d = docs[name]
        assert _job_args(d, "gateway")[0] == "--jobs-db=/var/lib/glmimage/jobs/jobs.sqlite3", name
        assert "GLMIMAGE_JOBS_DB" not in _env(d, "gateway"), name
        assert _volumes(d)["jobs-db"] == {"name": "jobs-db", **volume}, name
        assert _mounts(d, "gateway")["jobs-db"] == {"name": "jobs-db", "mountPath": "/var/lib/glmimage/jobs"}, name
        assert "jobs-db" not in _mounts(d, "rest"), name
        # One pod, so its images may live on an emptyDir both of its containers share.
        assert _volumes(d)["job-images"] == {"name": "job-images", "emptyDir": {"sizeLimit": "10Gi"}}, name
        # The old pod lets the file go before the new one opens it (and a ReadWriteOnce claim can move).
        assert by_kind(d, "Deployment")[GATEWAY]["spec"]["strategy"] == {
            "type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}, name
    assert by_kind(docs["postgres-disk"], "Deployment")[GATEWAY]["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 1
    assert "SQLite on the gateway pod's claim glm-jobs" in notes(LOCAL)
    assert "emptyDir: lost, queued jobs too, when the pod goes" in notes(SETS["local-empty-dir"])


@pytest.mark.parametrize("values,message", [
    ({"jobs": {"enabled": True}},
     "the 2 gateways must share one job store, and SQLite on a pod's disk cannot be shared"),
    ({"jobs": {"enabled": True, "db": {"allowLocal": True}}, "gateway": {"replicas": 3}},
     "the 3 gateways must share one job store"),
    ({"jobs": {"enabled": True}, "gateway": ONE_GATEWAY}, "or jobs.db.allowLocal=true"),
    ({"jobs": {"enabled": True, "db": {"existingSecret": "x", "allowLocal": True}}}, "not both"),
    ({"jobs": {"enabled": True, "db": {"existingSecret": "x", "localVolume": {"existingClaim": "c"}}},
      "gateway": ONE_GATEWAY}, "jobs.db.localVolume is SQLite's volume"),
    ({"jobs": {"enabled": True, "db": {"existingSecret": "x"}}},
     "the REST front of each of the 2 gateway pods serves images any gateway stored"),
    ({"jobs": {"enabled": True, "db": {"allowLocal": True}}, "gateway": {**ONE_GATEWAY, "rest": {"enabled": False}}},
     "served by the REST front (gateway.rest.enabled=false)"),
    ({"jobs": {"enabled": True, "db": {"existingSecret": "x"}, "imageStore": "/data/images"}},
     "jobs.imageStore must be empty (the disk store) or s3://BUCKET/PREFIX"),
    ({"jobs": {"enabled": True, "db": {"existingSecret": "x"}, "imageStore": "s3:///prefix"}}, "s3://BUCKET/PREFIX"),
    ({"jobs": {"enabled": True, "db": {"existingSecret": "x"}, "imageStore": "s3://b",
               "imageVolume": {"existingClaim": "c"}}}, "jobs.imageVolume is the disk image store's volume"),
    ({"jobs": {"enabled": True, "db": {"existingSecret": "x"}, "imageVolume": {"existingClaim": "c"},
               "s3": {"endpoint": "https://s3"}}}, "jobs.s3.* configure an S3 image store"),
    ({"jobs": {**POSTGRES_S3["jobs"], "publicUrl": "glmimage.example.com"}}, "jobs.publicUrl must be"),
    ({"jobs": {**POSTGRES_S3["jobs"], "webhookAllow": "*.example.com"}}, "jobs.webhookAllow must be a list"),
    ({"jobs": {**POSTGRES_S3["jobs"], "maxStoredBytes": "1Gi"}}, 'jobs.maxStoredBytes must be a number, not "1Gi"'),
    ({"jobs": {**POSTGRES_S3["jobs"], "urlTtl": 0}}, "jobs.urlTtl must be at least 1"),
    ({"jobs": {**POSTGRES_S3["jobs"], "concurrency": -1}}, "jobs.concurrency must be at least 0"),
])
def test_what_cannot_work_stops_the_render_with_the_values_named(values: dict, message: str) -> None:
    with pytest.raises(helm.HelmError, match=re.escape(message)):
        render(values)


def test_no_runners_is_a_valid_setting() -> None:
    """--job-concurrency=0: gateways that serve JobService and run no job (others run them)."""
    d = render({"jobs": {**POSTGRES_S3["jobs"], "concurrency": 0}})
    assert "--job-concurrency=0" in _job_args(d, "gateway")


def test_a_change_of_the_jobs_block_rolls_the_gateway_pods() -> None:
    def checksum(values: dict) -> str:
        return _annotations(render(values))["checksum/jobs"]

    base = checksum(POSTGRES_DISK)
    assert checksum(POSTGRES_DISK) == base  # stable across renders: no generated value in it
    for change in ({"revision": "2"}, {"urlSecret": {"existingSecret": "team-url-secret-v2"}},
                   {"db": {"existingSecret": "other-db"}}):
        assert checksum(helm_merge(POSTGRES_DISK, {"jobs": change})) != base, change
    # The model servers never roll for a jobs change.
    for deployment in ("ar", "denoiser"):
        annotations = by_kind(render(POSTGRES_DISK), "Deployment")[f"{RELEASE}-glmimage-{deployment}"]["spec"][
            "template"]["metadata"]["annotations"]
        assert "checksum/jobs" not in annotations


def test_pod_specs_name_each_volume_port_and_variable_once(docs: dict[str, list[dict]]) -> None:
    for name, d in docs.items():
        for dep in by_kind(d, "Deployment").values():
            spec = dep["spec"]["template"]["spec"]
            where = (name, dep["metadata"]["name"])
            volumes = [v["name"] for v in spec["volumes"]]
            assert len(volumes) == len(set(volumes)), (where, Counter(volumes))
            ports = [p["name"] for c in spec["containers"] for p in c.get("ports", [])]
            assert len(ports) == len(set(ports)), (where, ports)
            numbers = [p["containerPort"] for c in spec["containers"] for p in c.get("ports", [])]
            assert len(numbers) == len(set(numbers)), (where, numbers)
            for c in spec["containers"]:
                mounts = [m["mountPath"] for m in c["volumeMounts"]]
                assert len(mounts) == len(set(mounts)), (where, c["name"], mounts)
                assert {m["name"] for m in c["volumeMounts"]} <= set(volumes), (where, c["name"])
                env = [e["name"] for e in c.get("env", [])]
                assert len(env) == len(set(env)), (where, c["name"], env)
                flags = [a.split("=", 1)[0] for a in c["args"] if a.startswith(JOB_FLAGS)]
                repeated = {f for f, n in Counter(flags).items() if n > 1} - {"--webhook-allow"}
                assert not repeated, (where, c["name"], repeated)


@pytest.mark.parametrize("name", [n for n in SETS if n != "off"])
def test_lint_and_strict_schema_validation(name: str, docs: dict[str, list[dict]]) -> None:
    report = helm.lint(str(CHART), SETS[name], strict=True, kube_version=f"v{KUBE_VERSION}")
    assert report["errors"] == [] and [m for m in report["messages"] if m["severity"] >= 2] == []
    for doc in docs[name]:
        if doc["kind"] not in CRD_KINDS:
            kv.validate(doc, KUBE_VERSION, strict=True)  # raises on any unknown field or wrong type


def test_turning_jobs_on_or_off_changes_no_immutable_field(docs: dict[str, list[dict]]) -> None:
    from tests.test_k8s import _immutable_changes

    keyed = {name: {(d["kind"], d["metadata"]["name"]): d for d in ds} for name, ds in docs.items()}
    failures = [f"{a} -> {b}: {p}" for a in keyed for b in keyed if a != b
                for p in _immutable_changes(keyed[a], keyed[b])]
    assert failures == []


@pytest.mark.parametrize("name", list(SETS))
def test_the_servers_accept_the_job_flags(name: str, docs: dict[str, list[dict]]) -> None:
    """Every job flag the chart renders exists in the gateway's and the REST front's parsers, with the meaning the
    values give it."""
    from gateway.__main__ import parse_args as gateway_args
    from rest.__main__ import parse_args as rest_args
    from tests.test_k8s import _expand

    d = docs[name]
    env = by_kind(d, "ConfigMap")[f"{RELEASE}-glmimage-config"]["data"]
    gateway = vars(gateway_args(_expand(container(d, "gateway", "gateway")["args"], env)))
    rest_args(_expand(container(d, "gateway", "rest")["args"], env))
    if name == "postgres-s3":
        assert {k: gateway[k] for k in ("url_ttl", "job_ttl", "job_timeout", "job_concurrency", "max_stored_bytes",
                                        "webhook_retry_for")} == {
            "url_ttl": 1800, "job_ttl": 7200.5, "job_timeout": 900, "job_concurrency": 4,
            "max_stored_bytes": 5 * 2**30, "webhook_retry_for": 600}
        assert gateway["webhook_allow"] == ["*.example.com", "https://10.1.2.0/24:8443"]
        assert (gateway["image_store"], gateway["public_url"]) == ("s3://images/glm/jobs",
                                                                   "https://glmimage.example.com")


def test_the_chart_s_job_defaults_are_the_gateway_s() -> None:
    """values.yaml's jobs.* numbers, the flags' own defaults (as config.rest's are the REST front's)."""
    from gateway.__main__ import parse_args as gateway_args

    defaults = vars(gateway_args([]))
    values = helm.values_from_yaml((CHART / "values.yaml").read_text())["jobs"]
    chart = {"url_ttl": values["urlTtl"], "job_ttl": values["ttl"], "job_timeout": values["timeout"],
             "job_concurrency": values["concurrency"], "max_stored_bytes": values["maxStoredBytes"],
             "webhook_retry_for": values["webhookRetryFor"]}
    assert {k: defaults[k] for k in chart} == chart
