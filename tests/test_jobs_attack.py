"""JobService and the REST job routes under attack, on real processes: a `python -m gateway` with jobs on (SQLite,
then PostgreSQL) over simulated workers, and a `python -m rest` in front of it.

What an attacker (or a broken client) sends: bytes that are not the RPC's message, ids that are no job of the
caller's (empty, a megabyte, unicode, another tenant's real one), fields past every bound, webhook URLs aimed at our
own network, no key or a key for something else, malformed Prefer headers, bad query parameters, heads past the
front's bound and paths that climb out of the image store. And what production does to the job store: PostgreSQL
hung (SIGSTOP) and then dead (SIGKILL), then back on the same port and data.

Every refusal must be a clear error with the right status, never UNKNOWN/INTERNAL or a 5xx, never a stack trace,
a file-system path or an internal server's address, and it must not harm the requests around it: after each
attack the gateway still runs a job to its end.
"""
from __future__ import annotations

import base64
import concurrent.futures
import hashlib
import hmac
import json
import math
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, urlsplit

import grpc
import httpx
import pytest

from gateway.jobs.service import STORE_CALL_TIMEOUT_S
from gateway.jobs.urls import tenant_tag
from glmimage.v1 import gateway_service_pb2 as pb
from glmimage.v1 import gateway_service_pb2_grpc, job_service_pb2, job_service_pb2_grpc
from tests.support.jobs_attack import (
    GatewayFiles,
    Postgres,
    Process,
    SimWorkers,
    durable_postgres,
    jobs_gateway,
    leaks,
    rest_front,
    sim_workers,
)
from tests.support.tenants_stack import write_tenants
from tests.support.waiting import until

pytestmark = pytest.mark.e2e

ALPHA, BETA = "sk-attack-alpha-1", "sk-attack-beta-1"
STATUS_KEY = "status-attack-key-1"  # $GLMIMAGE_STATUS_KEYS: GetStatus only, no tenant
TENANTS: dict[str, dict[str, object]] = {
    "alpha": {"keys": [ALPHA], "max_priority": "default"},
    "beta": {"keys": [BETA], "max_priority": "interactive"},
}
HOOKS = "https://hooks.example.com"  # the one --webhook-allow pattern of the SQLite gateway
JOBS_SERVICE = job_service_pb2.DESCRIPTOR.services_by_name["JobService"]
METHODS = list(JOBS_SERVICE.methods)
MB = 1 << 20
MESSAGE_BOUND = 512  # characters: an error message never echoes more of what it refuses
JOB_TIMEOUT_S = 60.0
NEVER = (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)
ASYNC_OK = 202


def md(key: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),) if key else ()


def good_request(seed: int = 1, n: int = 1) -> pb.GenerateImagesRequest:
    return pb.GenerateImagesRequest(prompt="a lighthouse", n=n, height=64, width=64, num_inference_steps=2, seed=seed)


@dataclass
class Stack:
    run_dir: Path
    workers: SimWorkers
    gateway: Process
    rest: Process
    files: GatewayFiles
    channel: grpc.Channel

    @property
    def jobs(self) -> job_service_pb2_grpc.JobServiceStub:
        return job_service_pb2_grpc.JobServiceStub(self.channel)

    @property
    def gen(self) -> gateway_service_pb2_grpc.GatewayServiceStub:
        return gateway_service_pb2_grpc.GatewayServiceStub(self.channel)

    @property
    def internal_ports(self) -> list[int]:
        return [self.gateway.port, *(int(a.rsplit(":", 1)[1]) for a in self.workers.addresses)]

    @property
    def base_url(self) -> str:
        return f"http://{self.rest.address}"

    def clean(self, text: str, what: str = "") -> None:
        found = leaks(text, self.internal_ports, (self.run_dir,))
        assert not found, f"{what}: the answer gives away {found}: {text[:300]!r}"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Simulated workers, a gateway with a tenants file, SQLite jobs, one webhook pattern and a status key, and a
    REST front with the same tenants over it."""
    run_dir = tmp_path_factory.mktemp("jobs-attack")
    write_tenants(run_dir / "tenants.toml", TENANTS)
    files = GatewayFiles.make(run_dir)
    with sim_workers(run_dir) as workers, \
            jobs_gateway(run_dir, "gateway", workers, f"sqlite:///{run_dir / 'jobs.sqlite3'}", files,
                         "--tenants", str(run_dir / "tenants.toml"), f"--webhook-allow={HOOKS}",
                         env={"GLMIMAGE_STATUS_KEYS": STATUS_KEY}) as gateway, \
            rest_front(run_dir, gateway, files, "--tenants", str(run_dir / "tenants.toml")) as rest, \
            grpc.insecure_channel(gateway.address) as channel:
        yield Stack(run_dir, workers, gateway, rest, files, channel)


UNEXPECTED = "unexpected error"  # what the error interceptor logs (with a traceback) when it answers INTERNAL


@pytest.fixture(autouse=True)
def no_unexpected_errors(request: pytest.FixtureRequest) -> Iterator[None]:
    """Whatever a test sent, its gateway logged no unexpected error: an attack is refused, not crashed into."""
    gateways = [request.getfixturevalue(name).gateway for name in ("stack", "pg_stack")
                if name in request.fixturenames]
    sizes = [g.log.stat().st_size for g in gateways]
    yield
    for gateway, size in zip(gateways, sizes, strict=True):
        with gateway.log.open("rb") as f:
            f.seek(size)
            new = f.read().decode(errors="replace")
        if UNEXPECTED in new:
            at = new.index(UNEXPECTED)
            pytest.fail(f"{gateway.name} logged an unexpected error:\n{new[max(0, at - 300):at + 3000]}")


def call_error(call, *args, **kwargs) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        reply = call(*args, timeout=30, **kwargs)
        if hasattr(reply, "__iter__") and not hasattr(reply, "ListFields"):  # a stream: its error comes on reading
            list(reply)
    return err.value


def raw_call(channel: grpc.Channel, method, data: bytes, key: str | None,
             metadata: tuple[tuple[str, str], ...] | None = None) -> grpc.RpcError | None:
    """``data`` sent as ``method``'s request message as it is, not serialised by us; the error, None if none."""
    path = f"/{JOBS_SERVICE.full_name}/{method.name}"
    metadata = md(key) if metadata is None else metadata
    try:
        if method.server_streaming:
            list(channel.unary_stream(path)(data, metadata=metadata, timeout=30))
        else:
            channel.unary_unary(path)(data, metadata=metadata, timeout=30)
    except grpc.RpcError as err:
        return err
    return None


