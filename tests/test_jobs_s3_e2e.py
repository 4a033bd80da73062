"""Issue 31's S3 image store end to end: the launcher's stack (real processes, the tiny model, SQLite in the module's
own --jobs-dir) with the gateway given ``--image-store s3://BUCKET/jobs --s3-endpoint URL``, after the launcher's own
--image-store (argparse's last value wins; the gateway's log shows the bucket in use).

No S3 server is packaged for these machines, so the bucket is moto's server mode, which speaks the S3 HTTP protocol
(tests/support/s3_server.py). moto checks neither a presigned URL's expiry nor its signature; the support server
puts S3's checks of both in front of it (SigV4 query signatures recomputed with the fake credentials' secret), so
the refusals below are those checks', as S3 would answer them.

Shown: a REST job's images and a synchronous ``response_format: "url"`` answer (through the openai SDK) are
presigned GETs on the S3 endpoint, capped by --url-ttl, fetched with no credentials and equal to the synchronous
b64_json bytes for the same seed; the objects are in the bucket under the prefix, and the REST front's
/v1/images/files route does not serve them (its disk store holds nothing, a link signed for the key finds nothing);
a presigned URL with its signature or its expiry tampered with is refused 403.
"""
from __future__ import annotations

import base64
import calendar
import io
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import boto3
import httpx
import openai
import pytest
from PIL import Image

from gateway.jobs.urls import UrlSigner, load_url_secret, tenant_tag, tenant_tag_of_key
from tests.support.jobs_e2e import ALPHA, GENERATIONS, JOB_TIMEOUT_S, PNG_MAGIC, TENANTS, auth, body, submit, wait_job
from tests.support.s3_server import BUCKET, moto_s3
from tests.support.tenants_stack import TenantStack, tenant_stack, write_tenants

pytestmark = pytest.mark.e2e

PREFIX = "jobs"
URL_TTL_S = 600  # not the default 3600: the presigned URLs' X-Amz-Expires shows the gateway's flag reached the store
SIZE = 256
PROMPT = "a lighthouse in a bucket"
EXTRA = {"num_inference_steps": 2, "seed": 3}


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    """moto's S3 with the bucket made; its fake AWS credentials stay in the environment the launcher inherits."""
    with moto_s3() as endpoint:
        yield endpoint


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("jobs-s3-e2e")


@pytest.fixture(scope="module")
def stack(tiny_checkpoint: Path, s3_endpoint: str, run_dir: Path) -> Iterator[TenantStack]:
    write_tenants(run_dir / "tenants.toml", TENANTS)
    gateway = (f"--image-store=s3://{BUCKET}/{PREFIX}", f"--s3-endpoint={s3_endpoint}", f"--url-ttl={URL_TTL_S}")
    # INFO (after tenant_stack's WARNING: the launcher's last --log-level wins) for the gateway's "images in" line.
    with tenant_stack(run_dir, run_dir / "tenants.toml", "--log-level", "INFO", "--jobs-dir", str(run_dir / "jobs"),
                      *(f"--gateway-arg={a}" for a in gateway), denoisers=1) as run:
        yield run


@pytest.fixture(scope="module")
def rest(stack: TenantStack) -> Iterator[httpx.Client]:
    with stack.rest() as client:
        yield client


@pytest.fixture(scope="module")
def inline(rest: httpx.Client) -> bytes:
    """The synchronous b64_json answer's image for PROMPT and EXTRA: what every URL below must serve."""
    r = rest.post(GENERATIONS, json=body(PROMPT, size=SIZE, steps=EXTRA["num_inference_steps"], seed=EXTRA["seed"]),
                  headers=auth(ALPHA))
    assert r.status_code == 200, r.text
    (item,) = r.json()["data"]
    return _png(base64.b64decode(item["b64_json"]))


@pytest.fixture(scope="module")
def job(rest: httpx.Client) -> dict[str, Any]:
    """The same generation as a job (Prefer: respond-async), once it ended."""
    accepted = submit(rest, ALPHA, body(PROMPT, size=SIZE, steps=EXTRA["num_inference_steps"], seed=EXTRA["seed"]))
    done = wait_job(rest, ALPHA, accepted["id"])
    assert done["status"] == "completed", done
    return done


@pytest.fixture(scope="module")
def sdk_url(stack: TenantStack) -> str:
    """A synchronous response_format="url" answer's link, through the real openai SDK."""
    with openai.OpenAI(base_url=f"http://{stack.addresses['rest']}/v1", api_key=ALPHA, max_retries=0,
                       timeout=JOB_TIMEOUT_S) as client:
        res = client.images.generate(prompt=PROMPT, size=f"{SIZE}x{SIZE}", response_format="url", extra_body=EXTRA)
    (item,) = res.data
    assert item.url and item.b64_json is None, item
    return item.url


@pytest.fixture(scope="module")
def s3(s3_endpoint: str) -> Any:  # boto3's clients are untyped
    return boto3.session.Session().client("s3", endpoint_url=s3_endpoint)


def _png(data: bytes) -> bytes:
    assert data.startswith(PNG_MAGIC), data[:16]
    image = Image.open(io.BytesIO(data))
    image.verify()
    assert image.format == "PNG" and image.size == (SIZE, SIZE)
    return data


def _query(url: str) -> dict[str, str]:
    return {k: v[0] for k, v in parse_qs(urlsplit(url).query).items()}


def _key_of(url: str) -> str:
    """The image's object key (the part after the bucket and prefix) of a presigned path-style URL."""
    path = unquote(urlsplit(url).path)
    assert path.startswith(f"/{BUCKET}/{PREFIX}/"), url
    return path[len(f"/{BUCKET}/{PREFIX}/"):]


