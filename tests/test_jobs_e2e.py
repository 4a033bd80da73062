"""Issue 31's jobs end to end on the launcher's stack (real processes, the tiny model, SQLite in the module's own
--jobs-dir): `Prefer: respond-async` on generations and edits, polling to the end, the images at signed links whose
bytes are the synchronous answer's, progress and queue positions, cancelling a queued and a running job, listing
with pagination, the openai SDK's response_format="url"; a job and its links seen only by its tenant (404 for
another's key, the signature the capability, 403 for a tampered or expired link, 404 for any malformed id); and
gRPC's JobService (submit, watch to the end, get, list, cancel, NOT_FOUND across tenants, UNAUTHENTICATED without a
key).

The gateway runs one job at a time (--job-concurrency=1), so a long job holds its runner and the jobs sent after it
stay queued in the store until it ends: the queued states below are deterministic, not a race.
"""
from __future__ import annotations

import base64
import io
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import grpc
import httpx
import openai
import pytest
from PIL import Image

from gateway.jobs.urls import UrlSigner, load_url_secret
from glmimage.v1 import gateway_service_pb2 as pb
from glmimage.v1 import job_service_pb2 as jpb
from glmimage.v1 import job_service_pb2_grpc
from tests.support.images import image_file
from tests.support.jobs_e2e import (
    ALPHA,
    ASYNC,
    BETA,
    GENERATIONS,
    JOB_TIMEOUT_S,
    JOBS,
    PNG_MAGIC,
    SIZE,
    TERMINAL,
    auth,
    body,
    get_job,
    jobs_stack,
    poll_job,
    submit,
    wait_job,
)
from tests.support.tenants_stack import TenantStack, bearer

pytestmark = pytest.mark.e2e

JOB_ID = re.compile(r"job_[0-9a-f]{32}")
# A job that runs long enough to be seen running, and to hold the runner while others queue: 4 images of 256x256
# at 200 steps, some 10 s alone on a loaded 2-core machine; the tests cancel it once it has started.
LONG = {"n": 4, "steps": 200, "size": 256}
MALFORMED_IDS = ("nope", "job_", "job_" + "g" * 32, "JOB_" + "0" * 32, "job_" + "0" * 31, "job_" + "0" * 33,
                 "job_" + "a" * 5000, "%00", "%C3%A9t%C3%A9", "job_%FF", "job_0..%2F..%2Fetc", "'%20OR%201=1")


@pytest.fixture(scope="module")
def stack(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TenantStack]:
    with jobs_stack(tmp_path_factory.mktemp("jobs-e2e"), "--job-concurrency=1") as run:
        yield run


@pytest.fixture(scope="module")
def rest(stack: TenantStack) -> Iterator[httpx.Client]:
    with stack.rest() as client:
        yield client


@pytest.fixture(scope="module")
def alpha_job(rest: httpx.Client) -> dict[str, Any]:
    """Alpha's two-image job: the 202's body, the job once it ended, and the request it was."""
    payload = body("a lighthouse at dusk", seed=7, n=2, steps=3)
    accepted = submit(rest, ALPHA, payload)
    return {"accepted": accepted, "final": wait_job(rest, ALPHA, accepted["id"]), "payload": payload}


@pytest.fixture(scope="module")
def sdk(stack: TenantStack) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"http://{stack.addresses['rest']}/v1", api_key=ALPHA, max_retries=0,
                       timeout=JOB_TIMEOUT_S) as client:
        yield client


def _png(data: bytes, size: tuple[int, int] = (SIZE, SIZE)) -> bytes:
    assert data.startswith(PNG_MAGIC), data[:16]
    image = Image.open(io.BytesIO(data))
    image.verify()
    assert image.format == "PNG" and image.size == size
    return data


def _fetch(stack: TenantStack, url: str, key: str | None = None) -> httpx.Response:
    assert urlsplit(url).netloc == stack.addresses["rest"], url  # an absolute link to this stack's front
    return httpx.get(url, headers=auth(key), timeout=30)


# -- REST: a job's life ------------------------------------------------------------------------------------------

