"""`--tenants FILE` on the REST front: the tenants' keys are the front's own check (an unknown or missing key 401, the
key forwarded so the gateway resolves the tenant), an admin tenant sees the live pool page's data and a user tenant
does not; with --api-key/--admin-key it is a start-up error, and so is a bad file (its line and field named, no
traceback, exit status non-zero); SIGHUP reloads it in a running front without failing a request.
"""
from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from rest import __main__ as rest_main
from rest.app import RestSettings, create_app
from runtime.tenants import TenantsError
from tests.support.fake_gateway import FakeServer
from tests.support.rest_gateway import asgi_client
from tests.support.rest_tenants import front_process, run_front, serve_tenants_fake, tenants_toml
from tests.support.waiting import until

TENANTS = {
    "alpha": {"keys": ["sk-alpha-1"], "weight": 1, "max_priority": "interactive"},
    "beta": {"keys": ["sk-beta-1"], "weight": 2, "requests_per_minute": 30},
    "ops": {"keys": ["sk-ops-1"], "role": "admin"},
}
GENERATIONS = "/v1/images/generations"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def gateway() -> Iterator[FakeServer]:
    with serve_tenants_fake() as server:
        yield server


@pytest.fixture
def tenants_file(tmp_path: Path) -> Path:
    path = tmp_path / "tenants.toml"
    path.write_text(tenants_toml(TENANTS))
    return path


# --- the front's own check -----------------------------------------------------------------------------------


async def test_a_tenant_s_key_is_let_in_and_forwarded_an_unknown_one_is_401(gateway: FakeServer,
                                                                            tenants_file: Path) -> None:
    gateway.servicer.reset()
    app = create_app(RestSettings(gateway_address=gateway.address, tenants_file=tenants_file))
    async with app.router.lifespan_context(app), asgi_client(app) as client:
        for key in ("sk-alpha-1", "sk-beta-1", "sk-ops-1"):  # an admin tenant may generate too
            resp = await client.post(GENERATIONS, json={"prompt": "x"}, headers=bearer(key))
            assert resp.status_code == 200, resp.text
        for headers in (bearer("sk-gamma-1"), {}, {"Authorization": "Basic c2stYWxwaGEtMQ=="},
                        bearer("sk-alpha")):  # unknown, missing, not Bearer, a prefix of a key
            resp = await client.post(GENERATIONS, json={"prompt": "x"}, headers=headers)
            assert resp.status_code == 401, headers
            assert resp.json()["error"]["code"] == "invalid_api_key"
    calls = [c for c in gateway.servicer.calls if c.method == "GenerateImages"]
    # Forwarded as the client sent it: the gateway resolves the tenant from the same file.
    assert [c.metadata["authorization"] for c in calls] == ["Bearer sk-alpha-1", "Bearer sk-beta-1", "Bearer sk-ops-1"]


async def test_an_admin_tenant_sees_the_pool_a_user_tenant_does_not(gateway: FakeServer, tenants_file: Path) -> None:
    gateway.servicer.reset()
    app = create_app(RestSettings(gateway_address=gateway.address, tenants_file=tenants_file))
    async with app.router.lifespan_context(app), asgi_client(app) as client:
        assert (await client.get("/status")).status_code == 200  # the page itself holds no data
        assert (await client.get("/status/data")).status_code == 401
        assert (await client.get("/status/data", headers=bearer("sk-nobody"))).status_code == 401
        user = await client.get("/status/data", headers=bearer("sk-alpha-1"))
        assert user.status_code == 403 and user.json()["error"]["code"] == "admin_key_required"
        assert "GetStatus" not in gateway.servicer.methods()  # refused before any gateway call
        admin = await client.get("/status/data", headers=bearer("sk-ops-1"))
        assert admin.status_code == 200, admin.text
    (status,) = admin.json()["gateways"]
    alpha, ops = status["tenants"]
    assert alpha == {"name": "alpha", "weight": 1.0, "queued_ar": 2, "queued_denoise": 5, "active": 3,
                     "inflight_images": 4, "max_inflight_images": 8, "oldest_wait_s": 7.25, "requests_total": 41,
                     "images_total": 97, "requests_per_minute": {"limit": 30, "remaining": 27},
                     "images_per_minute": {"limit": 60, "remaining": 52}}
    assert ops["requests_per_minute"] is None and ops["max_inflight_images"] is None  # no quota
    (call,) = [c for c in gateway.servicer.calls if c.method == "GetStatus"]
    assert call.metadata["authorization"] == "Bearer sk-ops-1"