def wait_ended(jobs: job_service_pb2_grpc.JobServiceStub, job_id: str, key: str | None,
               timeout: float = JOB_TIMEOUT_S) -> job_service_pb2.Job:
    deadline = time.monotonic() + timeout
    while True:
        job = jobs.GetJob(job_service_pb2.GetJobRequest(id=job_id), metadata=md(key), timeout=30).job
        if job.status in (job_service_pb2.JOB_STATUS_COMPLETED, job_service_pb2.JOB_STATUS_FAILED,
                          job_service_pb2.JOB_STATUS_CANCELLED):
            return job
        assert time.monotonic() < deadline, f"job {job_id} has not ended after {timeout}s: {job}"
        time.sleep(0.05)


def assert_serves_a_job(stack: Stack, key: str = ALPHA) -> job_service_pb2.Job:
    """The gateway still takes a job and runs it to the end, its image stored and returned."""
    job = stack.jobs.SubmitJob(job_service_pb2.SubmitJobRequest(request=good_request()), metadata=md(key),
                               timeout=30).job
    ended = wait_ended(stack.jobs, job.id, key)
    assert ended.status == job_service_pb2.JOB_STATUS_COMPLETED, ended
    full = stack.jobs.GetJob(job_service_pb2.GetJobRequest(id=job.id, include_images=True), metadata=md(key),
                             timeout=30).job
    assert [img.image[:8] for img in full.result.images] == [b"\x89PNG\r\n\x1a\n"], full
    return ended


def assert_refused(stack: Stack, err: grpc.RpcError, code: grpc.StatusCode, lead: str = "", what: str = "") -> None:
    assert err.code() not in NEVER, f"{what}: {err.code()} {err.details()!r}"
    assert err.code() == code, f"{what}: {err.code()} {err.details()!r}"
    details = err.details() or ""
    assert details.startswith(lead), f"{what}: {details!r} does not start with {lead!r}"
    assert len(details) <= MESSAGE_BOUND, f"{what}: a message of {len(details)} characters"
    stack.clean(details, what)


# ---- 1. bytes that are not the RPC's message ------------------------------------------------------------------

# Malformed for every message type (a field number 0, by contrast, upb accepts in a message with no fields).
NOT_A_MESSAGE = {
    "not protobuf at all": b"\xff" * 11,
    "a truncated varint": b"\x08\x80",
    "a length past the end": b"\x12\x05ab",
    "a 4 GiB length": b"\x12\xff\xff\xff\xff\x0f",
    "wire type 6": b"\x0e\x00",
    "wire type 7": b"\x0f",
    "an end-group with no group": b"\x0c",
    "a group never closed": b"\x0b\x08\x01",
}
BAD_UTF8 = b"\xc3\x28"


def _length_delimited(number: int, payload: bytes) -> bytes:
    return bytes([number << 3 | 2, len(payload)]) + payload


def bad_utf8_messages(descriptor) -> dict[str, bytes]:
    """Each string field of the message (and of the messages it holds) carrying invalid UTF-8."""
    found = {}
    for f in descriptor.fields:
        if f.type == f.TYPE_STRING:
            found[f.name] = _length_delimited(f.number, BAD_UTF8)
        elif f.type == f.TYPE_MESSAGE and f.message_type.full_name == "glmimage.v1.GenerateImagesRequest":
            inner = _length_delimited(1, BAD_UTF8)  # prompt
            found[f"{f.name}.prompt"] = _length_delimited(f.number, inner)
    return found


def test_every_rpc_refuses_bytes_that_are_not_its_message(stack: Stack) -> None:
    utf8_cases = 0
    for method in METHODS:
        cases = {**NOT_A_MESSAGE, **{f"invalid UTF-8 in {name}": data
                                     for name, data in bad_utf8_messages(method.input_type).items()}}
        utf8_cases += len(cases) - len(NOT_A_MESSAGE)
        for name, data in cases.items():
            what = f"{method.name} with {name}"
            # Keys are on: the credential is checked before the message is even read.
            err = raw_call(stack.channel, method, data, None)
            assert err is not None, f"{what}, no key: answered"
            assert_refused(stack, err, grpc.StatusCode.UNAUTHENTICATED, "missing or invalid API key", what)
            err = raw_call(stack.channel, method, data, ALPHA)
            assert err is not None, f"{what}: answered as if it were a message"
            assert_refused(stack, err, grpc.StatusCode.INVALID_ARGUMENT,
                           f"the request bytes are not a valid {method.name} request message", what)
    assert utf8_cases >= 5  # the ids, after, idempotency_key, webhook_url and request.prompt were all tried
    assert_serves_a_job(stack)


