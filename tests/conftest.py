"""Shared fixtures: the tiny real GLM-Image, built once per session into a private cache directory, the test
certificates (tests/support/certs.py) and the scripted gateway of the SDK and CLI tests (tests/support/fake_gateway.py).

Fixtures shared by several test files live here rather than imported from tests/support: an imported fixture used
as a parameter reads to ruff as an unused import redefined (F401, F811).
"""
from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from runtime.executor import SerialExecutor
from tests.support import forkserver
from tests.support.certs import Pki, make_pki
from tests.support.fake_gateway import FakeServer, serve_fake
from tests.support.servers import serve_ar, serve_denoiser
from tests.support.sim_gateway import SimCluster, sim_cluster

REPO = Path(__file__).resolve().parents[1]
NODE_DIR = REPO / "clients" / "node"


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from services.model.tiny import TINY_VERSION, ensure_tiny_checkpoint

    if os.environ.get("PYTEST_XDIST_WORKER"):
        # One build for all xdist workers: their temporary directories share a parent, and the build is locked.
        cache = tmp_path_factory.getbasetemp().parent / "glmimage-cache"
    else:
        cache = tmp_path_factory.mktemp("glmimage-cache")
    # Subprocesses started by tests find the same checkpoint through the environment.
    os.environ["GLMIMAGE_CACHE"] = str(cache)
    return ensure_tiny_checkpoint(cache / TINY_VERSION)


@pytest.fixture(scope="session", autouse=True)
def jobs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Each worker's own default job store, images and secrets (gateway.jobs.defaults): a gateway a test starts
    without job flags must not share a queue with another worker's, nor with the machine's ~/.cache. Tests about
    jobs give theirs a directory of their own."""
    path = tmp_path_factory.mktemp("jobs")
    os.environ["GLMIMAGE_JOBS_DIR"] = str(path)
    return path


@pytest.fixture(scope="session", autouse=True)
def fork_server() -> None:
    """The launchers the tests start fork their AR and denoisers from this worker's fork server
    (tests/support/forkserver.py), as tests.support.cluster does: a model server's start then costs its model load
    and not its imports."""
    forkserver.export()


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """A CA, a server and a client certificate signed by it, and another CA with a client certificate of its own."""
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def fake_server() -> Iterator[FakeServer]:
    with serve_fake() as srv:
        yield srv


@pytest.fixture()
def fake(fake_server: FakeServer) -> FakeServer:
    """The module's scripted gateway, its calls and injected failures cleared."""
    fake_server.servicer.reset()
    return fake_server


@pytest.fixture
async def sims() -> AsyncIterator[SimCluster]:
    """Simulated workers (real gRPC servers with health): one AR, three denoisers."""
    async with sim_cluster() as c:
        yield c


@pytest.fixture
def dialled(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every address the gateway creates a worker channel for, from now on (the real make_channel still runs)."""
    import gateway.workers as workers_module

    seen: list[str] = []
    real = workers_module.make_channel

    def recording(address, *args, **kwargs):
        seen.append(address)
        return real(address, *args, **kwargs)

    monkeypatch.setattr(workers_module, "make_channel", recording)
    return seen


@pytest.fixture(scope="session")
def node() -> str:
    """The node binary, with the Node client's packages installed from its lock; skips when node is absent."""
    found = shutil.which("node")
    if found is None:
        pytest.skip("node is not installed")
    if not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir():
        npm = shutil.which("npm")
        assert npm, "node is installed but npm is not: install npm to fetch @grpc/grpc-js"
        # Exactly the committed lock; nothing is cached in git (node_modules/ is ignored).
        subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=NODE_DIR, check=True, timeout=600)
    return found


@pytest.fixture(scope="session")
def ar_engine(tiny_checkpoint: Path):
    from services.ar.engine import ArEngine

    engine = ArEngine.load(tiny_checkpoint, device="cpu")
    engine.warm_up()
    return engine


@pytest.fixture(scope="session")
def denoise_engine(tiny_checkpoint: Path):
    from services.denoiser.engine import DenoiseEngine

    engine = DenoiseEngine.load(tiny_checkpoint, device="cpu")
    engine.warm_up()
    return engine


@pytest.fixture(scope="session")
async def ar_server(ar_engine):
    """A real ArService on 127.0.0.1:<ephemeral>, SERVING; `.servicer` exposes its admission queue."""
    server = await serve_ar(ar_engine, SerialExecutor("test-ar"))
    yield server
    await server.stop(None)


