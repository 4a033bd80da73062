"""The scripted JobService of the job SDK, CLI and Node tests, on a real (threaded) gRPC server, with the image
files its completed jobs link to on a real HTTP server, and a TCP proxy whose connections a test can cut.

Jobs move only when the test says (`start`, `step`, `complete`, `fail`), so every state a client sees is one the
test chose; WatchJob sends the job now and again at each change, as the gateway does. Tenants come from the
``authorization`` key (`KEYS`); another tenant's job is NOT_FOUND. `watch_breaks` makes the next WatchJob calls fail
UNAVAILABLE after a number of messages, like a gateway that went away mid-stream.
"""
from __future__ import annotations

import contextlib
import http.server
import json
import socket
import threading
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field

import grpc

from glmimage.v1 import common_pb2, gateway_service_pb2, job_service_pb2, job_service_pb2_grpc
from tests.support.fake_gateway import fake_image

KEYS = {"sk-alpha": "alpha", "sk-beta": "beta"}
ANONYMOUS = "anonymous"  # no key: one tenant of its own, as a gateway without a tenants file has
STATUS = {name: job_service_pb2.JobStatus.Value(f"JOB_STATUS_{name.upper()}")
          for name in ("queued", "in_progress", "completed", "failed", "cancelled")}
TERMINAL = {STATUS["completed"], STATUS["failed"], STATUS["cancelled"]}
CREATED_AT = 1_700_000_000  # jobs are created a second apart from here: a fixed clock for the tests' tables
JOB_TTL = 86_400


@dataclass
class Call:
    method: str
    request: object
    metadata: dict[str, str]


@dataclass
class Entry:
    tenant: str
    job: job_service_pb2.Job
    request: gateway_service_pb2.GenerateImagesRequest
    idempotency_key: str
    images: list[bytes] = field(default_factory=list)