def _assert_presigned(url: str, endpoint: str, expires_at: int | None = None) -> dict[str, str]:
    """``url`` is a SigV4 presigned GET of an alpha object under the prefix, on the S3 endpoint (not the REST front),
    good for at most --url-ttl; its query."""
    parts, s3 = urlsplit(url), urlsplit(endpoint)
    assert (parts.scheme, parts.netloc) == (s3.scheme, s3.netloc), url
    assert tenant_tag_of_key(_key_of(url)) == tenant_tag("alpha"), url
    q = _query(url)
    assert q["X-Amz-Algorithm"] == "AWS4-HMAC-SHA256" and q["X-Amz-SignedHeaders"] == "host", q
    assert len(q["X-Amz-Signature"]) == 64 and int(q["X-Amz-Signature"], 16) >= 0, q
    assert q["X-Amz-Credential"].startswith("testing/"), q  # signed with the credentials the launcher passed on
    lifetime = int(q["X-Amz-Expires"])
    assert 0 < lifetime <= URL_TTL_S, q
    signed_at = calendar.timegm(time.strptime(q["X-Amz-Date"], "%Y%m%dT%H%M%SZ"))
    assert abs(signed_at - time.time()) < JOB_TIMEOUT_S, q
    if expires_at is not None:  # the job object's expires_at is when S3 stops serving it
        assert abs(signed_at + lifetime - expires_at) <= 1, (q, expires_at)
    return q


def _get(url: str) -> httpx.Response:
    """A GET with no credentials and no key: the URL alone, as a browser follows it."""
    return httpx.get(url, timeout=30)


def test_the_gateway_stores_in_the_bucket(stack: TenantStack, run_dir: Path) -> None:
    log = stack.log_text()
    assert f"images in s3://{BUCKET}/{PREFIX}," in log, log[-4000:]
    assert f"images in {run_dir / 'jobs' / 'images'}" not in log  # the launcher's own --image-store, overridden


def test_a_job_s_image_is_a_presigned_s3_url_serving_the_synchronous_bytes(
        job: dict[str, Any], inline: bytes, s3_endpoint: str) -> None:
    (item,) = job["result"]["data"]
    assert set(item) == {"url", "expires_at"}, item
    _assert_presigned(item["url"], s3_endpoint, item["expires_at"])
    r = _get(item["url"])
    assert r.status_code == 200, (r.status_code, r.text)
    assert r.headers["content-type"] == "image/png", r.headers
    assert _png(r.content) == inline


def test_openai_sdk_response_format_url_is_a_presigned_s3_png(sdk_url: str, inline: bytes, s3_endpoint: str) -> None:
    _assert_presigned(sdk_url, s3_endpoint)
    r = _get(sdk_url)
    assert r.status_code == 200 and r.headers["content-type"] == "image/png", (r.status_code, r.headers)
    assert _png(r.content) == inline  # same prompt, size, steps and seed as the b64_json answer


def test_the_objects_are_in_the_bucket_not_the_rest_front_s_store(
        stack: TenantStack, rest: httpx.Client, run_dir: Path, s3: Any, job: dict[str, Any], sdk_url: str,
        inline: bytes) -> None:
    keys = {_key_of(job["result"]["data"][0]["url"]), _key_of(sdk_url)}
    assert len(keys) == 2, keys  # a job's image and a synchronous one: two objects
    listed = {o["Key"]: o for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET)
              for o in page.get("Contents", ())}
    assert {f"{PREFIX}/{k}" for k in keys} <= listed.keys(), sorted(listed)
    assert all(k.startswith(f"{PREFIX}/") for k in listed), sorted(listed)  # nothing written outside the prefix
    for key in keys:
        obj = s3.get_object(Bucket=BUCKET, Key=f"{PREFIX}/{key}")
        assert obj["ContentType"] == "image/png" and obj["Body"].read() == inline, obj
    # The launcher's disk store (what the REST front serves) holds no image...
    images = run_dir / "jobs" / "images"
    assert not images.exists() or not [p for p in images.rglob("*") if p.is_file()], list(images.rglob("*"))
    # ...so a link to the same key that the REST front itself would accept (signed with the stack's URL secret)
    # finds nothing there: the bucket, not /v1/images/files, serves these images.
    signer = UrlSigner(load_url_secret(run_dir / "jobs" / "url-secret"), URL_TTL_S)
    for key in keys:
        path, _ = signer.sign(key, time.time())
        r = rest.get(path, headers=auth(ALPHA))
        assert r.status_code == 404, (r.status_code, r.text)


def test_a_tampered_presigned_url_is_refused_by_s3(job: dict[str, Any], inline: bytes) -> None:
    url = job["result"]["data"][0]["url"]
    q = _query(url)
    signature = q["X-Amz-Signature"]
    flipped = ("0" if signature[0] != "0" else "1") + signature[1:]
    tampered = {
        "signature": url.replace(f"X-Amz-Signature={signature}", f"X-Amz-Signature={flipped}"),
        "expiry pushed back": url.replace(f"X-Amz-Expires={q['X-Amz-Expires']}",
                                          f"X-Amz-Expires={int(q['X-Amz-Expires']) + 3600}"),
        "another image's key": url.replace("/0.png?", "/1.png?"),
    }
    for what, bad in tampered.items():
        assert bad != url, what
        r = _get(bad)
        assert r.status_code == 403 and b"<Code>SignatureDoesNotMatch</Code>" in r.content, (what, r.text)
    assert _get(url).content == inline  # the URL as given still works
