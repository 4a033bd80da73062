"""Issue 30's done-when for a reload: SIGHUP to the launcher (which forwards it to the gateway and the REST front)
under a steady load of one tenant fails none of its requests, and a key removed from the file is refused from then
on, over gRPC and REST; a bad file on a later SIGHUP is refused, the tenants in force stay and the log names the
line and field. At start-up a bad file stops the gateway and the REST front with that one line, no traceback."""
from __future__ import annotations

import concurrent.futures as cf
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from glmimage.v1 import gateway_service_pb2 as pb
from tests.support.rest_tenants import tenants_toml
from tests.support.tenants_stack import GENERATIONS, bearer, request, rest_body, tenant_stack, write_tenants
from tests.support.waiting import until

STAYING, LEAVING = "sk-staying-1", "sk-leaving-1"
BEFORE = {"staying": {"keys": [STAYING], "weight": 1}, "leaving": {"keys": [LEAVING], "weight": 1}}
AFTER = {"staying": {"keys": [STAYING], "weight": 1}}
BAD = {"staying": {"keys": [STAYING], "weight": 0}}  # weight must be above 0
NOT_RELOADED = "tenants file not reloaded"  # the reload's error line (runtime.tenants)
QUICK = 2  # steps: the load is many short requests
LONG = 200  # steps of leaving's request that runs across the reload (the most a request may ask)
ROOT = Path(__file__).resolve().parents[1]


class Load:
    """Tenant `staying` asking without pause, over gRPC and over REST, each answer recorded, until stopped."""

    def __init__(self, calls: list[Callable[[int], None]]) -> None:
        self.stop = threading.Event()
        self.answers: list[str] = []  # "ok", or what went wrong
        self._pool = cf.ThreadPoolExecutor(len(calls))
        self._loops = [self._pool.submit(self._loop, call) for call in calls]

    def _loop(self, call: Callable[[int], None]) -> None:
        i = 0
        while not self.stop.is_set():
            try:
                call(i)
                self.answers.append("ok")
            except Exception as exc:  # recorded, not raised: every failure counts, not the first
                self.answers.append(repr(exc)[:300])
            i += 1

    def more(self, count: int, what: str) -> None:
        """Wait until ``count`` more answers came back (the load goes on meanwhile)."""
        seen = len(self.answers)
        until(lambda: len(self.answers) >= seen + count, 60, f"{count} answers {what}", step=0.05)

    def end(self) -> list[str]:
        self.stop.set()
        for loop in self._loops:
            loop.result(timeout=120)
        self._pool.shutdown()
        return self.answers