def test_async_generation_completes_with_the_synchronous_answers_bytes(stack: TenantStack, rest: httpx.Client,
                                                                       alpha_job: dict[str, Any]) -> None:
    accepted, job = alpha_job["accepted"], alpha_job["final"]
    assert JOB_ID.fullmatch(accepted["id"]), accepted
    assert accepted["object"] == "image.job" and accepted["status"] in ("queued", "in_progress"), accepted
    assert accepted["kind"] == "generation" and accepted["n"] == 2 and accepted["result"] is None, accepted
    assert set(accepted["progress"]) == {"queue_position", "step", "total_steps"}, accepted
    assert job["status"] == "completed" and job["error"] is None, job
    assert job["id"] == accepted["id"] and job["created_at"] == accepted["created_at"], job
    assert job["created_at"] <= job["started_at"] <= job["finished_at"] < job["expires_at"], job
    # Progress counts the denoising steps of every image of the job.
    assert job["progress"] == {"queue_position": 0, "step": 2 * 3, "total_steps": 2 * 3}, job
    result = job["result"]
    assert result["size"] == f"{SIZE}x{SIZE}" and result["output_format"] == "png", result
    assert len(result["data"]) == 2 and all(d["expires_at"] > time.time() for d in result["data"]), result

    sync = rest.post(GENERATIONS, json=alpha_job["payload"], headers=auth(ALPHA))
    assert sync.status_code == 200, sync.text
    expected = [base64.b64decode(d["b64_json"]) for d in sync.json()["data"]]
    got = []
    for d in result["data"]:
        r = _fetch(stack, d["url"])
        assert r.status_code == 200 and r.headers["content-type"] == "image/png", (r.status_code, r.headers)
        got.append(_png(r.content))
    assert got == expected  # byte for byte, image by image
    assert got[0] != got[1]


def test_image_links_are_absolute_urls_of_the_rest_front(stack: TenantStack, sdk: openai.OpenAI,
                                                         alpha_job: dict[str, Any]) -> None:
    """The links a client is given reach the front that serves them, also when the launcher's REST port is picked
    by the system (--rest-port 0, as here and in every launcher test)."""
    sync = sdk.images.generate(prompt="a lamp", size=f"{SIZE}x{SIZE}", response_format="url",
                               extra_body={"num_inference_steps": 1, "seed": 1})
    for url in [d["url"] for d in alpha_job["final"]["result"]["data"]] + [sync.data[0].url]:
        parts = urlsplit(url)
        assert (parts.scheme, parts.netloc) == ("http", stack.addresses["rest"]), url


def test_progress_queue_positions_and_cancelling_a_queued_and_a_running_job(rest: httpx.Client) -> None:
    long = submit(rest, ALPHA, body("a long tapestry", seed=1, **LONG))
    running = poll_job(rest, ALPHA, long["id"], lambda j: j["progress"]["step"] > 0 or j["status"] in TERMINAL,
                       "a denoising step")
    assert running["status"] == "in_progress", running
    assert 0 < running["progress"]["step"] < running["progress"]["total_steps"] == 4 * 200, running
    assert running["started_at"] is not None and running["attempts"] == 1, running
    # The runner's one slot is the long job's: these wait in the store, in the order they came.
    first = submit(rest, ALPHA, body("queued first", seed=2, steps=1))
    second = submit(rest, ALPHA, body("queued second", seed=3, steps=1))
    assert [get_job(rest, ALPHA, j["id"])["status"] for j in (first, second)] == ["queued", "queued"]
    assert [get_job(rest, ALPHA, j["id"])["progress"]["queue_position"] for j in (first, second)] == [0, 1]

    r = rest.post(f"{JOBS}/{second['id']}/cancel", headers=auth(ALPHA))  # queued: ended at once
    assert r.status_code == 200 and r.json()["status"] == "cancelled" and r.json()["finished_at"], r.text
    r = rest.post(f"{JOBS}/{long['id']}/cancel", headers=auth(ALPHA))  # running: its runner ends it
    assert r.status_code == 200 and r.json()["status"] in ("in_progress", "cancelled"), r.text
    ended = wait_job(rest, ALPHA, long["id"])
    assert ended["status"] == "cancelled" and ended["result"] is None and ended["error"] is None, ended
    assert ended["progress"]["step"] < 4 * 200, ended  # stopped, not run to the end
    # The freed slot takes the job still queued; the cancelled one never runs.
    assert wait_job(rest, ALPHA, first["id"])["status"] == "completed"
    gone = get_job(rest, ALPHA, second["id"])
    assert gone["status"] == "cancelled" and gone["attempts"] == 0 and gone["started_at"] is None, gone
    # Cancelling a job that has ended leaves it as it is.
    for job_id, status in ((second["id"], "cancelled"), (first["id"], "completed")):
        r = rest.post(f"{JOBS}/{job_id}/cancel", headers=auth(ALPHA))
        assert r.status_code == 200 and r.json()["status"] == status, r.text


