"""Version skew on real processes: this commit's gateway with the previous release's AR and denoiser, the previous
release's gateway with this commit's workers, and a worker whose contract revisions the gateway does not speak
(refused: INCOMPATIBLE in GetStatus, the metric set, no work sent to it, requests served by the others).

The previous release runs from a checkout of PREVIOUS_RELEASE (a shared clone in a temporary directory, its own
stubs first on the path), with the same interpreter and the same tiny checkpoint.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.compat import SPOKEN, UNNUMBERED, Revisions, gateway_build, incompatibility, revisions_of
from glmimage.v1 import ar_service_pb2, ar_service_pb2_grpc, common_pb2, denoiser_service_pb2, denoiser_service_pb2_grpc
from glmimage.v1 import gateway_service_pb2 as pb
from glmimage.v1 import gateway_service_pb2_grpc as pb_grpc
from runtime.version import PROTO_REVISION, package_version
from tests.support import forkserver
from tests.support.cluster import SERVICES, reap, wait_serving
from tests.support.waiting import until

REPO = Path(__file__).resolve().parents[1]
# The previous release: no tag yet, so the last commit before issue 32's work began ("bench/jobs in make bench"),
# which predates contract revisions (its workers report none, its gateway reads none).
PREVIOUS_RELEASE = "910cb225acff16436c9058a4c48adbdebfef3163"
SIZE = 64
PROMPT = 'skew "OK"'
# A worker of a release far ahead: it speaks only revisions this gateway does not.
UNSPOKEN = SPOKEN.newest + 98
MODULES = {"ar": "services.ar", "denoiser": "services.denoiser", "gateway": "gateway"}
# This commit's denoiser, reporting UNSPOKEN as both ends of its range (the constants are read at each GetLimits).
UNSPOKEN_DENOISER = ("import runpy, runtime.version as v; "
                     f"v.PROTO_REVISION = v.OLDEST_PROTO_REVISION = {UNSPOKEN}; "
                     "runpy.run_module('services.denoiser', run_name='__main__', alter_sys=True)")


@dataclass
class Server:
    name: str
    role: str
    popen: subprocess.Popen | forkserver.Forked
    port_file: Path
    metrics_file: Path
    log: Path
    port: int = 0
    metrics_port: int = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])


class Servers:
    """Processes started from either tree: cwd and PYTHONPATH pick the release's own packages and stubs."""

    def __init__(self, workdir: Path) -> None:
        self.dir = workdir
        self.all: list[Server] = []
        self.by_name: dict[str, Server] = {}

    def __getitem__(self, name: str) -> Server:
        return self.by_name[name]

    def start(self, name: str, role: str, flags: list[str], *, tree: Path = REPO, code: str | None = None,
              metrics: bool = False, port: int = 0) -> Server:
        """``metrics``: serve /metrics on a port of its own (this tree only: --metrics-port-file is newer);
        ``port``: the one a server it replaces had bound (a restart, as a pod behind a stable address)."""
        (self.dir / f"{name}.port").unlink(missing_ok=True)
        port_file, metrics_file, log = (self.dir / f"{name}.{ext}" for ext in ("port", "metrics-port", "log"))
        launch = ["-c", code] if code else ["-m", MODULES[role]]
        argv = [sys.executable, *launch, "--host", "127.0.0.1", "--port", str(port), "--port-file", str(port_file),
                *flags]
        if metrics:
            argv += ["--metrics-port", "0", "--metrics-port-file", str(metrics_file)]
        if role != "gateway":
            argv += ["--torch-threads", "1", "--device", "cpu"]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(tree / "clients" / "python")])}
        # From the fork servers, as the rest of the suite's servers start, in the release's tree with its path (the
        # previous release's code is imported afresh there); `-c` code runs as a plain process.
        popen = forkserver.spawn(argv, log, env, cwd=tree)
        server = Server(name, role, popen, port_file, metrics_file, log)
        self.all.append(server)
        self.by_name[name] = server
        return server

    def ready(self, *servers: Server, timeout: float = 120) -> None:
        for s in servers:
            deadline = time.monotonic() + timeout
            while not s.port_file.exists():  # written atomically once bound, after the metrics port file
                if s.popen.poll() is not None:
                    raise RuntimeError(f"{s.name} exited ({s.popen.returncode}): {s.tail()}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{s.name} did not bind a port: {s.tail()}")
                time.sleep(0.02)
            s.port = int(s.port_file.read_text())
            if s.metrics_file.exists():
                s.metrics_port = int(s.metrics_file.read_text())
            wait_serving(s.address, SERVICES[s.role], timeout)

    def close(self) -> None:
        # The gateways first: a worker's drain then has no gateway left to wait for.
        for group in ([s for s in self.all if s.role == "gateway"], [s for s in self.all if s.role != "gateway"]):
            for s in group:
                if s.popen.poll() is None:
                    s.popen.terminate()
            for s in group:
                reap(s.popen, 30)