# ---- 2. extreme fields -----------------------------------------------------------------------------------------

def test_ids_that_are_no_job_of_the_caller_are_not_found(stack: Stack) -> None:
    theirs = stack.jobs.SubmitJob(job_service_pb2.SubmitJobRequest(request=good_request(seed=2)),
                                  metadata=md(BETA), timeout=30).job.id
    mine = stack.jobs.SubmitJob(job_service_pb2.SubmitJobRequest(request=good_request(seed=3)),
                                metadata=md(ALPHA), timeout=30).job.id
    ids = {
        "empty": "", "0": "0", "a megabyte": "j" * MB, "unicode": "job_ü🙂\u202e\u0000" * 40,
        "job_ and 32 non-hex": "job_" + "g" * 32,
        "upper-case hex": mine.upper(), "a space before": " " + mine, "a newline after": mine + "\n",
        "a NUL after": mine + "\x00", "a prefix of one": mine[:-1], "another tenant's real id": theirs,
    }
    answers = {}
    for label, job_id in ids.items():
        for name, call, message in (
                ("GetJob", stack.jobs.GetJob, job_service_pb2.GetJobRequest(id=job_id, include_images=True)),
                ("WatchJob", stack.jobs.WatchJob, job_service_pb2.WatchJobRequest(id=job_id)),
                ("CancelJob", stack.jobs.CancelJob, job_service_pb2.CancelJobRequest(id=job_id))):
            err = call_error(call, message, metadata=md(ALPHA))
            assert_refused(stack, err, grpc.StatusCode.NOT_FOUND, "id: no job", f"{name} of {label}")
            answers[(name, label)] = err.details()
    # Another tenant's id is answered word for word as an id that never existed: ids cannot be probed.
    never = "job_" + os.urandom(16).hex()
    for name, call, message in (("GetJob", stack.jobs.GetJob, job_service_pb2.GetJobRequest(id=never)),
                                ("CancelJob", stack.jobs.CancelJob, job_service_pb2.CancelJobRequest(id=never))):
        err = call_error(call, message, metadata=md(ALPHA))
        assert answers[(name, "another tenant's real id")] == err.details().replace(never, theirs)
    # The CancelJob of another tenant's job cancelled nothing: both jobs run to their end.
    assert wait_ended(stack.jobs, theirs, BETA).status == job_service_pb2.JOB_STATUS_COMPLETED
    assert wait_ended(stack.jobs, mine, ALPHA).status == job_service_pb2.JOB_STATUS_COMPLETED


def test_list_jobs_refuses_what_is_out_of_bounds(stack: Stack) -> None:
    theirs = stack.jobs.SubmitJob(job_service_pb2.SubmitJobRequest(request=good_request(seed=4)),
                                  metadata=md(BETA), timeout=30).job.id
    refused = {
        "limit 101": (job_service_pb2.ListJobsRequest(limit=101), "limit: "),
        "limit 2^32-1": (job_service_pb2.ListJobsRequest(limit=2**32 - 1), "limit: "),
        "after garbage": (job_service_pb2.ListJobsRequest(after="garbage"), "after: "),
        "after a megabyte": (job_service_pb2.ListJobsRequest(after="a" * MB), "after: "),
        "after unicode": (job_service_pb2.ListJobsRequest(after="job_" + "🙂" * 32), "after: "),
        "status 99": (job_service_pb2.ListJobsRequest(status=99), "status: "),
        "status -1": (job_service_pb2.ListJobsRequest(status=-1), "status: "),
    }
    for label, (message, lead) in refused.items():
        err = call_error(stack.jobs.ListJobs, message, metadata=md(ALPHA))
        assert_refused(stack, err, grpc.StatusCode.INVALID_ARGUMENT, lead, f"ListJobs {label}")
    # A page after another tenant's job is the page after an id that never existed: nothing, and nothing told.
    for after in (theirs, "job_" + os.urandom(16).hex()):
        page = stack.jobs.ListJobs(job_service_pb2.ListJobsRequest(after=after), metadata=md(ALPHA), timeout=30)
        assert (list(page.jobs), page.has_more) == ([], False)
    page = stack.jobs.ListJobs(job_service_pb2.ListJobsRequest(limit=100), metadata=md(ALPHA), timeout=30)
    assert theirs not in {job.id for job in page.jobs}


BAD_REQUESTS = {
    "an empty prompt": pb.GenerateImagesRequest(prompt="", n=1),
    "no request at all": None,
    "n=1000": pb.GenerateImagesRequest(prompt="x", n=1000),
    "a huge size": pb.GenerateImagesRequest(prompt="x", height=1 << 20, width=1 << 20),
    "2^31-1 steps": pb.GenerateImagesRequest(prompt="x", num_inference_steps=2**31 - 1),
    "a 100k-character prompt": pb.GenerateImagesRequest(prompt="p" * 100_000),
    "a NaN guidance": pb.GenerateImagesRequest(prompt="x", guidance_scale=math.nan),
    "output format 99": pb.GenerateImagesRequest(prompt="x", output_format=99),
    "priority 99": pb.GenerateImagesRequest(prompt="x", height=64, width=64, priority=99),
    "a priority above the tenant's": pb.GenerateImagesRequest(prompt="x", height=64, width=64,
                                                              priority=pb.PRIORITY_INTERACTIVE),
}