def test_listing_is_newest_first_paginated_and_per_tenant(rest: httpx.Client) -> None:
    def page(key: str = BETA, **params: object) -> dict[str, Any]:
        r = rest.get(JOBS, params=params, headers=auth(key))
        assert r.status_code == 200, r.text
        assert r.json()["object"] == "list", r.json()
        return r.json()

    older = [j["id"] for j in page(limit=100)["data"]]  # beta's jobs of other tests, if any ran before
    ids = [submit(rest, BETA, body(f"beta's list {i}", seed=i, steps=1))["id"] for i in range(3)]
    for job_id in ids:
        assert wait_job(rest, BETA, job_id)["status"] == "completed"
    newest = ids[::-1] + older

    one = page(limit=2)
    assert [j["id"] for j in one["data"]] == newest[:2] and one["has_more"] is True, one
    assert (one["first_id"], one["last_id"]) == (newest[0], newest[1]), one
    two = page(limit=2, after=one["last_id"])
    assert [j["id"] for j in two["data"]] == newest[2:4] and two["has_more"] is (len(newest) > 4), two
    everything = page(limit=100)
    assert [j["id"] for j in everything["data"]] == newest and everything["has_more"] is False
    assert all(j["object"] == "image.job" for j in everything["data"])
    assert [j["id"] for j in page(status="completed", limit=3)["data"]] == ids[::-1]
    assert {j["status"] for j in page(status="cancelled")["data"]} <= {"cancelled"}
    alphas = {j["id"] for j in page(ALPHA, limit=100)["data"]}
    assert alphas and not alphas & set(newest)
    assert page(after=newest[-1])["data"] == []  # past the last job


@pytest.mark.parametrize(("param", "value"), [("status", "sleeping"), ("limit", "0"), ("limit", "101"),
                                              ("limit", "ten"), ("after", "bogus")])
def test_a_bad_list_parameter_is_a_400_naming_it(rest: httpx.Client, param: str, value: str) -> None:
    r = rest.get(JOBS, params={param: value}, headers=auth(BETA))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert "body" not in error["message"], error  # a query parameter, not the (absent) body


def test_an_idempotency_key_answers_the_first_job(rest: httpx.Client) -> None:
    headers = {**auth(ALPHA), **ASYNC, "Idempotency-Key": "h7-retry-of-a-lost-answer"}
    payload = body("asked twice", seed=31, steps=1)
    first, again = (rest.post(GENERATIONS, json=payload, headers=headers) for _ in range(2))
    assert first.status_code == again.status_code == 202, (first.text, again.text)
    assert first.json()["id"] == again.json()["id"], (first.json(), again.json())
    assert again.headers["location"] == f"{JOBS}/{first.json()['id']}"
    # The same key of another tenant is another job.
    other = rest.post(GENERATIONS, json=payload, headers={**headers, **auth(BETA)})
    assert other.status_code == 202 and other.json()["id"] != first.json()["id"], other.text
    assert wait_job(rest, ALPHA, first.json()["id"])["status"] == "completed"
    assert wait_job(rest, BETA, other.json()["id"])["status"] == "completed"


