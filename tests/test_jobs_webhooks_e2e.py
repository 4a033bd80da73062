"""Issue 31's webhooks end to end on the launcher's stack (real processes, the tiny model): a job's end POSTed to a
real HTTPS receiver on 127.0.0.1 (tests/support/webhook_receiver.py, a trustme CA given to the gateway with
--webhook-ca), verified with the standardwebhooks package's own verifier and the secret GET /v1/webhooks/secret
hands the tenant (the tenants file's webhook_secret); a receiver failing twice gets the third try under the same
webhook-id; URLs to loopback, link-local, file: and the like are refused at submit (400 on webhook_url) and never
dialled; a 302 to a private address is a failed try, its target never dialled.

The receivers are reached as https://localhost:PORT: the hostname pattern admits the URL, and the IP pattern
https://127.0.0.1:PORT admits the loopback address it resolves to (a hostname pattern alone admits only public
addresses). A bystander receiver on another loopback port is named by no pattern: the refused URLs aim at it.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from standardwebhooks import Webhook
from standardwebhooks.webhooks import WebhookVerificationError

from glmimage.v1 import gateway_service_pb2 as pb
from glmimage.v1 import job_service_pb2 as jpb
from glmimage.v1 import job_service_pb2_grpc
from tests.support.jobs_e2e import (
    ALPHA,
    ALPHA_WEBHOOK_SECRET,
    ASYNC,
    BETA,
    GENERATIONS,
    JOBS,
    PNG_MAGIC,
    TERMINAL,
    auth,
    body,
    jobs_stack,
    poll_job,
    submit,
    wait_job,
)
from tests.support.tenants_stack import TenantStack, bearer
from tests.support.webhook_receiver import Received, WebhookReceiver

pytestmark = pytest.mark.e2e

BACKOFF_S = 0.2  # --webhook-backoff: retries within a second, not minutes
DELIVERY_TIMEOUT_S = 60.0


@dataclass
class Receivers:
    ok: WebhookReceiver  # answers 200
    flaky: WebhookReceiver  # 500 to the first two requests
    redirector: WebhookReceiver  # 302 to `target` on every request
    target: WebhookReceiver  # a private address no pattern admits: must see no connection
    bystander: WebhookReceiver  # a loopback port no pattern admits: the refused URLs name it

    def all(self) -> tuple[WebhookReceiver, ...]:
        return self.ok, self.flaky, self.redirector, self.target, self.bystander


@pytest.fixture(scope="module")
def receivers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Receivers]:
    tmp = tmp_path_factory.mktemp("webhook-receivers")
    target = WebhookReceiver(tmp)
    made = Receivers(ok=WebhookReceiver(tmp), flaky=WebhookReceiver(tmp, fail_first=2),
                     redirector=WebhookReceiver(tmp, redirect_to=target.url("/stolen")), target=target,
                     bystander=WebhookReceiver(tmp))
    for receiver in made.all():
        receiver.start()
    try:
        yield made
    finally:
        for receiver in made.all():
            receiver.stop()


@pytest.fixture(scope="module")
def stack(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory, receivers: Receivers
          ) -> Iterator[TenantStack]:
    run_dir = tmp_path_factory.mktemp("jobs-webhooks-e2e")
    # One CA bundle for the gateway: every receiver's (the target's too, so that only the policy stands between
    # a followed redirect and its connection).
    bundle = run_dir / "receivers-ca.pem"
    bundle.write_text("".join(r.ca_file.read_text() for r in receivers.all() if r.ca_file))
    allowed = [r.port for r in (receivers.ok, receivers.flaky, receivers.redirector)]
    allow = [f"--webhook-allow={pattern}" for port in allowed
             for pattern in (f"https://localhost:{port}", f"https://127.0.0.1:{port}")]
    with jobs_stack(run_dir, *allow, f"--webhook-ca={bundle}", f"--webhook-backoff={BACKOFF_S}") as run:
        yield run


@pytest.fixture(scope="module")
def rest(stack: TenantStack) -> Iterator[httpx.Client]:
    with stack.rest() as client:
        yield client


def _hook(receiver: WebhookReceiver, path: str = "/hook") -> str:
    return receiver.url(path, host="localhost")


def _secret(rest: httpx.Client, key: str) -> str:
    r = rest.get("/v1/webhooks/secret", headers=auth(key))
    assert r.status_code == 200 and r.json()["object"] == "webhook_secret", r.text
    return r.json()["secret"]


def _verified(rest: httpx.Client, received: Received, key: str = ALPHA) -> dict[str, Any]:
    """The event, verified by the standardwebhooks verifier with the secret the tenant's key is given."""
    assert received.method == "POST" and received.headers["content-type"].startswith("application/json"), received
    return Webhook(_secret(rest, key)).verify(received.body, received.headers)