@dataclass
class FakeJobService(job_service_pb2_grpc.JobServiceServicer):
    """Scripted JobService. ``image_base``: what image URLs start with (an absolute http://... of `ImageFiles`, or a
    path, as a gateway without --public-url answers)."""

    image_base: str = "/files/"
    files: ImageFiles | None = None
    calls: list[Call] = field(default_factory=list)
    fail: dict[str, list[grpc.StatusCode]] = field(default_factory=dict)
    # Each WatchJob call takes the next entry: fail UNAVAILABLE after that many messages (none left: never).
    watch_breaks: list[int] = field(default_factory=list)
    entries: dict[str, Entry] = field(default_factory=dict)
    cond: threading.Condition = field(default_factory=threading.Condition)
    # Released once per WatchJob call that began: a test drives the job once its client watches (wait_watching).
    watching: threading.Semaphore = field(default_factory=lambda: threading.Semaphore(0))
    # Every job state a WatchJob call has sent, in order (`wait_sent`).
    sent: list[job_service_pb2.Job] = field(default_factory=list)
    _clock: int = CREATED_AT

    def reset(self) -> None:
        with self.cond:
            self.calls.clear()
            self.fail.clear()
            self.watch_breaks.clear()
            self.entries.clear()
            self.sent.clear()
            self._clock = CREATED_AT
        self.watching = threading.Semaphore(0)

    def methods(self) -> list[str]:
        return [c.method for c in self.calls]

    # --- the test's controls ---------------------------------------------------------------------------------------

    def add(self, tenant: str, prompt: str = "p", n: int = 1, status: str = "queued") -> str:
        """A job of ``tenant`` made without a client (for lists and other tenants' jobs)."""
        job = self._new(tenant, gateway_service_pb2.GenerateImagesRequest(prompt=prompt, n=n), "")
        if status != "queued":
            self.start(job)
            {"completed": self.complete, "failed": lambda j: self.fail_job(j, "INVALID_ARGUMENT", "no", "prompt"),
             "cancelled": self.cancel, "in_progress": lambda j: None}[status](job)
        return job

    def _change(self, job_id: str, update) -> None:
        with self.cond:
            update(self.entries[job_id].job)
            self.cond.notify_all()

    def start(self, job_id: str, total_steps: int = 4) -> None:
        def go(j: job_service_pb2.Job) -> None:
            j.status, j.started_at, j.attempts = STATUS["in_progress"], j.created_at + 1, j.attempts + 1
            j.progress.queue_position, j.progress.step, j.progress.total_steps = 0, 0, total_steps
        self._change(job_id, go)

    def step(self, job_id: str, step: int) -> None:
        self._change(job_id, lambda j: setattr(j.progress, "step", step))

    def queue_position(self, job_id: str, position: int) -> None:
        self._change(job_id, lambda j: setattr(j.progress, "queue_position", position))

    def complete(self, job_id: str) -> None:
        entry = self.entries[job_id]
        r = entry.request
        seed = r.seed if r.HasField("seed") else 1000
        n = r.n or 1
        entry.images = [fake_image(r.prompt, i, seed + i, r.output_format) for i in range(n)]
        for i, data in enumerate(entry.images):
            if self.files is not None:
                self.files.objects[f"{job_id}/{i}"] = data

        def done(j: job_service_pb2.Job) -> None:
            j.status, j.finished_at, j.expires_at = STATUS["completed"], j.created_at + 2, j.created_at + 2 + JOB_TTL
            j.progress.step = j.progress.total_steps
            usage = common_pb2.Usage(prompt_tokens=2, completion_tokens=10, total_tokens=12)
            j.result.CopyFrom(gateway_service_pb2.GenerateImagesResponse(
                # Deliberately out of order: clients must sort by index.
                images=[gateway_service_pb2.GeneratedImage(
                    index=i, seed=seed + i, url=f"{self.image_base}{job_id}/{i}?sig=secret-{i}",
                    url_expires_at=j.created_at + 3600, usage=usage) for i in reversed(range(n))],
                usage=common_pb2.Usage(prompt_tokens=2 * n, completion_tokens=10 * n, total_tokens=12 * n),
                height=r.height or 256, width=r.width or 256,
                output_format=r.output_format or common_pb2.IMAGE_FORMAT_PNG, request_id=j.request_id))
        self._change(job_id, done)

    def fail_job(self, job_id: str, code: str, message: str, field_name: str = "") -> None:
        def failed(j: job_service_pb2.Job) -> None:
            j.status, j.finished_at, j.expires_at = STATUS["failed"], j.created_at + 2, j.created_at + 2 + JOB_TTL
            j.error.CopyFrom(job_service_pb2.JobError(code=code, message=message, field=field_name))
        self._change(job_id, failed)

    def cancel(self, job_id: str) -> None:
        def cancelled(j: job_service_pb2.Job) -> None:
            if j.status not in TERMINAL:
                j.status, j.finished_at, j.expires_at = STATUS["cancelled"], j.created_at + 2, j.created_at + JOB_TTL
        self._change(job_id, cancelled)

    def wait_sent(self, job_id: str, timeout: float = 30) -> None:
        """Until a watch has sent the job as it is now: a test that changes it only then has its client see every
        state (changes faster than the stream would merge into one message)."""
        with self.cond:
            now = self.entries[job_id].job
            assert self.cond.wait_for(lambda: any(j == now for j in self.sent), timeout), \
                f"no watch sent {job_id} as it is now"

    def job(self, job_id: str) -> job_service_pb2.Job:
        with self.cond:
            return job_service_pb2.Job().FromString(self.entries[job_id].job.SerializeToString())

    def last_job_id(self) -> str:
        with self.cond:
            return next(reversed(self.entries))

    # --- the service ---------------------------------------------------------------------------------------------

    def _enter(self, method: str, request, context: grpc.ServicerContext) -> str:
        """Records the call; the caller's tenant (an unknown key is UNAUTHENTICATED, as the gateway answers)."""
        metadata = dict(context.invocation_metadata())
        with self.cond:
            self.calls.append(Call(method, request, metadata))
            codes = self.fail.get(method) or []
            code = codes.pop(0) if codes else None
        if code is not None:
            context.abort(code, f"injected {code.name}")
        auth = metadata.get("authorization")
        if auth is None:
            return ANONYMOUS
        tenant = KEYS.get(auth.removeprefix("Bearer "))
        if tenant is None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "unknown API key")
        return tenant

    def _new(self, tenant: str, request: gateway_service_pb2.GenerateImagesRequest, key: str,
             webhook_url: str = "", request_id: str = "") -> str:
        with self.cond:
            self._clock += 1
            job_id = f"job_{len(self.entries):032x}"
            job = job_service_pb2.Job(id=job_id, status=STATUS["queued"], created_at=self._clock, n=request.n or 1,
                                      edit=bool(request.reference_images), webhook_url=webhook_url,
                                      request_id=request_id or f"rid-{len(self.entries)}",
                                      progress=job_service_pb2.JobProgress(queue_position=1))
            self.entries[job_id] = Entry(tenant, job, request, key)
            self.cond.notify_all()
            return job_id

    def _find(self, tenant: str, job_id: str, context: grpc.ServicerContext) -> Entry:
        entry = self.entries.get(job_id)
        if entry is None or entry.tenant != tenant:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no job {job_id}")
        return entry

    def SubmitJob(self, request, context):
        tenant = self._enter("SubmitJob", request, context)
        r = request.request
        if r.prompt == "invalid":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request.prompt: not allowed")
        if request.webhook_url.startswith("http://127."):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "webhook_url: a loopback address is refused")
        with self.cond:
            for entry in self.entries.values():
                if request.idempotency_key and (entry.tenant, entry.idempotency_key) == (tenant,
                                                                                         request.idempotency_key):
                    return job_service_pb2.SubmitJobResponse(job=entry.job)
        rid = dict(context.invocation_metadata()).get("x-request-id", "")
        job_id = self._new(tenant, r, request.idempotency_key, request.webhook_url, rid)
        return job_service_pb2.SubmitJobResponse(job=self.job(job_id))

    def _answer(self, entry: Entry, include_images: bool) -> job_service_pb2.Job:
        job = job_service_pb2.Job().FromString(entry.job.SerializeToString())
        if include_images:
            for im in job.result.images:
                im.image = entry.images[im.index]
        return job

    def GetJob(self, request, context):
        tenant = self._enter("GetJob", request, context)
        with self.cond:
            entry = self._find(tenant, request.id, context)
            return job_service_pb2.GetJobResponse(job=self._answer(entry, request.include_images))

    def WatchJob(self, request, context):
        tenant = self._enter("WatchJob", request, context)
        with self.cond:
            entry = self._find(tenant, request.id, context)
            breaks = self.watch_breaks.pop(0) if self.watch_breaks else None
        self.watching.release()
        sent = 0
        last = None
        while context.is_active():
            if breaks is not None and sent >= breaks:
                context.abort(grpc.StatusCode.UNAVAILABLE, "the gateway went away")
            with self.cond:
                self.cond.wait_for(lambda seen=last: entry.job.SerializeToString() != seen or not context.is_active(),
                                   0.5)
                now = entry.job.SerializeToString()
                if now == last:
                    continue
                last = now
                job = self._answer(entry, False)
                self.sent.append(job)
                self.cond.notify_all()
            yield job_service_pb2.WatchJobResponse(job=job)
            sent += 1
            if job.status in TERMINAL:
                return

    def CancelJob(self, request, context):
        tenant = self._enter("CancelJob", request, context)
        with self.cond:
            entry = self._find(tenant, request.id, context)
        self.cancel(request.id)
        return job_service_pb2.CancelJobResponse(job=self._answer(entry, False))

    def ListJobs(self, request, context):
        tenant = self._enter("ListJobs", request, context)
        limit = request.limit or 20
        if limit > 100:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "limit: at most 100")
        with self.cond:
            mine = [e for e in reversed(self.entries.values()) if e.tenant == tenant
                    and (not request.status or e.job.status == request.status)]
            ids = [e.job.id for e in mine]
            if request.after:
                if request.after not in ids:
                    return job_service_pb2.ListJobsResponse()
                mine = mine[ids.index(request.after) + 1:]
            return job_service_pb2.ListJobsResponse(jobs=[e.job for e in mine[:limit]], has_more=len(mine) > limit)

    def GetWebhookSecret(self, request, context):
        tenant = self._enter("GetWebhookSecret", request, context)
        return job_service_pb2.GetWebhookSecretResponse(secret=f"whsec_{tenant}")