def test_submit_checks_the_request_as_generate_images_does(stack: Stack) -> None:
    for label, gen in BAD_REQUESTS.items():
        submit = job_service_pb2.SubmitJobRequest() if gen is None else job_service_pb2.SubmitJobRequest(request=gen)
        err = call_error(stack.jobs.SubmitJob, submit, metadata=md(ALPHA))
        sync = call_error(stack.gen.GenerateImages, pb.GenerateImagesRequest() if gen is None else gen,
                          metadata=md(ALPHA))
        assert_refused(stack, err, grpc.StatusCode.INVALID_ARGUMENT, what=f"SubmitJob with {label}")
        assert (err.code(), err.details()) == (sync.code(), sync.details()), label
        field = err.details().split(":", 1)[0]
        assert field and " " not in field, f"{label}: no field named in {err.details()!r}"
    err = call_error(stack.jobs.SubmitJob, job_service_pb2.SubmitJobRequest(
        request=BAD_REQUESTS["a priority above the tenant's"]), metadata=md(ALPHA))
    assert err.details().startswith("priority: "), err.details()
    # The same priority is beta's to ask for.
    job = stack.jobs.SubmitJob(job_service_pb2.SubmitJobRequest(request=pb.GenerateImagesRequest(
        prompt="x", height=64, width=64, num_inference_steps=2, priority=pb.PRIORITY_INTERACTIVE)),
        metadata=md(BETA), timeout=30).job
    assert wait_ended(stack.jobs, job.id, BETA).status == job_service_pb2.JOB_STATUS_COMPLETED


def test_idempotency_keys_past_the_bound_or_unprintable_are_refused(stack: Stack) -> None:
    for label, key in {"257 characters": "k" * 257, "257 non-ASCII": "ключ" * 64 + "к", "a NUL": "a\x00b",
                       "a newline": "a\nb", "an escape sequence": "\x1b[31mred", "a bidi override": "a\u202eb",
                       "a megabyte": "k" * MB}.items():
        err = call_error(stack.jobs.SubmitJob, job_service_pb2.SubmitJobRequest(
            request=good_request(), idempotency_key=key), metadata=md(ALPHA))
        assert_refused(stack, err, grpc.StatusCode.INVALID_ARGUMENT, "idempotency_key: ", f"idempotency key {label}")
    key = "é" * 256  # at the bound, printable: taken, and a second submit answers the first's job
    first = stack.jobs.SubmitJob(job_service_pb2.SubmitJobRequest(request=good_request(), idempotency_key=key),
                                 metadata=md(ALPHA), timeout=30).job
    again = stack.jobs.SubmitJob(job_service_pb2.SubmitJobRequest(request=good_request(), idempotency_key=key),
                                 metadata=md(ALPHA), timeout=30).job
    assert again.id == first.id
    # Another tenant's same key is another job.
    other = stack.jobs.SubmitJob(job_service_pb2.SubmitJobRequest(request=good_request(), idempotency_key=key),
                                 metadata=md(BETA), timeout=30).job
    assert other.id != first.id


BAD_WEBHOOKS = {
    "100k characters": f"{HOOKS}/" + "a" * 100_000,
    "javascript:": "javascript:alert(1)",
    "http to loopback IPv6": "http://[::1]/",
    "https to loopback IPv6": "https://[::1]/hook",
    "https to 127.0.0.1": "https://127.0.0.1:9/",
    "a user and password": f"https://user:pw@{urlsplit(HOOKS).netloc}/",
    "an allowed host as userinfo": f"https://{urlsplit(HOOKS).netloc}@evil.example.net/",
    "a header injection": f"{HOOKS}/\r\nX-Injected: 1",
    "a host not allowed": "https://evil.example.net/",
    "file:": "file:///etc/passwd",
    "plain http": f"http://{urlsplit(HOOKS).netloc}/",
    "the metadata service": "https://169.254.169.254/latest/meta-data/",
}


def test_webhook_urls_aimed_elsewhere_are_refused(stack: Stack) -> None:
    for label, url in BAD_WEBHOOKS.items():
        err = call_error(stack.jobs.SubmitJob, job_service_pb2.SubmitJobRequest(
            request=good_request(), webhook_url=url), metadata=md(ALPHA))
        assert_refused(stack, err, grpc.StatusCode.INVALID_ARGUMENT, "webhook_url: ", f"webhook {label}")
        assert "a" * 100 not in err.details(), "the URL is echoed whole"
    job = stack.jobs.SubmitJob(job_service_pb2.SubmitJobRequest(request=good_request(), webhook_url=f"{HOOKS}/ok"),
                               metadata=md(ALPHA), timeout=30).job
    assert job.webhook_url == f"{HOOKS}/ok"


# ---- 3. callers without credentials ----------------------------------------------------------------------------

NO_CREDENTIALS = {
    "no key": (),
    "an unknown key": md("sk-not-a-key"),
    "an empty bearer": (("authorization", "Bearer "),),
    "basic auth": (("authorization", "Basic " + base64.b64encode(b"alpha:" + ALPHA.encode()).decode()),),
    "a 4 KB key": md("k" * 4096),
    "the key in the wrong header": (("x-api-key", ALPHA),),
    # A status key (a probe's) authenticates no tenant: JobService, whose every call is some tenant's, answers it as
    # it answers no key. UNAUTHENTICATED rather than PERMISSION_DENIED also keeps the answer from telling a caller
    # that the string it tried is a status key; GenerateImages answers it the same way (checked below).
    "a status key": md(STATUS_KEY),
}