def _same_job(event_job: dict[str, Any], job: dict[str, Any]) -> None:
    """The webhook's job object is the job's GET (links aside: each read signs them anew)."""
    def plain(j: dict[str, Any]) -> dict[str, Any]:
        result = j["result"] and {**j["result"], "data": [{} for _ in j["result"]["data"]]}
        return {**j, "result": result}

    sent, read = plain(event_job), plain(job)
    assert sent == read, {k: (sent.get(k), read.get(k)) for k in sent.keys() | read.keys()
                          if sent.get(k) != read.get(k)}


def test_a_completed_job_is_posted_signed_with_the_tenants_secret(stack: TenantStack, rest: httpx.Client,
                                                                  receivers: Receivers) -> None:
    assert _secret(rest, ALPHA) == ALPHA_WEBHOOK_SECRET  # the tenants file's
    beta_secret = _secret(rest, BETA)  # derived from the stack's master secret
    assert beta_secret.startswith("whsec_") and beta_secret != ALPHA_WEBHOOK_SECRET
    url = _hook(receivers.ok, "/hook/done?tag=1")
    accepted = submit(rest, ALPHA, body("a signed lantern", seed=1, webhook_url=url))
    assert accepted["webhook_url"] == url, accepted
    job = wait_job(rest, ALPHA, accepted["id"])
    assert job["status"] == "completed", job

    (received,) = receivers.ok.wait_for_requests(1, DELIVERY_TIMEOUT_S)
    assert received.path == "/hook/done?tag=1" and received.server_name == "localhost", received
    assert received.local_address == "127.0.0.1" and received.headers["webhook-id"].startswith("msg_"), received
    event = _verified(rest, received)
    assert event["object"] == "event" and event["type"] == "image.job.completed", event
    assert event["id"].startswith("evt_") and event["created_at"] >= job["finished_at"], event
    (image,) = event["data"]["result"]["data"]
    # The body's link is absolute, to this stack's front, and works as it is.
    assert image["url"].startswith(f"http://{stack.addresses['rest']}/v1/images/files/"), image
    fetched = httpx.get(image["url"], timeout=30)
    assert fetched.status_code == 200 and fetched.content.startswith(PNG_MAGIC), fetched.status_code
    with pytest.raises(WebhookVerificationError):  # another tenant's secret does not verify it
        Webhook(beta_secret).verify(received.body, received.headers)
    tampered = received.body.replace(b'"completed"', b'"cancelled"', 1)
    with pytest.raises(WebhookVerificationError):
        Webhook(ALPHA_WEBHOOK_SECRET).verify(tampered, received.headers)
    _same_job(event["data"], job)


def test_a_receiver_failing_twice_gets_the_third_try(rest: httpx.Client, receivers: Receivers) -> None:
    accepted = submit(rest, ALPHA, body("a stubborn receiver", seed=2, webhook_url=_hook(receivers.flaky)))
    tries = receivers.flaky.wait_for_requests(3, DELIVERY_TIMEOUT_S)
    assert len({t.headers["webhook-id"] for t in tries}) == 1, [t.headers for t in tries]  # one message, retried
    assert len({t.body for t in tries}) == 1
    events = [_verified(rest, t) for t in tries]  # each try signed anew, each verifies
    assert all(e["type"] == "image.job.completed" and e["data"]["id"] == accepted["id"] for e in events), events
    stamps = [int(t.headers["webhook-timestamp"]) for t in tries]
    assert stamps == sorted(stamps), stamps
    assert wait_job(rest, ALPHA, accepted["id"])["status"] == "completed"