def _gateway_flags(ar: Server, *denoisers: Server) -> list[str]:
    return ["--ar", ar.address, *(f"--denoiser={d.address}" for d in denoisers), "--request-timeout", "60"]


@pytest.fixture(scope="module")
def previous_release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkout of PREVIOUS_RELEASE sharing this repository's objects (nothing fetched, this tree untouched)."""
    tree = tmp_path_factory.mktemp("previous") / "glmimage"
    subprocess.run(["git", "clone", "-q", "--shared", "--no-checkout", str(REPO), str(tree)], check=True)
    subprocess.run(["git", "-C", str(tree), "checkout", "-q", PREVIOUS_RELEASE], check=True)
    return tree


@pytest.fixture(scope="module")
def pool(tiny_checkpoint: Path, previous_release: Path, tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[Servers]:
    """Every server of the three pairings, started together (their model loads overlap)."""
    servers = Servers(tmp_path_factory.mktemp("skew"))
    try:
        old = previous_release
        s = {"old_ar": servers.start("old_ar", "ar", [], tree=old),
             "old_denoiser": servers.start("old_denoiser", "denoiser", [], tree=old),
             "ar": servers.start("ar", "ar", []),
             "denoiser": servers.start("denoiser", "denoiser", [], metrics=True),
             "unspoken": servers.start("unspoken", "denoiser", [], code=UNSPOKEN_DENOISER, metrics=True)}
        servers.ready(*s.values())
        s["gateway_new"] = servers.start("gateway_new", "gateway", _gateway_flags(s["old_ar"], s["old_denoiser"]),
                                         metrics=True)
        s["gateway_old"] = servers.start("gateway_old", "gateway", _gateway_flags(s["ar"], s["denoiser"]), tree=old)
        s["gateway_mixed"] = servers.start("gateway_mixed", "gateway",
                                           _gateway_flags(s["ar"], s["unspoken"], s["denoiser"]), metrics=True)
        servers.ready(s["gateway_new"], s["gateway_old"], s["gateway_mixed"])
        yield servers
    finally:
        servers.close()


def _gateway(server: Server) -> pb_grpc.GatewayServiceStub:
    return pb_grpc.GatewayServiceStub(grpc.insecure_channel(server.address))


def _status(server: Server) -> pb.GetStatusResponse:
    return _gateway(server).GetStatus(pb.GetStatusRequest(), timeout=10)


def _ready(server: Server, available: int) -> None:
    until(lambda: sum(w.state == pb.WORKER_STATE_AVAILABLE for w in _status(server).workers) >= available, 60,
          f"{available} workers available on {server.name}")


def _generate_both_ways(gateway: Server) -> None:
    """A plain request and a streamed one, each of two images: every image comes back."""
    stub = _gateway(gateway)
    reply = stub.GenerateImages(pb.GenerateImagesRequest(prompt=PROMPT, n=2, height=SIZE, width=SIZE, seed=7),
                                timeout=60)
    assert len(reply.images) == 2 and all(img.image for img in reply.images)
    stream = stub.GenerateImagesStream(pb.GenerateImagesStreamRequest(
        request=pb.GenerateImagesRequest(prompt=PROMPT, n=2, height=SIZE, width=SIZE, seed=7)), timeout=60)
    completed = [m.completed for m in stream if m.HasField("completed")]
    assert len(completed) == 1 and len(completed[0].images) == 2
    # The same seed, the same image, whichever release drew it.
    assert [i.image for i in completed[0].images] == [i.image for i in reply.images]


def _metric(server: Server, name: str, labels: dict[str, str] | None = None) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name and all(sample.labels.get(k) == v for k, v in (labels or {}).items()))


def test_this_gateway_serves_the_previous_releases_workers(pool: Servers) -> None:
    old_ar, gateway = pool["old_ar"], pool["gateway_new"]
    # They are the previous release: their GetLimits carries no BuildInfo (revision 0, read as 1).
    with grpc.insecure_channel(old_ar.address) as channel:
        limits = ar_service_pb2_grpc.ArServiceStub(channel).GetLimits(ar_service_pb2.ArServiceGetLimitsRequest(),
                                                                       timeout=10)
        assert not limits.HasField("build")
    _ready(gateway, 2)
    _generate_both_ways(gateway)
    status = _status(gateway)
    assert not any(w.incompatible for w in status.workers)
    assert status.gateway_build.proto_revision == PROTO_REVISION
    assert status.gateway_build.version == package_version()
    assert _metric(gateway, "glmimage_gateway_workers_incompatible") == 0