@pytest.fixture(scope="session")
async def denoiser_server(denoise_engine):
    """A real DenoiserService on 127.0.0.1:<ephemeral>, SERVING; `.servicer` exposes its busy flag."""
    server = await serve_denoiser(denoise_engine, SerialExecutor("test-denoiser"))
    yield server
    await server.stop(None)


@pytest.fixture(scope="session")
async def second_denoiser_server(tiny_checkpoint: Path):
    """A second denoiser with its own engine: a pipeline must never be shared by two servers."""
    from services.denoiser.engine import DenoiseEngine

    server = await serve_denoiser(DenoiseEngine.load(tiny_checkpoint, device="cpu"), SerialExecutor("test-denoiser-2"))
    yield server
    await server.stop(None)


# The chart rendered with the documented values sets (tests/test_k8s*.py). tests.support.chart is imported in the
# fixtures: it skips the test module that uses it where the dev extra's Helm SDK is missing.
@pytest.fixture(scope="session")
def documented_docs() -> dict[str, list[dict]]:
    from tests.support.chart import documented_values, render

    return {name: render(values) for name, values in documented_values().items()}


@pytest.fixture(scope="session")
def default_docs() -> list[dict]:
    from tests.support.chart import render

    return render()


@pytest.fixture(scope="session")
def gpu_docs() -> list[dict]:
    from tests.support.chart import gpu_values, render

    return render(gpu_values())


@pytest.fixture(scope="session")
def tls_docs() -> list[dict]:
    from tests.support.chart import TLS_VALUES, render

    return render(TLS_VALUES)


@pytest.fixture(scope="session")
def promtool() -> str:
    """Prometheus' promtool, from the Debian package `prometheus` that `make tools` installs."""
    found = shutil.which("promtool")
    if found is None:
        pytest.fail("promtool not found. It comes from the Debian package `prometheus`: "
                    "`apt-get install -y prometheus` (make test installs it when run as root)")
    return found


# The longest test files, in seconds of one worker (a 3-worker run of `make test` on a 2-core machine, 2026-12-08),
# longest first. `make test` runs whole files on workers (--dist loadfile) in this order, not in xdist's default one
# (by number of tests, which sends the long files of a few process tests last, one worker finishing them alone while
# the others idle): longest first, every worker ends within about a short file of the others. A file missing here
# runs after these, in collection order; an outdated figure only costs a little balance.
LONGEST_FILES = {
    "test_keepalive.py": 124, "test_chaos.py": 97, "test_tenants_e2e.py": 86, "test_heavy_edits.py": 82,
    "test_denoiser_compile.py": 80, "test_jobs_durability.py": 74, "test_dashboard.py": 57, "test_e2e.py": 49,
    "test_lora_gateway.py": 48, "test_scheduler_machine.py": 47, "test_jobs_attack.py": 46, "test_status_page.py": 42,
    "test_rolling_restart.py": 42, "test_version_skew.py": 41, "test_mixed_pools.py": 36,
    "test_jobs_postgres_e2e.py": 34, "test_jobs_clients_e2e.py": 32, "test_fuzz_workers.py": 31,
    "test_authz_internal_token.py": 31, "test_jobs_s3_e2e.py": 30, "test_fuzz_extremes.py": 28,
    "test_tenants_reload.py": 27, "test_fuzz_gateway.py": 27, "test_intake.py": 25, "test_bench_rolling.py": 24,
    "test_jobs_e2e.py": 23, "test_grpcurl.py": 21, "test_cli.py": 17, "test_ar_service.py": 17,
    "test_scheduler_replay.py": 16, "test_rest_connections.py": 16, "test_node_client.py": 16, "test_gateway.py": 16,
    "test_bench_smoke.py": 16, "test_rest_ranges.py": 15, "test_readme_commands.py": 15,
    "test_launcher_restarts.py": 15, "test_tenants_redis_e2e.py": 14, "test_rolling_restart_workers.py": 13,
    "test_gateway_processes.py": 13, "test_openai_sdk.py": 12, "test_k8s.py": 12, "test_credentials.py": 12,
    "test_several_gateways.py": 11, "test_signals.py": 10, "test_cli_jobs.py": 10,
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: -LONGEST_FILES.get(item.path.name, 0))  # stable: a file's tests stay in order