@dataclass
class FakeJobsServer:
    servicer: FakeJobService
    address: str
    server: grpc.Server
    files: ImageFiles


@contextlib.contextmanager
def serve_fake_jobs(absolute_urls: bool = True) -> Iterator[FakeJobsServer]:
    """The scripted JobService on an ephemeral loopback port and its image files on another; stopped on exit.
    ``absolute_urls``: image URLs name the file server (as with the gateway's --public-url), else they are paths."""
    with serve_image_files() as files:
        servicer = FakeJobService(image_base=f"{files.base_url}/files/" if absolute_urls else "/files/", files=files)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
        job_service_pb2_grpc.add_JobServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        try:
            yield FakeJobsServer(servicer, f"127.0.0.1:{port}", server, files)
        finally:
            server.stop(None)


# --- image files over HTTP ---------------------------------------------------------------------------------------


@dataclass
class ImageFiles:
    """``GET /files/<job>/<i>?sig=...``: the object's bytes; a key in ``expired`` answers 403 as the REST front does
    for an expired URL. ``requests``: each request's path and headers."""

    base_url: str = ""
    objects: dict[str, bytes] = field(default_factory=dict)
    expired: set[str] = field(default_factory=set)
    requests: list[tuple[str, dict[str, str]]] = field(default_factory=list)