def test_openai_sdk_response_format_url_is_a_png_link(stack: TenantStack, sdk: openai.OpenAI) -> None:
    extra = {"num_inference_steps": 2, "seed": 11}
    res = sdk.images.generate(prompt="a paper boat", size=f"{SIZE}x{SIZE}", response_format="url", extra_body=extra)
    (item,) = res.data
    assert item.url and item.b64_json is None, item
    r = _fetch(stack, item.url)
    assert r.status_code == 200 and r.headers["content-type"] == "image/png", (r.status_code, r.headers)
    assert r.headers["cache-control"].startswith("private"), r.headers
    inline = sdk.images.generate(prompt="a paper boat", size=f"{SIZE}x{SIZE}", extra_body=extra)
    assert _png(r.content) == base64.b64decode(inline.data[0].b64_json)


def test_an_edit_as_a_job_completes(stack: TenantStack, rest: httpx.Client, sdk: openai.OpenAI) -> None:
    reference = ("red.png", image_file((SIZE, SIZE)), "image/png")
    extra = {"num_inference_steps": 2, "seed": 5}
    raw = sdk.images.with_raw_response.edit(image=reference, prompt="make it blue", size=f"{SIZE}x{SIZE}",
                                            extra_body=extra, extra_headers=ASYNC)
    assert raw.status_code == 202, raw.http_response.text
    accepted = raw.http_response.json()
    assert raw.headers["location"] == f"{JOBS}/{accepted['id']}", raw.headers
    assert accepted["object"] == "image.job" and accepted["kind"] == "edit", accepted
    job = wait_job(rest, ALPHA, accepted["id"])
    assert job["status"] == "completed" and job["kind"] == "edit", job
    assert job["result"]["usage"]["input_tokens_details"]["image_tokens"] > 0, job  # the reference was read
    r = _fetch(stack, job["result"]["data"][0]["url"])
    assert r.status_code == 200, r.text
    inline = sdk.images.edit(image=reference, prompt="make it blue", size=f"{SIZE}x{SIZE}", extra_body=extra)
    assert _png(r.content) == base64.b64decode(inline.data[0].b64_json)


# -- REST: whose job, whose link ---------------------------------------------------------------------------------

def test_another_tenants_key_gets_404_for_a_job(rest: httpx.Client, alpha_job: dict[str, Any]) -> None:
    job_id = alpha_job["final"]["id"]
    for r in (rest.get(f"{JOBS}/{job_id}", headers=auth(BETA)),
              rest.post(f"{JOBS}/{job_id}/cancel", headers=auth(BETA))):
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", r.text
        assert "alpha" not in r.text
    assert get_job(rest, ALPHA, job_id)["status"] == "completed"
    r = rest.get(f"{JOBS}/{job_id}")
    assert r.status_code == 401, r.text


def test_an_image_link_is_a_capability_within_its_tenant(stack: TenantStack, alpha_job: dict[str, Any]) -> None:
    url = alpha_job["final"]["result"]["data"][0]["url"]
    own = _fetch(stack, url, ALPHA)
    assert own.status_code == 200, own.text
    anyone = _fetch(stack, url)  # no key: the signature is the capability
    assert anyone.status_code == 200 and anyone.content == own.content, anyone.text
    other = _fetch(stack, url, BETA)
    assert other.status_code == 404 and other.json()["error"]["code"] == "not_found", other.text
    assert _fetch(stack, url, "sk-nobody").status_code == 401
    head = httpx.head(url, timeout=30)
    assert head.status_code == 200 and int(head.headers["content-length"]) == len(own.content), head.headers