def test_job_service_answers_callers_without_a_tenant_key_unauthenticated(stack: Stack) -> None:
    for label, metadata in NO_CREDENTIALS.items():
        for method in METHODS:
            # b"": the message's defaults, what a client sends before it fills anything in
            err = raw_call(stack.channel, method, b"", None, metadata)
            assert err is not None, f"{method.name} with {label}: answered"
            assert_refused(stack, err, grpc.StatusCode.UNAUTHENTICATED, "missing or invalid API key",
                           f"{method.name} with {label}")
    # The status key does what it is for, and GenerateImages refuses it as JobService does.
    assert stack.gen.GetStatus(pb.GetStatusRequest(), metadata=md(STATUS_KEY), timeout=30).workers
    err = call_error(stack.gen.GenerateImages, good_request(), metadata=md(STATUS_KEY))
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED, err
    # On REST, the job routes want a key too: 401, never a 5xx.
    with httpx.Client(base_url=stack.base_url, timeout=30) as rest:
        for method, path in (("GET", "/v1/images/jobs"), ("GET", "/v1/images/jobs/job_" + "0" * 32),
                             ("POST", "/v1/images/jobs/job_" + "0" * 32 + "/cancel"), ("GET", "/v1/webhooks/secret")):
            for headers in ({}, {"Authorization": f"Bearer {STATUS_KEY}"}, {"Authorization": "Bearer nope"}):
                r = rest.request(method, path, headers=headers)
                assert r.status_code == 401, (method, path, headers, r.status_code, r.text)
                stack.clean(r.text, f"{method} {path}")
    assert_serves_a_job(stack, BETA)


def test_metadata_past_grpc_s_limit_is_refused_quietly(stack: Stack) -> None:
    """A key past gRPC's metadata limit (16 KB hard) is refused by gRPC itself, RESOURCE_EXHAUSTED, before any
    handler could answer: the gateway must take that as the call's end, not as an error of its own to log (an
    attacker could otherwise fill its log, and its alerts, with tracebacks at will)."""
    huge = md("k" * 20_000)
    for method in METHODS:
        err = raw_call(stack.channel, method, b"", None, huge)
        assert err is not None and err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (method.name, err)
        stack.clean(err.details() or "", method.name)
    err = call_error(stack.gen.GenerateImages, good_request(), metadata=huge)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
    assert_serves_a_job(stack)


# ---- 5. REST ---------------------------------------------------------------------------------------------------

ALPHA_HEADERS = {"Authorization": f"Bearer {ALPHA}"}
REST_BODY = {"prompt": "a lighthouse", "n": 1, "size": "64x64", "num_inference_steps": 2}
# (Prefer header values, whether the answer is a job): RFC 7240 — comma-separated preferences, each a token
# (case-insensitive) with an optional value and parameters; a preference not understood is ignored.
PREFER_CASES = {
    "no Prefer": ([], False),
    "an empty Prefer": ([""], False),
    "respond-async;;;": (["respond-async;;;"], True),
    "RESPOND-ASYNC": (["RESPOND-ASYNC"], True),
    "Respond-Async with a parameter": (["Respond-Async; foo=bar"], True),
    "after another preference": (["wait=5, respond-async"], True),
    "in a second Prefer header": (["handling=lenient", "respond-async"], True),
    "followed by 10 KB of junk": (["respond-async, " + "x" * 10_240], True),
    "10 KB of preferences not understood": (["wait=5, handling=strict, " + "x-junk=" + "y" * 10_240], False),
    "a longer token": (["respond-asyncx"], False),
    "a prefixed token": (["x-respond-async"], False),
    "a control character": (["\x01\x02"], False),
    # A quoted value is one value, commas included: it holds no preference of its own.
    "inside a quoted value": (['foo="a, respond-async"'], False),
}


@pytest.mark.parametrize("case", list(PREFER_CASES))
def test_prefer_respond_async_follows_rfc_7240(stack: Stack, case: str) -> None:
    values, is_async = PREFER_CASES[case]
    headers = [("Authorization", f"Bearer {ALPHA}"), *(("Prefer", v) for v in values)]
    with httpx.Client(base_url=stack.base_url, timeout=60) as rest:
        r = rest.post("/v1/images/generations", json=REST_BODY, headers=headers)
        stack.clean(r.text, case)
        if not is_async:
            assert r.status_code == 200, (r.status_code, r.text[:300])
            assert "preference-applied" not in r.headers and r.json()["data"][0]["b64_json"]
            return
        assert r.status_code == ASYNC_OK, (r.status_code, r.text[:300])
        job = r.json()
        assert r.headers["location"] == f"/v1/images/jobs/{job['id']}"
        assert r.headers["preference-applied"] == "respond-async"
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while (got := rest.get(r.headers["location"], headers=ALPHA_HEADERS).json())["status"] in ("queued",
                                                                                                 "in_progress"):
            assert time.monotonic() < deadline, got
            time.sleep(0.05)
        assert got["status"] == "completed", got