def test_a_cancelled_job_is_posted_too(rest: httpx.Client, receivers: Receivers) -> None:
    before = len(receivers.ok.requests)
    accepted = submit(rest, ALPHA, body("a cancelled tapestry", seed=3, n=4, steps=200, size=256,
                                        webhook_url=_hook(receivers.ok, "/hook/cancelled")))
    poll_job(rest, ALPHA, accepted["id"], lambda j: j["progress"]["step"] > 0 or j["status"] in TERMINAL,
             "a denoising step")
    r = rest.post(f"{JOBS}/{accepted['id']}/cancel", headers=auth(ALPHA))
    assert r.status_code == 200, r.text
    job = wait_job(rest, ALPHA, accepted["id"])
    assert job["status"] == "cancelled", job
    received = receivers.ok.wait_for_requests(before + 1, DELIVERY_TIMEOUT_S)[before]
    assert received.path == "/hook/cancelled", received
    event = _verified(rest, received)
    assert event["type"] == "image.job.cancelled", event
    _same_job(event["data"], job)


def test_refused_webhook_urls_are_400_and_never_dialled(stack: TenantStack, rest: httpx.Client,
                                                        receivers: Receivers) -> None:
    ok, bystander = receivers.ok.port, receivers.bystander.port
    refused = [
        f"http://127.0.0.1:{bystander}/hook", f"https://127.0.0.1:{bystander}/hook",
        f"https://localhost:{bystander}/hook", "http://127.0.0.1/hook", "https://127.0.0.1/hook",
        "https://169.254.169.254/latest/meta-data/", "http://169.254.169.254/latest/meta-data/",
        "file:///etc/passwd", "gopher://localhost:70/", f"http://localhost:{ok}/hook",  # http where https is asked
        f"https://user:pw@localhost:{ok}/hook", f"https://[::ffff:127.0.0.1]:{ok}/hook",
        f"https://2130706433:{ok}/hook", f"https://127.1:{ok}/hook", f"https://[::1]:{ok}/hook",
        f"https://localhost:{ok}/hook#fragment",
    ]
    connections = {r.port: r.connections for r in receivers.all()}
    newest = rest.get(JOBS, params={"limit": 1}, headers=auth(ALPHA)).json()["first_id"]
    for url in refused:
        r = rest.post(GENERATIONS, json=body("an exfiltration", webhook_url=url), headers={**auth(ALPHA), **ASYNC})
        assert r.status_code == 400, (url, r.status_code, r.text)
        error = r.json()["error"]
        assert error["param"] == "webhook_url" and error["type"] == "invalid_request_error", (url, error)
    with grpc.insecure_channel(stack.addresses["gateway"]) as channel:
        stub = job_service_pb2_grpc.JobServiceStub(channel)
        request = pb.GenerateImagesRequest(prompt="an exfiltration", n=1, height=64, width=64, num_inference_steps=1)
        with pytest.raises(grpc.RpcError) as err:
            stub.SubmitJob(jpb.SubmitJobRequest(request=request, webhook_url=f"https://127.0.0.1:{bystander}/"),
                           metadata=bearer(ALPHA), timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "webhook_url" in err.value.details()
    # No job was made of any of them, and no receiver saw a connection.
    assert rest.get(JOBS, params={"limit": 1}, headers=auth(ALPHA)).json()["first_id"] == newest
    assert {r.port: r.connections for r in receivers.all()} == connections
    assert receivers.bystander.connections == 0


def test_a_redirect_to_a_private_address_is_a_failed_try_never_followed(rest: httpx.Client,
                                                                         receivers: Receivers) -> None:
    accepted = submit(rest, ALPHA, body("a redirected hook", seed=4, webhook_url=_hook(receivers.redirector)))
    # The 302 is a failed try: the message comes again (the same one), and the place it points to sees nothing.
    tries = receivers.redirector.wait_for_requests(2, DELIVERY_TIMEOUT_S)
    assert len({t.headers["webhook-id"] for t in tries}) == 1
    assert _verified(rest, tries[0])["data"]["id"] == accepted["id"]
    assert receivers.target.connections == 0 and receivers.target.requests == []
    assert wait_job(rest, ALPHA, accepted["id"])["status"] == "completed"


def test_webhook_url_without_respond_async_is_400(rest: httpx.Client, receivers: Receivers) -> None:
    """A webhook reports a job's end: a synchronous request naming one is refused, not run without it."""
    r = rest.post(GENERATIONS, json=body("no job here", webhook_url=_hook(receivers.ok)), headers=auth(ALPHA))
    assert r.status_code == 400 and r.json()["error"]["param"] == "webhook_url", r.text