def test_a_tampered_or_expired_link_gets_403(stack: TenantStack, alpha_job: dict[str, Any]) -> None:
    urls = [d["url"] for d in alpha_job["final"]["result"]["data"]]
    front = f"http://{stack.addresses['rest']}"

    def parts(url: str) -> tuple[str, str, str]:
        split = urlsplit(url)
        query = parse_qs(split.query)
        return split.path, query["expires"][0], query["signature"][0]

    (path, expires, signature), (other_path, _, other_signature) = parts(urls[0]), parts(urls[1])
    flipped = signature[:-1] + ("A" if signature[-1] != "A" else "B")

    def get(p: str, params: dict[str, str]) -> httpx.Response:
        return httpx.get(front + p, params=params, timeout=30)

    assert get(path, {"expires": expires, "signature": signature}).status_code == 200
    for p, params in ((path, {"expires": str(int(expires) + 1), "signature": signature}),  # a later expiry
                      (path, {"expires": expires, "signature": flipped}),
                      (path, {"expires": expires}),
                      (path, {"expires": expires, "signature": other_signature}),  # the other image's
                      (other_path, {"expires": expires, "signature": signature}),  # another key, this signature
                      (path.replace("/0.png", "/0.jpeg"), {"expires": expires, "signature": signature})):
        r = get(p, params)
        assert r.status_code == 403 and r.json()["error"]["code"] == "invalid_signature", (p, params, r.text)

    # Signed with the stack's own secret (the launcher's --jobs-dir file), once long ago: genuine but expired.
    signer = UrlSigner(load_url_secret(stack.log.parent / "jobs" / "url-secret"), ttl=60)
    key = path.removeprefix("/v1/images/files/")
    fresh, _ = signer.sign(key, time.time())
    assert httpx.get(front + fresh, timeout=30).status_code == 200  # the test signs as the stack does
    stale, stale_expires = signer.sign(key, time.time() - 3600)
    assert stale_expires < time.time()
    r = httpx.get(front + stale, timeout=30)
    assert r.status_code == 403 and r.json()["error"]["code"] == "url_expired", r.text


def test_a_malformed_job_id_is_404_never_500(rest: httpx.Client) -> None:
    for job_id in MALFORMED_IDS:
        for key in (ALPHA, BETA):
            for r in (rest.get(f"{JOBS}/{job_id}", headers=auth(key)),
                      rest.post(f"{JOBS}/{job_id}/cancel", headers=auth(key))):
                assert r.status_code == 404, (job_id, r.status_code, r.text)
                assert r.json()["error"]["code"] == "not_found", (job_id, r.text)


# -- gRPC: JobService --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def jobs_stub(stack: TenantStack) -> Iterator[job_service_pb2_grpc.JobServiceStub]:
    with grpc.insecure_channel(stack.addresses["gateway"]) as channel:
        yield job_service_pb2_grpc.JobServiceStub(channel)


def _grpc_request(prompt: str, seed: int, n: int = 1, steps: int = 2, size: int = SIZE) -> pb.GenerateImagesRequest:
    return pb.GenerateImagesRequest(prompt=prompt, n=n, height=size, width=size, num_inference_steps=steps, seed=seed)


ORDER = {jpb.JOB_STATUS_QUEUED: 0, jpb.JOB_STATUS_IN_PROGRESS: 1, jpb.JOB_STATUS_COMPLETED: 2,
         jpb.JOB_STATUS_FAILED: 2, jpb.JOB_STATUS_CANCELLED: 2}


def test_grpc_submit_watch_get_list_cancel(stack: TenantStack, jobs_stub) -> None:
    md = bearer(ALPHA)
    job = jobs_stub.SubmitJob(jpb.SubmitJobRequest(request=_grpc_request("a grpc kite", seed=21)), metadata=md,
                              timeout=30).job
    assert JOB_ID.fullmatch(job.id) and job.n == 1, job
    assert job.status in (jpb.JOB_STATUS_QUEUED, jpb.JOB_STATUS_IN_PROGRESS), job
    seen = [m.job for m in jobs_stub.WatchJob(jpb.WatchJobRequest(id=job.id), metadata=md, timeout=JOB_TIMEOUT_S)]
    statuses = [ORDER[j.status] for j in seen]
    assert statuses == sorted(statuses) and seen[-1].status == jpb.JOB_STATUS_COMPLETED, seen  # then it ended
    assert [j.status for j in seen].count(jpb.JOB_STATUS_COMPLETED) == 1
    (image,) = seen[-1].result.images
    assert image.url and not image.image and image.url_expires_at > time.time(), image

    got = jobs_stub.GetJob(jpb.GetJobRequest(id=job.id, include_images=True), metadata=md, timeout=30).job
    assert got.status == jpb.JOB_STATUS_COMPLETED and got.progress.step == got.progress.total_steps == 2, got
    (with_bytes,) = got.result.images
    r = _fetch(stack, with_bytes.url)
    assert r.status_code == 200 and _png(with_bytes.image) == r.content

    listed = jobs_stub.ListJobs(jpb.ListJobsRequest(limit=1), metadata=md, timeout=30)
    assert [j.id for j in listed.jobs] == [job.id] and listed.has_more, listed
    cancelled = jobs_stub.CancelJob(jpb.CancelJobRequest(id=job.id), metadata=md, timeout=30).job
    assert cancelled.status == jpb.JOB_STATUS_COMPLETED  # an ended job is left as it is