async def test_a_bad_reload_keeps_the_tenants_in_force(gateway: FakeServer, tenants_file: Path) -> None:
    app = create_app(RestSettings(gateway_address=gateway.address, tenants_file=tenants_file))
    keys = app.state.keys
    tenants_file.write_text(tenants_toml({"alpha": {"keys": ["sk-alpha-1"], "weight": -1}}))
    assert keys.reload() is False
    assert keys.user(b"sk-beta-1")
    tenants_file.write_text(tenants_toml({"gamma": {"keys": ["sk-gamma-1"]}}))
    assert keys.reload() is True
    assert keys.user(b"sk-gamma-1") and not keys.user(b"sk-beta-1")


# --- start-up errors -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("flags", [["--api-key", "k"], ["--admin-key", "k"]])
def test_tenants_with_the_key_flags_is_a_usage_error(tenants_file: Path, flags: list[str],
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        rest_main.parse_args(["--tenants", str(tenants_file), *flags])
    assert info.value.code == 2
    assert "--tenants replaces --api-key and --admin-key" in capsys.readouterr().err


@pytest.mark.parametrize("variable", ["GLMIMAGE_API_KEYS", "GLMIMAGE_ADMIN_KEYS"])
def test_tenants_with_the_key_variables_is_a_usage_error(tenants_file: Path, variable: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(variable, "k1,k2")
    with pytest.raises(SystemExit):
        rest_main.parse_args(["--tenants", str(tenants_file)])


def test_tenants_and_own_gateway_auth_need_no_api_key(tenants_file: Path) -> None:
    args = rest_main.parse_args(["--tenants", str(tenants_file), "--gateway-auth", "own", "--gateway-api-key", "g"])
    assert rest_main.settings_from_args(args).tenants_file == tenants_file


BAD_FILES = [
    ('[tenants.alpha]\nkeys = ["sk-a"]\nweight = 0\n', ":3: tenants.alpha.weight:"),
    ('[tenants.alpha]\nkeys = ["sk-a"]\ncolour = "red"\n', ":3: tenants.alpha.colour: unknown field"),
    ('[tenants.alpha]\nkeys = ["sk-a"]\n\n[tenants.beta]\nkeys = ["sk-a"]\n', ":5: tenants.beta.keys:"),
    ("[tenants.alpha\n", ":1: not valid TOML"),
]


@pytest.mark.parametrize(("text", "said"), BAD_FILES, ids=["weight", "unknown field", "key twice", "toml"])
def test_a_bad_file_stops_the_front_naming_line_and_field(tmp_path: Path, text: str, said: str) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text(text)
    done = run_front("--tenants", str(path))
    assert done.returncode != 0
    assert f"{path}{said}" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_a_missing_file_stops_the_front(tmp_path: Path) -> None:
    done = run_front("--tenants", str(tmp_path / "absent.toml"))
    assert done.returncode != 0 and "cannot read the tenants file" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_bad_file_is_refused_in_process_too(tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text(BAD_FILES[0][0])
    with pytest.raises(TenantsError, match="tenants.alpha.weight"):
        create_app(RestSettings(tenants_file=path))


# --- SIGHUP in a running front ------------------------------------------------------------------------------


def test_sighup_reloads_the_file_without_failing_a_request(gateway: FakeServer, tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    # `steady` is in both files: its requests run throughout the reload and must all be answered 200.
    before = {"steady": {"keys": ["sk-steady"]}, "alpha": {"keys": ["sk-alpha-1"]}}
    after = {"steady": {"keys": ["sk-steady"]}, "beta": {"keys": ["sk-beta-1"]}}
    path.write_text(tenants_toml(before))
    with front_process(tmp_path, "--gateway-address", gateway.address, "--tenants", str(path),
                       "--log-level", "info") as front, httpx.Client(base_url=front.base_url, timeout=30) as http:

        def status(key: str) -> int:
            return http.post(GENERATIONS, json={"prompt": "x"}, headers=bearer(key)).status_code

        assert (status("sk-alpha-1"), status("sk-beta-1")) == (200, 401)
        stop, answers = threading.Event(), []

        def steady() -> None:
            with httpx.Client(base_url=front.base_url, timeout=30) as own:
                while not stop.is_set():
                    answers.append(own.post(GENERATIONS, json={"prompt": "x"}, headers=bearer("sk-steady"))
                                   .status_code)

        worker = threading.Thread(target=steady, daemon=True)
        worker.start()
        until(lambda: len(answers) >= 3, 30, "requests in flight before the reload")
        path.write_text(tenants_toml(after))
        front.signal(signal.SIGHUP)
        until(lambda: status("sk-beta-1") == 200, 30, "the reloaded file to let beta in")
        assert status("sk-alpha-1") == 401  # a removed key is refused from then on
        seen = len(answers)
        until(lambda: len(answers) >= seen + 3, 30, "requests after the reload")
        stop.set()
        worker.join(30)
        assert answers and set(answers) == {200}, answers
    assert "tenants reloaded" in front.log.read_text()