def test_the_previous_releases_gateway_serves_this_commits_workers(pool: Servers) -> None:
    gateway, denoiser = pool["gateway_old"], pool["denoiser"]
    with grpc.insecure_channel(denoiser.address) as channel:
        limits = denoiser_service_pb2_grpc.DenoiserServiceStub(channel).GetLimits(
            denoiser_service_pb2.DenoiserServiceGetLimitsRequest(), timeout=10)
    assert limits.build.proto_revision == PROTO_REVISION and limits.build.version == package_version()
    _ready(gateway, 2)
    # It is the previous release: its GetStatus has no gateway_build.
    assert not _status(gateway).HasField("gateway_build")
    _generate_both_ways(gateway)


def test_a_worker_speaking_no_revision_of_the_gateways_gets_no_work(pool: Servers) -> None:
    gateway, unspoken = pool["gateway_mixed"], pool["unspoken"]

    def refused() -> pb.WorkerStatus | None:
        return next((w for w in _status(gateway).workers if w.address == unspoken.address and w.incompatible), None)

    _ready(gateway, 2)  # the AR and the compatible denoiser
    until(refused, 60, "the unspoken denoiser shown incompatible")
    entry = refused()
    assert entry is not None and entry.state == pb.WORKER_STATE_UNHEALTHY and "incompatible" in entry.health
    assert f"revision {UNSPOKEN}" in entry.health_detail and f"speaks {SPOKEN}" in entry.health_detail
    assert entry.build.proto_revision == UNSPOKEN
    until(lambda: _metric(gateway, "glmimage_gateway_workers_incompatible", {"role": "denoiser"}) == 1, 30,
          "the incompatible gauge")
    assert _metric(gateway, "glmimage_gateway_workers_incompatible", {"role": "ar"}) == 0
    for _ in range(3):
        _generate_both_ways(gateway)
    # Every image was drawn by the compatible denoiser: the other ran none and still is refused.
    assert _metric(unspoken, "glmimage_denoiser_jobs_total") == 0
    assert _metric(pool["denoiser"], "glmimage_denoiser_jobs_total", {"outcome": "ok"}) >= 12
    assert refused() is not None

    # Rolled to this release at the same address: it serves, and the gateway says so everywhere.
    unspoken.popen.terminate()
    reap(unspoken.popen, 30)
    rolled = pool.start("rolled", "denoiser", [], metrics=True, port=unspoken.port)
    pool.ready(rolled)

    def serving() -> bool:
        entry = next(w for w in _status(gateway).workers if w.address == rolled.address)
        return entry.state == pb.WORKER_STATE_AVAILABLE and not entry.incompatible and not entry.health_detail

    until(serving, 60, "the rolled denoiser available")
    until(lambda: _metric(gateway, "glmimage_gateway_workers_incompatible") == 0, 30, "the gauge back at 0")
    assert next(w for w in _status(gateway).workers if w.address == rolled.address).build.proto_revision == \
        PROTO_REVISION


@pytest.mark.parametrize(("newest", "oldest", "spoken", "served"), [
    (0, 0, Revisions(1, 1), True),  # a release older than revisions: revision 1
    (0, 0, Revisions(2, 3), False),  # ... which a gateway that dropped revision 1 no longer serves
    (1, 0, Revisions(1, 2), True),  # no oldest: only its newest
    (3, 2, Revisions(1, 2), True),  # a newer worker that still serves this gateway's newest
    (3, 3, Revisions(1, 2), False),  # one that serves only newer ones
    (5, 9, Revisions(1, 5), True),  # an oldest past the newest reads as the newest
])
def test_the_rule_is_an_overlap_of_revision_ranges(newest: int, oldest: int, spoken: Revisions, served: bool) -> None:
    why = incompatibility(common_pb2.BuildInfo(version="9.9.9", git_commit="ab" * 20, proto_revision=newest,
                                               min_proto_revision=oldest), spoken)
    assert (why == "") is served, why
    if not served:
        assert why.startswith(f"speaks contract revision {revisions_of(common_pb2.BuildInfo(proto_revision=newest))}")
        assert "release 9.9.9, abababababab" in why and why.endswith(f"this gateway speaks {spoken}")


def test_this_release_speaks_its_own_revision_and_the_unnumbered_one() -> None:
    """The release boundary: this gateway serves the workers of the release before revisions, and those of its own."""
    assert SPOKEN.oldest <= UNNUMBERED <= SPOKEN.newest == PROTO_REVISION
    assert incompatibility(common_pb2.BuildInfo()) == ""
    assert incompatibility(gateway_build()) == ""