def test_grpc_watch_sees_a_running_job_cancelled(jobs_stub) -> None:
    md = bearer(ALPHA)
    job = jobs_stub.SubmitJob(jpb.SubmitJobRequest(request=_grpc_request("a long grpc scroll", seed=22, **LONG)),
                              metadata=md, timeout=30).job
    seen, asked = [], False
    for message in jobs_stub.WatchJob(jpb.WatchJobRequest(id=job.id), metadata=md, timeout=JOB_TIMEOUT_S):
        seen.append(message.job)
        if not asked and message.job.progress.step > 0:
            asked = True
            assert message.job.status == jpb.JOB_STATUS_IN_PROGRESS, message.job
            assert message.job.progress.total_steps == 4 * 200, message.job
            jobs_stub.CancelJob(jpb.CancelJobRequest(id=job.id), metadata=md, timeout=30)
    assert asked, seen
    assert seen[-1].status == jpb.JOB_STATUS_CANCELLED and seen[-1].progress.step < 4 * 200, seen[-1]


def test_grpc_other_tenant_not_found_and_no_key_unauthenticated(jobs_stub, alpha_job: dict[str, Any]) -> None:
    job_id = alpha_job["final"]["id"]

    def code(call, message, metadata) -> grpc.StatusCode:
        try:
            reply = call(message, metadata=metadata, timeout=30)
            if call is jobs_stub.WatchJob:
                list(reply)
        except grpc.RpcError as err:
            return err.code()
        return grpc.StatusCode.OK

    by_id = ((jobs_stub.GetJob, jpb.GetJobRequest(id=job_id)), (jobs_stub.WatchJob, jpb.WatchJobRequest(id=job_id)),
             (jobs_stub.CancelJob, jpb.CancelJobRequest(id=job_id)))
    for call, message in by_id:
        assert code(call, message, bearer(BETA)) == grpc.StatusCode.NOT_FOUND, call
    assert code(jobs_stub.GetJob, jpb.GetJobRequest(id="job_" + "0" * 32), bearer(ALPHA)) == grpc.StatusCode.NOT_FOUND
    beta_jobs = jobs_stub.ListJobs(jpb.ListJobsRequest(limit=100), metadata=bearer(BETA), timeout=30).jobs
    assert job_id not in {j.id for j in beta_jobs}
    everything = (*by_id, (jobs_stub.ListJobs, jpb.ListJobsRequest()),
                  (jobs_stub.GetWebhookSecret, jpb.GetWebhookSecretRequest()),
                  (jobs_stub.SubmitJob, jpb.SubmitJobRequest(request=_grpc_request("no key", seed=1))))
    for metadata in ((), bearer("sk-nobody")):
        for call, message in everything:
            assert code(call, message, metadata) == grpc.StatusCode.UNAUTHENTICATED, (call, metadata)
    # And alpha's job was left alone by all of it.
    job = jobs_stub.GetJob(jpb.GetJobRequest(id=job_id), metadata=bearer(ALPHA), timeout=30).job
    assert job.status == jpb.JOB_STATUS_COMPLETED
