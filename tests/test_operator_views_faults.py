"""The operator views when what they read from is sick (issue 24): the live pool page in front of a hung (SIGSTOPped)
gateway. (Traces sent to an OTLP collector that is down: tests/test_e2e.py runs the whole `make run` stack so.)"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from rest.app import RestSettings, create_app
from tests.support.cluster import Cluster
from tests.support.rest_gateway import asgi_client

pytestmark = pytest.mark.e2e


async def test_the_pool_page_answers_in_front_of_a_hung_gateway_and_recovers_when_it_does(tmp_path: Path) -> None:
    procs = Cluster(tmp_path / "procs")
    try:
        # A real gateway process (its workers need not exist: GetStatus lists them as unreachable).
        gateway = procs.start("gateway", "gateway", ["--ar", "127.0.0.1:1", "--denoiser", "127.0.0.1:2"])
        settings = RestSettings(gateway_address=gateway.address, health_timeout=1.0)
        app = create_app(settings)
        async with app.router.lifespan_context(app), asgi_client(app) as client:
            healthy = (await client.get("/status/data")).json()["gateways"][0]
            assert [w["role"] for w in healthy["workers"]] == ["ar", "denoiser"]
            os.kill(gateway.pid, signal.SIGSTOP)  # hung: the socket accepts, nothing answers
            try:
                # Answered, and by its own timeout: DEADLINE_EXCEEDED is what the page's 1 s deadline on GetStatus
                # says (the guard only stops a hang from stalling the suite; it is not a bound on the answer).
                async with asyncio.timeout(60):
                    hung = await client.get("/status/data")
                assert hung.status_code == 200, hung.text
                assert hung.json()["gateways"] == [{"gateway": 0, "error": "DEADLINE_EXCEEDED"}]
                page = await client.get("/status")
                assert page.status_code == 200 and "GLM-Image pool" in page.text  # the page itself needs no gateway
            finally:
                os.kill(gateway.pid, signal.SIGCONT)
            back = (await client.get("/status/data")).json()["gateways"][0]
            assert [w["role"] for w in back["workers"]] == ["ar", "denoiser"]
    finally:
        procs.close()