@pytest.mark.e2e
def test_sighup_under_load_fails_nothing_and_a_removed_key_is_refused_from_then_on(tiny_checkpoint: Path,
                                                                                   tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    write_tenants(path, BEFORE)
    with tenant_stack(tmp_path, path, denoisers=1) as stack, stack.rest() as http:
        stub = stack.stub()

        def grpc_call(i: int) -> None:
            reply = stub.GenerateImages(request("steady", seed=i, steps=QUICK), metadata=bearer(STAYING), timeout=60)
            assert len(reply.images) == 1

        def rest_call(i: int) -> None:
            resp = http.post(GENERATIONS, json=rest_body("steady", seed=i, steps=QUICK), headers=_auth(STAYING))
            assert resp.status_code == 200, resp.text

        def refused() -> tuple[grpc.StatusCode | None, int]:
            """How the removed tenant's key fares now, over gRPC and REST (None: gRPC admitted it)."""
            code = None
            try:
                stub.GenerateImages(request("still here?", steps=QUICK), metadata=bearer(LEAVING), timeout=60)
            except grpc.RpcError as exc:
                code = exc.code()
            resp = http.post(GENERATIONS, json=rest_body("still here?", steps=QUICK), headers=_auth(LEAVING))
            return code, resp.status_code

        assert refused() == (None, 200)  # both keys let in before the reload
        load = Load([grpc_call, rest_call])
        try:
            load.more(4, "before the reload")
            # Leaving's own request runs across the reload: it keeps the tenant it was admitted under.
            across = stub.GenerateImages.future(request("across the reload", steps=LONG), metadata=bearer(LEAVING),
                                                timeout=120)
            until(lambda: _active(stub, LEAVING) >= 1 or across.done(), 30, "leaving's request to be admitted")
            write_tenants(path, AFTER)
            stack.hangup()
            until(lambda: refused() == (grpc.StatusCode.UNAUTHENTICATED, 401), 30, "the removed key to be refused",
                  step=0.1)
            assert len(across.result().images) == 1
            load.more(4, "after the reload")
            assert refused() == (grpc.StatusCode.UNAUTHENTICATED, 401)  # and it stays refused

            # A bad file on the next SIGHUP: refused, the file in force (without `leaving`) stays.
            path.write_text(tenants_toml(BAD))
            line = 1 + tenants_toml(BAD).splitlines().index("weight = 0")
            stack.hangup()
            # One line each from the two processes that read the file: the gateway and the REST front.
            until(lambda: len(_lines(stack.log_text(), NOT_RELOADED)) >= 2, 30, "the bad reload to be logged")
            load.more(4, "after the bad file")
            assert refused() == (grpc.StatusCode.UNAUTHENTICATED, 401)
        finally:
            answers = load.end()
        lines = _lines(stack.log_text(), NOT_RELOADED)
    failed = [a for a in answers if a != "ok"]
    print(f"{len(answers)} requests of `staying` across two reloads")
    assert not failed, f"{len(failed)} of {len(answers)} requests of `staying` failed: {failed[:3]}"
    assert len(lines) == 2 and all(f"{path}:{line}: tenants.staying.weight:" in ln for ln in lines), lines
    assert "Traceback" not in stack.log_text()


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _active(stub, key: str) -> int:
    return sum(t.active_requests for t in stub.GetStatus(pb.GetStatusRequest(), metadata=bearer(key), timeout=10)
               .tenants)


def _lines(text: str, needle: str) -> list[str]:
    return [ln for ln in text.splitlines() if needle in ln]


# The three bad files: the line and the field each names.
BAD_FILES = {
    "unknown field": ('[tenants.alpha]\nkeys = ["sk-a"]\ncolour = "red"\n', 3, "tenants.alpha.colour"),
    "key in two tenants": ('[tenants.alpha]\nkeys = ["sk-a"]\n\n[tenants.beta]\nweight = 2\nkeys = ["sk-a"]\n', 6,
                           "tenants.beta.keys"),
    "weight 0": ('[tenants.alpha]\nkeys = ["sk-a"]\nweight = 0\n', 3, "tenants.alpha.weight"),
    "weight below 0": ('[tenants.alpha]\nweight = -1\nkeys = ["sk-a"]\n', 2, "tenants.alpha.weight"),
}


def test_a_bad_file_stops_the_gateway_and_the_rest_front_with_one_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GLMIMAGE_")}
    runs = {}
    # All at once: each is a fresh interpreter importing grpc (and FastAPI), most of what they take.
    for name, (text, _, _) in BAD_FILES.items():
        path = tmp_path / f"{name.replace(' ', '-')}.toml"
        path.write_text(text)
        for module in ("gateway", "rest"):
            runs[name, module] = (path, subprocess.Popen(
                [sys.executable, "-m", module, "--tenants", str(path), "--port", "0"], cwd=ROOT, env=env,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for (name, module), (path, proc) in runs.items():
        out, err = proc.communicate(timeout=120)
        _, line, field = BAD_FILES[name]
        where = f"{module}, {name}"
        assert proc.returncode != 0, where
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, (where, err)
        assert f"{path}:{line}: {field}:" in err, (where, err)
        assert out == "", (where, out)