@contextlib.contextmanager
def serve_image_files() -> Iterator[ImageFiles]:
    files = ImageFiles()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            files.requests.append((self.path, dict(self.headers)))
            key = self.path.split("?", 1)[0].removeprefix("/files/")
            if key in files.expired:
                body = json.dumps({"error": {"message": "the URL has expired", "type": "invalid_request_error",
                                             "code": "url_expired"}}).encode()
                self._send(403, body, "application/json")
            elif key in files.objects:
                self._send(200, files.objects[key], "image/png")
            else:
                self._send(404, b'{"error": {"message": "no such file", "code": null}}', "application/json")

        def _send(self, code: int, body: bytes, content_type: str) -> None:
            self.send_response(code)
            self.send_header("content-type", content_type)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    files.base_url = f"http://127.0.0.1:{httpd.server_address[1]}"
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield files
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()


# --- a TCP proxy whose connections a test can cut ----------------------------------------------------------------


class TcpProxy:
    """Forwards 127.0.0.1:<port> to ``target``; `drop` cuts every open connection (both ways, at once), as a load
    balancer's idle timeout or a lost network does, while the listener stays up for the client's reconnect."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.lock = threading.Lock()
        self.open: list[socket.socket] = []
        self.accepted = 0
        self.connected = threading.Condition(self.lock)
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self.lock:
                self.open += [client, upstream]
                self.accepted += 1
                self.connected.notify_all()
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def wait_connections(self, count: int, timeout: float = 30) -> None:
        """Until ``count`` connections were accepted in all."""
        with self.lock:
            assert self.connected.wait_for(lambda: self.accepted >= count, timeout), \
                f"{self.accepted} connections through the proxy, not {count}"

    def drop(self) -> int:
        """Cut every open connection; how many sockets were cut."""
        with self.lock:
            cut, self.open = self.open, []
        for s in cut:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
        return len(cut)

    def close(self) -> None:
        self.listener.close()
        self.drop()


@contextlib.contextmanager
def tcp_proxy(target: str) -> Iterator[TcpProxy]:
    proxy = TcpProxy(target)
    try:
        yield proxy
    finally:
        proxy.close()


def wait_watching(servicer: FakeJobService, timeout: float = 30) -> None:
    """Until a WatchJob call has begun (one per call to this)."""
    assert servicer.watching.acquire(timeout=timeout), "no WatchJob call began"