@pytest.mark.parametrize("query, param", [
    ("limit=0", "limit"), ("limit=1000", "limit"), ("limit=-1", "limit"), ("limit=abc", "limit"),
    ("limit=101", "limit"), ("limit=1e2", "limit"), ("limit=" + "9" * 40, "limit"), ("limit=%00", "limit"),
    ("after=garbage", "after"), ("after=" + "z" * 10_000, "after"), ("status=bogus", "status"),
])
def test_list_query_parameters_out_of_bounds_are_400_naming_the_parameter(stack: Stack, query: str,
                                                                           param: str) -> None:
    with httpx.Client(base_url=stack.base_url, timeout=30) as rest:
        r = rest.get(f"/v1/images/jobs?{query}", headers=ALPHA_HEADERS)
        stack.clean(r.text, query[:40])
        assert r.status_code == 400, (r.status_code, r.text[:300])
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and len(error["message"]) <= MESSAGE_BOUND, error
        assert error["param"] == param, f"{query[:40]}: param {error['param']!r}, message {error['message']!r}"
        assert param in error["message"], error
        assert rest.get("/v1/images/jobs?limit=100", headers=ALPHA_HEADERS).status_code == 200


def raw_http(port: int, request: bytes, timeout: float = 30) -> bytes:
    """``request`` sent as it is on a connection of its own; what came back before the server closed. A server
    refusing a head it will not read may close while it is still being sent: its answer, written first, is read
    all the same."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        try:
            s.sendall(request)
        except (BrokenPipeError, ConnectionResetError):
            pass
        data = b""
        try:
            while chunk := s.recv(65536):
                data += chunk
        except ConnectionResetError:
            pass
    return data


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1]) if response.startswith(b"HTTP/1.1 ") else 0


def test_job_ids_that_are_no_job_of_the_caller_are_404_on_rest(stack: Stack) -> None:
    theirs = stack.jobs.SubmitJob(job_service_pb2.SubmitJobRequest(request=good_request(seed=5)),
                                  metadata=md(BETA), timeout=30).job.id
    never = "job_" + os.urandom(16).hex()
    with httpx.Client(base_url=stack.base_url, timeout=30) as rest:
        for method, path in (("GET", "/v1/images/jobs/" + "j" * 12_000),
                             ("POST", "/v1/images/jobs/" + "j" * 12_000 + "/cancel"),
                             ("GET", "/v1/images/jobs/" + quote("job_🙂\u202e\x00")),
                             ("GET", "/v1/images/jobs/%C3%28"), ("GET", "/v1/images/jobs/0")):
            r = rest.request(method, path, headers=ALPHA_HEADERS)
            stack.clean(r.text, path[:40])
            assert r.status_code == 404, (r.status_code, r.text[:300])
            assert len(r.json()["error"]["message"]) <= MESSAGE_BOUND
        for method, suffix in (("GET", ""), ("POST", "/cancel")):
            r = rest.request(method, f"/v1/images/jobs/{theirs}{suffix}", headers=ALPHA_HEADERS)
            unknown = rest.request(method, f"/v1/images/jobs/{never}{suffix}", headers=ALPHA_HEADERS)
            assert r.status_code == unknown.status_code == 404, (r.text, unknown.text)
            assert r.json() == json.loads(unknown.text.replace(never, theirs))
    assert wait_ended(stack.jobs, theirs, BETA).status == job_service_pb2.JOB_STATUS_COMPLETED


@pytest.mark.parametrize("label, extra, headers, param", [
    ("a 257-character Idempotency-Key", {}, {"Idempotency-Key": "k" * 257}, "Idempotency-Key"),
    ("an escape in the Idempotency-Key", {}, {"Idempotency-Key": "a\x1b[0m"}, "Idempotency-Key"),
    ("a javascript: webhook", {"webhook_url": "javascript:alert(1)"}, {}, "webhook_url"),
    ("a loopback webhook", {"webhook_url": "http://[::1]/"}, {}, "webhook_url"),
    ("a 100k-character webhook", {"webhook_url": f"{HOOKS}/" + "a" * 100_000}, {}, "webhook_url"),
    ("a webhook that is a number", {"webhook_url": 5}, {}, "webhook_url"),
    ("n=1000", {"n": 1000}, {}, "n"),
    ("stream", {"stream": True}, {}, "stream"),
])
def test_async_submits_out_of_bounds_are_400_naming_the_parameter(stack: Stack, label: str, extra: dict,
                                                                  headers: dict, param: str) -> None:
    with httpx.Client(base_url=stack.base_url, timeout=30) as rest:
        r = rest.post("/v1/images/generations", json={**REST_BODY, **extra},
                      headers={**ALPHA_HEADERS, "Prefer": "respond-async", **headers})
    stack.clean(r.text, label)
    assert r.status_code == 400, (label, r.status_code, r.text[:300])
    error = r.json()["error"]
    assert error["param"] == param and len(error["message"]) <= MESSAGE_BOUND, (label, error)


AUTH_LINE = f"Authorization: Bearer {ALPHA}\r\n".encode()


@pytest.mark.parametrize("case", ["a 1 MB job id", "a 1 MB Prefer header"])
def test_a_head_past_the_front_s_bound_is_414_or_431(stack: Stack, case: str) -> None:
    """RFC 9112 §3: a request-target longer than the server parses is 414 (URI Too Long); RFC 6585: header fields
    too large are 431. A head that large is never read whole, and never a 5xx."""
    if case == "a 1 MB job id":
        request = b"GET /v1/images/jobs/" + b"j" * MB + b" HTTP/1.1\r\nHost: x\r\n" + AUTH_LINE + b"\r\n"
        allowed = {404, 414, 431}
    else:
        body = json.dumps(REST_BODY).encode()
        request = (b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   + AUTH_LINE + b"Prefer: respond-async, " + b"x" * MB + b"\r\nContent-Length: "
                   + str(len(body)).encode() + b"\r\n\r\n" + body)
        allowed = {431}
    response = raw_http(stack.rest.port, request)
    stack.clean(response.decode(errors="replace"), case)
    assert status_of(response) in allowed, f"{case}: {response[:300]!r}"
    with httpx.Client(base_url=stack.base_url, timeout=30) as rest:  # and the front serves the next request
        assert rest.get("/v1/images/jobs", headers=ALPHA_HEADERS).status_code == 200


def _sign(secret: bytes, key: str, expires: int) -> str:
    """A signature made with the URL secret itself (as if it had leaked): the store must still not serve what is
    not one of its objects."""
    mac = hmac.new(secret, f"{key}\n{expires}".encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(mac).rstrip(b"=").decode()


def test_file_paths_never_climb_out_of_the_image_store(stack: Stack) -> None:
    canary = os.urandom(16).hex()
    (stack.run_dir / "canary.png").write_text(f"CANARY {canary}\n")  # beside the store: ../canary.png from it
    done = assert_serves_a_job(stack)
    url = urlsplit(done.result.images[0].url)
    key = url.path.removeprefix("/v1/images/files/")
    with httpx.Client(base_url=stack.base_url, timeout=30) as rest:  # the real link works: refusals mean something
        good = rest.get(f"{url.path}?{url.query}")
        assert good.status_code == 200 and good.content.startswith(b"\x89PNG"), good
    secret = stack.files.url_secret.read_bytes().strip()
    expires = int(time.time()) + 600
    tag, token = tenant_tag("alpha"), os.urandom(16).hex()
    # A key-shaped object that is a symlink out of the store: a link never planted by the gateway is not served.
    linked = stack.files.images / tag / token
    linked.mkdir(parents=True)
    (linked / "0.png").symlink_to(stack.run_dir / "canary.png")
    forged = {k: f"?expires={expires}&signature={_sign(secret, k, expires)}"
              for k in ("../canary.png", "../../../../etc/passwd", f"{tag}/{token}/../../../canary.png",
                          f"{tag}/{token}/0.png")}
    targets = [
        "../../etc/passwd", "..%2f..%2fetc%2fpasswd", "%2e%2e/%2e%2e/etc/passwd", "%2e%2e%2fcanary.png",
        "%252e%252e%252fcanary.png", "/etc/passwd", "..\\canary.png", "..%5ccanary.png", "%00", "..%00/canary.png",
        f"{key}/../../../canary.png?{url.query}", f"{key}%2f..%2f..%2f..%2f..%2fcanary.png?{url.query}",
        *(quote(k, safe="/") + q for k, q in forged.items()), *(quote(k, safe="") + q for k, q in forged.items()),
    ]
    for target in targets:
        response = raw_http(stack.rest.port, f"GET /v1/images/files/{target} HTTP/1.1\r\nHost: x\r\n"
                                             "Connection: close\r\n\r\n".encode())
        text = response.decode(errors="replace")
        assert status_of(response) in (400, 403, 404), f"{target}: {response[:300]!r}"
        assert canary not in text and "root:x:0:0" not in text, f"{target} read outside the store"
        stack.clean(text, target)


# ---- 4. the job store gone: PostgreSQL hung, then dead, then back --------------------------------------------

@dataclass
class PgStack:
    pg: Postgres
    workers: SimWorkers
    gateway: Process
    channel: grpc.Channel

    @property
    def jobs(self) -> job_service_pb2_grpc.JobServiceStub:
        return job_service_pb2_grpc.JobServiceStub(self.channel)

    @property
    def gen(self) -> gateway_service_pb2_grpc.GatewayServiceStub:
        return gateway_service_pb2_grpc.GatewayServiceStub(self.channel)

    def clean(self, text: str, what: str) -> None:
        ports = [self.gateway.port, self.pg.server.port, *(int(a.rsplit(":", 1)[1]) for a in self.workers.addresses)]
        found = leaks(text, ports, (self.pg.server.dir,))
        assert not found, f"{what}: the answer gives away {found}: {text[:300]!r}"


@pytest.fixture(scope="module")
def pg_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PgStack]:
    """A gateway on PostgreSQL, no keys, no --webhook-allow, over workers slow enough (a job takes about three
    seconds) that a job submitted just before an outage is still running when it begins."""
    run_dir = tmp_path_factory.mktemp("jobs-attack-pg")
    files = GatewayFiles.make(run_dir)
    with durable_postgres() as pg, sim_workers(run_dir, "sim-slow", denoisers=1, scale=0.1) as workers, \
            jobs_gateway(run_dir, "gateway-pg", workers, pg.dsn(), files, "--job-lease", "3",
                         "--job-poll", "0.2") as gateway, \
            grpc.insecure_channel(gateway.address) as channel:
        yield PgStack(pg, workers, gateway, channel)


def test_webhooks_are_refused_on_a_gateway_without_allow_patterns(pg_stack: PgStack) -> None:
    for label, url in {**BAD_WEBHOOKS, "a public https URL": "https://hooks.example.com/ok"}.items():
        err = call_error(pg_stack.jobs.SubmitJob, job_service_pb2.SubmitJobRequest(
            request=good_request(), webhook_url=url))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (label, err)
        assert err.details().startswith("webhook_url: "), (label, err.details())
        if len(url) <= 2048:
            assert "webhooks are off" in err.details(), (label, err.details())
        pg_stack.clean(err.details(), label)


# JobService bounds each store call on the request path (STORE_CALL_TIMEOUT_S, 8 s): a hung server is answered
# UNAVAILABLE after that, 3x it is the margin on a loaded 2-core machine (the measured figures go to the test's
# record_property: 8 s hung; a dead server under 15 ms).
HUNG_ANSWER_BOUND_S = 3 * STORE_CALL_TIMEOUT_S
# Calls that must not wait on the store at all (the synchronous side while it hangs, or a store that refuses
# connections at once): answered before the store call bound would end them, measured in milliseconds.
NOT_WAITING_BOUND_S = STORE_CALL_TIMEOUT_S


def _timed(call, *args, **kwargs) -> tuple[grpc.StatusCode, str, float]:
    t0 = time.monotonic()
    try:
        reply = call(*args, **kwargs)
        if hasattr(reply, "__iter__") and not hasattr(reply, "ListFields"):
            for _ in reply:
                pass
        return grpc.StatusCode.OK, "", time.monotonic() - t0
    except grpc.RpcError as err:
        return err.code(), err.details() or "", time.monotonic() - t0


def test_the_job_store_hung_then_dead_then_back(pg_stack: PgStack, record_property) -> None:
    jobs, gen = pg_stack.jobs, pg_stack.gen
    before = jobs.SubmitJob(job_service_pb2.SubmitJobRequest(request=good_request(seed=10)), timeout=30).job
    watch = jobs.WatchJob(job_service_pb2.WatchJobRequest(id=before.id), timeout=120)
    assert next(watch).job.id == before.id  # the watch is running when the store goes

    # Hung: every PostgreSQL process stopped, its connections open and silent.
    pg_stack.pg.hang()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        hung = {
            "SubmitJob": pool.submit(_timed, jobs.SubmitJob, job_service_pb2.SubmitJobRequest(
                request=good_request(seed=11)), timeout=120),
            "GetJob": pool.submit(_timed, jobs.GetJob, job_service_pb2.GetJobRequest(id=before.id), timeout=120),
            "ListJobs": pool.submit(_timed, jobs.ListJobs, job_service_pb2.ListJobsRequest(), timeout=120),
            "WatchJob": pool.submit(_timed, lambda: watch),
        }
        # Meanwhile the synchronous side does not notice: jobs failing must not harm it.
        code, details, took = _timed(gen.GetStatus, pb.GetStatusRequest(), timeout=30)
        assert code == grpc.StatusCode.OK and took < NOT_WAITING_BOUND_S, (code, details, took)
        code, details, took = _timed(gen.GenerateImages, good_request(seed=12), timeout=60)
        assert code == grpc.StatusCode.OK, (code, details, took)
        answers = {name: f.result() for name, f in hung.items()}
    for name, (code, details, took) in answers.items():
        record_property(f"hung_store_{name}_s", round(took, 1))
        assert code == grpc.StatusCode.UNAVAILABLE, f"{name} with the store hung: {code} {details!r} after {took:.1f}s"
        assert took < HUNG_ANSWER_BOUND_S, f"{name} took {took:.1f}s to answer UNAVAILABLE"
        pg_stack.clean(details, name)
    print({name: round(took, 1) for name, (_, _, took) in answers.items()})

    # Dead: the stopped processes killed. The answer now comes at once.
    pg_stack.pg.kill()
    for name, call, message in (
            ("SubmitJob", jobs.SubmitJob, job_service_pb2.SubmitJobRequest(request=good_request(seed=13))),
            ("GetJob", jobs.GetJob, job_service_pb2.GetJobRequest(id=before.id)),
            ("CancelJob", jobs.CancelJob, job_service_pb2.CancelJobRequest(id=before.id))):
        code, details, took = _timed(call, message, timeout=60)
        record_property(f"dead_store_{name}_s", round(took, 1))
        assert code == grpc.StatusCode.UNAVAILABLE and took < NOT_WAITING_BOUND_S, (name, code, details, took)
        pg_stack.clean(details, name)
    code, details, _ = _timed(gen.GenerateImages, good_request(seed=14), timeout=60)
    assert code == grpc.StatusCode.OK, (code, details)

    # Back on the same port and data: submits work again, and the job accepted before the outage is done.
    pg_stack.pg.restart()
    accepted: list[str] = []

    def submitted() -> bool:
        try:
            accepted.append(jobs.SubmitJob(job_service_pb2.SubmitJobRequest(request=good_request(seed=15)),
                                           timeout=30).job.id)
        except grpc.RpcError as err:  # a pooled connection of the dead server's, found broken: once at most
            assert err.code() == grpc.StatusCode.UNAVAILABLE, err
        return bool(accepted)

    record_property("resubmit_after_restart_s", round(until(submitted, 30, "a submit to succeed", step=0.2), 1))
    for job_id in (before.id, *accepted):
        ended = wait_ended(jobs, job_id, None, timeout=90)
        assert ended.status == job_service_pb2.JOB_STATUS_COMPLETED and ended.result.images, ended
    assert pg_stack.gateway.popen.poll() is None
