"""Several gateways and REST fronts share jobs through PostgreSQL (issue 31's done-when), on real processes: a real
PostgreSQL (Debian's, tests/support/postgres_server.py), the AR and a denoiser started once by the launcher with
the first gateway and REST front, a second gateway and REST front started beside it on the same database and
workers. 64 jobs submitted alternately to the two fronts; once some are done and the second gateway is denoising
some of its own, that gateway and its front are SIGKILLed and stay dead. Polled through the surviving front: 0 lost
(every job completed, its images there), 0 recorded twice (read in PostgreSQL itself: 64 rows, one result of n
images each, the objects table exactly those images); the dead gateway's jobs were taken over and run again.
"""
from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cluster import Cluster
from tests.support.jobs_stack import (
    LEASE_S,
    JobClient,
    assert_recorded_once,
    body,
    launcher_argv,
    read_postgres,
    running,
)
from tests.support.net import free_port
from tests.support.postgres_server import PostgresServer, running_postgres
from tests.support.tenants_stack import sample
from tests.support.waiting import until

pytestmark = [pytest.mark.e2e, pytest.mark.chaos]

# 80 images of 64x64 at 16 steps: half a minute on one AR and one denoiser of a loaded 2-core machine (an image
# costs its AR most: some 260 tokens, the preview grid's, at any size).
JOBS, STEPS, SIZE = 64, 16, 64


@pytest.fixture(scope="module")
def pg() -> Iterator[PostgresServer]:
    with running_postgres() as server:
        yield server


def test_two_fronts_two_gateways_one_of_each_killed(tiny_checkpoint: Path, tmp_path: Path,
                                                     pg: PostgresServer) -> None:
    dsn = pg.dsn()
    jobs_dir = tmp_path / "jobs"
    images = jobs_dir / "images"
    client = JobClient()
    with running(launcher_argv(tmp_path, jobs_dir, free_port(), "--jobs-db", dsn), tmp_path) as stack:
        addr = stack.addresses
        front_a = stack.rest()
        # The second gateway and front: on the stack's workers, job store, image directory and link secret (the
        # launcher made the secret files in its --jobs-dir), started outside it so that once killed they stay dead.
        side = Cluster(tmp_path / "side")
        try:
            side.start("gateway-b", "gateway", [
                "--ar", addr["ar"], "--denoiser", addr["denoiser-0"], "--jobs-db", dsn, "--image-store", str(images),
                "--url-secret-file", str(jobs_dir / "url-secret"),
                "--webhook-secret-file", str(jobs_dir / "webhook-secret"), "--job-lease", str(LEASE_S)])
            gateway_b = side.procs["gateway-b"]
            side.start("rest-b", "rest", ["--gateway-address", gateway_b.address, "--image-store", str(images),
                                          "--url-secret-file", str(jobs_dir / "url-secret")])
            front_b = f"http://{side.procs['rest-b'].address}"

            fronts = (front_a, front_b)
            specs = {client.submit(fronts[i % 2], body(10 * i, 1 + (i % 4 == 0), STEPS, SIZE)): 1 + (i % 4 == 0)
                     for i in range(JOBS)}
            # One store behind both: each front lists every job, whichever front accepted it.
            assert set(client.jobs(front_a)) == set(client.jobs(front_b)) == set(specs)

            def mid_way() -> bool:
                view = read_postgres(dsn)
                return (view.statuses()["completed"] >= 8
                        and any(r.denoising and r.owner_pid() == gateway_b.pid for r in view.jobs.values()))

            until(mid_way, 90, "jobs done, and the second gateway denoising one of its own", step=0.2)
            side.kill("rest-b", signal.SIGKILL)
            side.kill("gateway-b", signal.SIGKILL)
            at_kill = read_postgres(dsn)
            held = {i for i, r in at_kill.jobs.items() if r.status == "in_progress" and r.owner_pid() == gateway_b.pid}
            assert held and at_kill.statuses()["completed"] < JOBS, at_kill.statuses()

            jobs = client.wait_all_completed(lambda: front_a, specs, 120)
            for job_id, job in jobs.items():
                urls = [item["url"] for item in job["result"]["data"]]
                assert len(urls) == specs[job_id] == job["n"], job
                for url in urls:
                    r = client.get(url)
                    assert r.status_code == 200 and r.content.startswith(b"\x89PNG"), (url, r.status_code)
            # The survivor took the dead gateway's jobs over once their leases ran out.
            takeovers = sample(addr["gateway-metrics"], "glmimage_job_takeovers_total")
            assert takeovers is not None and takeovers >= len(held), (takeovers, held)
        finally:
            side.close()
    assert stack.proc.returncode == 0, stack.log_tail()

    view = read_postgres(dsn)
    assert_recorded_once(view, specs, images)
    assert {i: r.n for i, r in view.jobs.items()} == specs
    for job_id in held:  # killed under its runner: run again by the survivor
        assert view.jobs[job_id].attempts >= 2, view.jobs[job_id]
    assert client.sent["POST"] == JOBS, client.sent
