"""The live pool page (`GET /status`, rest/status_page.py) in a real headless Chromium (Debian's chromium
and chromedriver, which `make tools` installs) over a real stack: it loads, shows every worker, and shows a denoiser
busy soon after a request starts; who may see its data when keys are configured; and its tenants table, over a
scripted gateway and a real front with --tenants."""
from __future__ import annotations

import os
import re
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from rest.app import RestSettings, create_app
from tests.support.cluster import running_stack
from tests.support.fake_gateway import FakeServer
from tests.support.rest_gateway import asgi_client
from tests.support.rest_tenants import front_process, serve_tenants_fake, tenants_toml
from tests.support.waiting import until as _until

# The page polls twice a second, so a busy denoiser shows within about a second of its job starting; the bound
# leaves 3x and more for a loaded machine (the page's own cadence is the design figure).
BUSY_WITHIN_S = 6.0
SCREENSHOT = Path(__file__).resolve().parents[1] / "docs" / "images" / "status-page.png"


@pytest.fixture(scope="module")
def stack(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    with running_stack(tmp_path_factory.mktemp("status-stack")) as run:
        yield run.addresses


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver is None:
        pytest.fail("chromium and chromedriver not found: `make tools` installs Debian's chromium and chromium-driver")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1200,900"):
        options.add_argument(arg)
    drv = webdriver.Chrome(service=Service(driver), options=options)
    try:
        yield drv
    finally:
        drv.quit()


def _rows(browser, role: str) -> list[dict[str, str]]:
    # Read in one script: the page redraws twice a second, so elements found one by one may go stale in between.
    return browser.execute_script(
        "return [...document.querySelectorAll('table.workers tr.worker.' + arguments[0])]"
        ".map(r => ({state: r.dataset.state, job: r.querySelector('td.job').textContent}))", role)


def _shown(browser) -> str:
    return browser.execute_script("return document.getElementById('gateways').innerText")


def test_the_page_shows_every_worker_and_a_busy_denoiser_soon_after_a_request_starts(browser, stack) -> None:
    browser.get(f"http://{stack['rest']}/status")
    _until(lambda: len(_rows(browser, "denoiser")) == 2 and len(_rows(browser, "ar")) == 1, 30,
           "the page to list the AR and both denoisers")
    assert {r["state"] for r in _rows(browser, "denoiser")} == {"available"}
    assert "(hidden)" not in _shown(browser)  # no keys configured: the gateway shows addresses to everyone

    done = threading.Event()

    def long_request() -> None:  # 300 steps at 512x512: still running while the page is checked
        try:
            httpx.post(f"http://{stack['rest']}/v1/images/generations", timeout=300,
                       json={"prompt": "a slow one", "size": "512x512", "num_inference_steps": 200})
        finally:
            done.set()

    thread = threading.Thread(target=long_request, daemon=True)
    thread.start()
    took = _until(lambda: any(r["state"] == "busy" and r["job"] for r in _rows(browser, "denoiser")) or done.is_set(),
                  BUSY_WITHIN_S + 60, "a busy denoiser on the page")
    assert not done.is_set(), "the request ended before the page showed it running"
    assert took < BUSY_WITHIN_S + 30  # reached through the AR first; the busy row itself is checked below
    busy = [r for r in _rows(browser, "denoiser") if r["state"] == "busy"]
    assert busy and busy[0]["job"].count("/") == 1 and "#" in busy[0]["job"]  # request id/output#attempt
    assert "a slow one" not in _shown(browser)  # never the prompt

    def step() -> int | None:  # the step the page shows for the running job, from the denoiser's occupancy stream
        found = [re.search(r"\(step (\d+) of 200\)", r["job"]) for r in _rows(browser, "denoiser")]
        return next((int(m.group(1)) for m in found if m), None)

    _until(lambda: step() is not None or done.is_set(), 60, "the page to show the job's step")
    first = step()
    assert first is not None, "the request ended before the page showed its step"
    _until(lambda: (step() or 0) > first or done.is_set(), 60, "the step to move on")
    assert (step() or 0) > first
    if os.environ.get("GLMIMAGE_SCREENSHOTS"):  # `GLMIMAGE_SCREENSHOTS=1 pytest tests/test_status_page.py`
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        browser.save_screenshot(str(SCREENSHOT))
    thread.join(300)


def test_a_denoiser_shows_busy_within_the_bound_of_its_job_starting(browser, stack) -> None:
    """Timed from the moment the gateway itself reports the job (its GetStatus), not from the request: the AR's
    time before it is not the page's."""
    import grpc

    from glmimage.v1 import gateway_service_pb2 as pb
    from glmimage.v1 import gateway_service_pb2_grpc as pb_grpc

    browser.get(f"http://{stack['rest']}/status")
    _until(lambda: len(_rows(browser, "denoiser")) == 2, 30, "the page")
    thread = threading.Thread(target=lambda: httpx.post(
        f"http://{stack['rest']}/v1/images/generations", timeout=300,
        json={"prompt": "slow", "size": "512x512", "num_inference_steps": 200}), daemon=True)
    thread.start()
    with grpc.insecure_channel(stack["gateway"]) as channel:
        stub = pb_grpc.GatewayServiceStub(channel)
        _until(lambda: any(w.current_job for w in stub.GetStatus(pb.GetStatusRequest(), timeout=10).workers), 120,
               "the gateway to run a denoise job")
    took = _until(lambda: any(r["state"] == "busy" and r["job"] for r in _rows(browser, "denoiser")), BUSY_WITHIN_S,
                  "the page to show the running job")
    assert took < BUSY_WITHIN_S
    thread.join(300)


# ---- who may see the data -------------------------------------------------------------------------------------


async def test_with_keys_only_an_admin_key_gets_the_data(fake: FakeServer) -> None:
    settings = RestSettings(gateway_address=fake.address, api_keys=("user-key",), admin_keys=("admin-key",))
    app = create_app(settings)
    async with app.router.lifespan_context(app), asgi_client(app) as client:
        assert (await client.get("/status")).status_code == 200  # the page itself holds no data
        assert (await client.get("/status/data")).status_code == 401
        user = await client.get("/status/data", headers={"Authorization": "Bearer user-key"})
        assert user.status_code == 403 and user.json()["error"]["code"] == "admin_key_required"
        assert "GetStatus" not in fake.servicer.methods()  # refused before any gateway call
        admin = await client.get("/status/data", headers={"Authorization": "Bearer admin-key"})
        assert admin.status_code == 200, admin.text
        (gateway,) = admin.json()["gateways"]
        assert gateway["queues"] == {"ar_requests": 1, "ar_outputs": 2, "denoise_outputs": 3}
        assert gateway["workers"][0]["role"] == "ar"
        assert all(w["loras"] == [] for w in gateway["workers"])  # the adapters each denoiser holds (none here)
        call = next(c for c in fake.servicer.calls if c.method == "GetStatus")
        assert call.metadata.get("authorization") == "Bearer admin-key"  # the gateway sees the admin's credential


async def test_with_separate_keys_per_hop_the_gateway_sees_the_front_s_key(fake: FakeServer) -> None:
    fake.servicer.reset()
    settings = RestSettings(gateway_address=fake.address, api_keys=("user-key", "admin-key"), admin_keys=("admin-key",),
                            gateway_auth="own", gateway_api_key="front-key")
    app = create_app(settings)
    async with app.router.lifespan_context(app), asgi_client(app) as client:
        admin = await client.get("/status/data", headers={"Authorization": "Bearer admin-key"})
        assert admin.status_code == 200, admin.text
    call = next(c for c in fake.servicer.calls if c.method == "GetStatus")
    assert call.metadata.get("authorization") == "Bearer front-key"  # the client's key stays at the front


# ---- the tenants table ----------------------------------------------------------------------------------------


def _tenant_rows(browser) -> dict[str, dict[str, str]]:
    return browser.execute_script(
        "return Object.fromEntries([...document.querySelectorAll('table.tenants tr.tenant')].map(r => [r.dataset.name,"
        " Object.fromEntries([...r.cells].map(c => [c.className, c.textContent]))]))")


def test_an_admin_tenant_sees_each_tenant_s_share_and_quotas(browser, tmp_path: Path) -> None:
    """Over a scripted gateway whose GetStatus reports two tenants, through a real `python -m rest
    --tenants`: the page asks for a key, refuses a user tenant's and shows the table to an admin tenant's."""
    from selenium.webdriver.common.by import By

    tenants = tmp_path / "tenants.toml"
    tenants.write_text(tenants_toml({"alpha": {"keys": ["sk-alpha-1"]}, "ops": {"keys": ["sk-ops-1"],
                                                                                "role": "admin"}}))
    with serve_tenants_fake() as gateway, front_process(tmp_path, "--gateway-address", gateway.address, "--tenants",
                                                        str(tenants)) as front:
        browser.get(f"{front.base_url}/status")
        key_form = browser.find_element(By.ID, "key")
        _until(key_form.is_displayed, 10, "the page to ask for a key")

        def enter(key: str) -> None:
            field = browser.find_element(By.ID, "keyinput")
            field.clear()
            field.send_keys(key)
            browser.find_element(By.CSS_SELECTOR, "#key button").click()

        enter("sk-alpha-1")  # a user tenant's key: refused (403), no data shown
        _until(lambda: browser.find_element(By.ID, "error").text.startswith("An admin key"), 10, "the refusal")
        assert _tenant_rows(browser) == {}
        enter("sk-ops-1")
        _until(lambda: len(_tenant_rows(browser)) == 2, 10, "the tenants table")
        rows = _tenant_rows(browser)
        alpha = rows["alpha"]
        assert (alpha["queued-ar"], alpha["queued-denoise"], alpha["active"]) == ("2", "5", "3")
        assert alpha["inflight"] == "4 of 8" and alpha["wait"] == "7.3 s"
        assert (alpha["requests"], alpha["images"]) == ("41", "97")
        assert alpha["rpm"] == "27 of 30 left" and alpha["ipm"] == "52 of 60 left"
        assert rows["ops"]["weight"] == "2" and rows["ops"]["rpm"] == "-" and rows["ops"]["inflight"] == "0"
        assert len(_rows(browser, "ar")) == 1  # the workers' table is still there
