"""The REST front's image files route (rest/files.py) on the front's real app (create_app) over a real disk
image store: served at a signed URL without a key, 403 for an expired or tampered URL, 404 for another tenant's
key and for a missing object, path traversal refused without opening anything outside the store's root."""
from __future__ import annotations

import base64
import hashlib
import hmac
import os
import time
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
from fastapi import FastAPI

from gateway.jobs.images import DiskImageStore, S3ImageStore
from gateway.jobs.urls import FILES_PATH, UrlSigner, object_key
from rest.app import RestSettings, create_app
from rest.files import IMAGE_STORE_STATE, URL_SIGNER_STATE, caller_tenant
from tests.support.rest_gateway import asgi_client
from tests.support.rest_tenants import tenants_toml

SECRET = b"files-route-test-secret-32-bytes"
TENANTS = {"alpha": {"keys": ["sk-alpha-1"]}, "beta": {"keys": ["sk-beta-1"]},
           "ops": {"keys": ["sk-ops-1"], "role": "admin"}}
PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4


def files_app(root: Path, signer: UrlSigner, **settings: Any) -> tuple[FastAPI, DiskImageStore]:
    """The front's app serving the disk store at ``root`` with the links' secret from a file, as `--image-store` and
    `--url-secret-file` give them. No lifespan: the route needs no gateway."""
    secret_file = root.parent / f"{root.name}.url-secret"
    secret_file.write_bytes(SECRET + b"\n")
    app = create_app(RestSettings(gateway_address="127.0.0.1:9", image_store=root, url_secret_file=secret_file,
                                  **settings))
    store = getattr(app.state, IMAGE_STORE_STATE)
    assert isinstance(store, DiskImageStore) and store.root == root
    assert getattr(app.state, URL_SIGNER_STATE).verify(*_signed(signer, object_key("a", "png")), time.time())
    return app, store


def _signed(signer: UrlSigner, key: str) -> tuple[str, str, str]:
    url, _ = signer.sign(key, time.time())
    q = {k: v[0] for k, v in parse_qs(urlsplit(url).query).items()}
    return key, q["expires"], q["signature"]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def forge(key: str, expires: int) -> str:
    mac = hmac.new(SECRET, f"{key}\n{expires}".encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(mac).rstrip(b"=").decode()


def error_of(resp: httpx.Response) -> dict[str, Any]:
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


@pytest.fixture
def signer() -> UrlSigner:
    return UrlSigner(SECRET, ttl=3600)


async def test_served_at_its_signed_url_without_a_key(tmp_path: Path, signer: UrlSigner) -> None:
    app, store = files_app(tmp_path, signer)
    key = object_key("default", "png")
    await store.put(key, PNG, "image/png")
    url, expires = store.url(key, time.time())
    async with asgi_client(app) as client:
        resp = await client.get(url)
        head = await client.head(url)
    assert resp.status_code == 200 and resp.content == PNG
    assert resp.headers["content-type"] == "image/png"
    assert resp.headers["content-length"] == str(len(PNG))
    assert resp.headers["x-content-type-options"] == "nosniff"
    kind, max_age = resp.headers["cache-control"].split(", max-age=")
    assert kind == "private" and 3590 <= int(max_age) <= 3600
    assert head.status_code == 200 and head.content == b""
    assert head.headers["content-length"] == str(len(PNG)) and head.headers["content-type"] == "image/png"
    assert head.headers["cache-control"].startswith("private, max-age=")
    # Cached no longer than the URL is good for: one near its end says so.
    soon, _ = store.url(key, time.time(), not_after=time.time() + 30)
    async with asgi_client(app) as client:
        assert int((await client.get(soon)).headers["cache-control"].rpartition("=")[2]) <= 30


async def test_each_format_and_a_large_image(tmp_path: Path, signer: UrlSigner) -> None:
    app, store = files_app(tmp_path, signer)
    big = os.urandom(3 * 1024 * 1024 + 17)  # several of the route's read chunks
    async with asgi_client(app) as client:
        for ext, media in (("png", "image/png"), ("jpeg", "image/jpeg"), ("webp", "image/webp")):
            key = object_key("default", ext)
            await store.put(key, big, media)
            resp = await client.get(store.url(key, time.time())[0])
            assert resp.status_code == 200 and resp.headers["content-type"] == media
            assert resp.content == big


async def test_an_expired_url_is_403(tmp_path: Path, signer: UrlSigner) -> None:
    app, store = files_app(tmp_path, signer)
    key = object_key("default", "png")
    await store.put(key, PNG, "image/png")
    url, expires = store.url(key, time.time() - 7200)  # signed two hours ago, good for one
    assert expires < time.time()
    async with asgi_client(app) as client:
        resp = await client.get(url)
        head = await client.head(url)
    assert resp.status_code == 403 and head.status_code == 403
    assert error_of(resp) == {"message": "this image URL has expired; get a fresh one from the job or request it "
                              "again", "type": "invalid_request_error", "param": None, "code": "url_expired"}


async def test_a_missing_or_tampered_signature_is_403(tmp_path: Path, signer: UrlSigner) -> None:
    app, store = files_app(tmp_path, signer)
    key, other = object_key("default", "png"), object_key("default", "png")
    await store.put(key, PNG, "image/png")
    await store.put(other, b"the other image", "image/png")
    url, expires = store.url(key, time.time())
    q = {k: v[0] for k, v in parse_qs(urlsplit(url).query).items()}
    sig = q["signature"]
    flipped = ("A" if sig[5] != "A" else "B").join((sig[:5], sig[6:]))
    attempts = [
        f"{FILES_PATH}{key}",
        f"{FILES_PATH}{key}?expires={expires}",
        f"{FILES_PATH}{key}?signature={sig}",
        f"{FILES_PATH}{key}?expires={expires}&signature={flipped}",
        f"{FILES_PATH}{key}?expires={expires + 86400}&signature={sig}",  # a later expiry
        f"{FILES_PATH}{other}?expires={expires}&signature={sig}",  # another object with this one's signature
        f"{FILES_PATH}{key}?expires=+{expires}&signature={sig}",
        f"{FILES_PATH}{key}?expires={expires}.0&signature={sig}",
        f"{FILES_PATH}{key}?expires={expires}&signature={sig}%3D",
        f"{FILES_PATH}{key}?expires=&signature=",
    ]
    async with asgi_client(app) as client:
        for attempt in attempts:
            resp = await client.get(attempt)
            assert resp.status_code == 403, (attempt, resp.text)
            assert resp.content != b"the other image"
            err = error_of(resp)
            assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", "invalid_signature", None)
        assert (await client.get(url)).status_code == 200  # the URL as signed still works


async def test_a_missing_object_is_404(tmp_path: Path, signer: UrlSigner) -> None:
    app, store = files_app(tmp_path, signer)
    key = object_key("default", "png")
    url, _ = store.url(key, time.time())  # signed, never stored (or already deleted)
    async with asgi_client(app) as client:
        resp = await client.get(url)
        head = await client.head(url)
        await store.put(key, PNG, "image/png")
        await store.delete([key])
        deleted = await client.get(url)
    assert resp.status_code == head.status_code == deleted.status_code == 404
    assert error_of(resp) == {"message": "no such image file", "type": "invalid_request_error", "param": None,
                              "code": "not_found"}
    assert deleted.json() == resp.json()


async def test_another_tenant_s_key_gets_404(tmp_path: Path, signer: UrlSigner) -> None:
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(tenants_toml(TENANTS))
    app, store = files_app(tmp_path / "images", signer, tenants_file=tenants)
    alpha = object_key("alpha", "png")
    await store.put(alpha, PNG, "image/png")
    url, _ = store.url(alpha, time.time())
    missing_url, _ = store.url(object_key("alpha", "png"), time.time())
    async with asgi_client(app) as client:
        own = await client.get(url, headers=bearer("sk-alpha-1"))
        other = await client.get(url, headers=bearer("sk-beta-1"))
        admin = await client.get(url, headers=bearer("sk-ops-1"))  # an admin is a tenant like any other here
        missing = await client.get(missing_url, headers=bearer("sk-alpha-1"))
        unknown = await client.get(url, headers=bearer("sk-gamma-1"))
        no_key = await client.get(url)
        not_bearer = await client.get(url, headers={"Authorization": "Basic c2stYWxwaGEtMQ=="})
    assert own.status_code == 200 and own.content == PNG
    # The signature is the capability: no key is needed, even on a front that checks keys.
    assert no_key.status_code == not_bearer.status_code == 200 and no_key.content == PNG
    assert other.status_code == admin.status_code == 404
    assert other.json() == missing.json(), "another tenant's image and no image at all must look the same"
    assert unknown.status_code == 401 and error_of(unknown)["code"] == "invalid_api_key"
    # The route's own reading of a key, as the front knows tenants (the front layer refuses an unknown key first).
    keys, settings = app.state.keys, app.state.settings
    assert [caller_tenant(keys, settings, k) for k in (b"sk-alpha-1", b"sk-ops-1", b"sk-gamma-1")] == \
        ["alpha", "ops", None]


async def test_flag_keys_are_the_default_and_admin_tenants(tmp_path: Path, signer: UrlSigner) -> None:
    app, store = files_app(tmp_path, signer, api_keys=("sk-user",), admin_keys=("sk-admin",))
    default, admin = object_key("default", "png"), object_key("admin", "png")
    for key in (default, admin):
        await store.put(key, key.encode(), "image/png")
    async with asgi_client(app) as client:
        user_own = await client.get(store.url(default, time.time())[0], headers=bearer("sk-user"))
        admin_own = await client.get(store.url(admin, time.time())[0], headers=bearer("sk-admin"))
        user_other = await client.get(store.url(admin, time.time())[0], headers=bearer("sk-user"))
        admin_other = await client.get(store.url(default, time.time())[0], headers=bearer("sk-admin"))
    assert (user_own.status_code, admin_own.status_code) == (200, 200)
    assert (user_other.status_code, admin_other.status_code) == (404, 404)
    assert caller_tenant(app.state.keys, app.state.settings, b"sk-nobody") is None


async def test_a_front_without_keys_takes_any_key_for_default(tmp_path: Path, signer: UrlSigner) -> None:
    app, store = files_app(tmp_path, signer)
    default, alpha = object_key("default", "png"), object_key("alpha", "png")
    for key in (default, alpha):
        await store.put(key, key.encode(), "image/png")
    async with asgi_client(app) as client:
        with_key = await client.get(store.url(default, time.time())[0], headers=bearer("sk-anything"))
        alpha_with_key = await client.get(store.url(alpha, time.time())[0], headers=bearer("sk-anything"))
        alpha_without = await client.get(store.url(alpha, time.time())[0])
    assert with_key.status_code == 200 and with_key.content == default.encode()
    assert alpha_with_key.status_code == 404
    assert alpha_without.status_code == 200 and alpha_without.content == alpha.encode()


async def test_no_disk_store_no_route(tmp_path: Path, signer: UrlSigner) -> None:
    app, store = files_app(tmp_path, signer)
    key = object_key("default", "png")
    await store.put(key, PNG, "image/png")
    url, _ = store.url(key, time.time())
    async with asgi_client(app) as client:
        unknown_path = await client.get("/v1/images/no-such-route")
        for configured in (None, S3ImageStore("some-bucket", "x", 3600, endpoint_url="http://127.0.0.1:9")):
            setattr(app.state, IMAGE_STORE_STATE, configured)  # S3 serves its own (presigned) URLs
            resp = await client.get(url)
            assert resp.status_code == 404 and resp.json() == unknown_path.json()
            assert (await client.head(url)).status_code == 404


async def _raw_get(app: FastAPI, path: str, query: bytes) -> tuple[int, bytes]:
    """One GET straight into the ASGI app, its path exactly as given (an HTTP client would remove dot segments)."""
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
             "path": path, "raw_path": path.encode("utf-8", "surrogateescape"), "query_string": query,
             "root_path": "", "headers": [(b"host", b"test")], "client": ("127.0.0.1", 1234),
             "server": ("test", 80)}
    await app(scope, receive, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


async def test_path_traversal_is_refused_without_reading_outside_the_root(
        tmp_path: Path, signer: UrlSigner, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "images"
    app, store = files_app(root, signer)
    secret = b"OUTSIDE THE STORE: must never be served"
    (tmp_path / "secret.png").write_bytes(secret)
    key = object_key("default", "png")
    await store.put(key, PNG, "image/png")  # the root and a real object exist
    tag, token, _ = key.split("/")
    outside = [str(tmp_path / "secret.png"), "../secret.png", f"{tag}/../../secret.png",
               f"{tag}/{token}/../../../secret.png", f"{tag}/{token}/../../../secret.png/../0.png"]
    opened: list[str] = []
    real_open = os.open

    def recording_open(path: Any, *args: Any, **kwargs: Any) -> int:
        opened.append(os.fsdecode(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", recording_open)
    expires = int(time.time()) + 600
    async with asgi_client(app) as client:
        for target in outside:
            # Signed with the real secret, as if it had leaked: the key's form is still checked first.
            query = f"expires={expires}&signature={forge(target, expires)}"
            status, body = await _raw_get(app, FILES_PATH + target, query.encode())
            assert status in (403, 404) and secret not in body, (target, status)
            status, body = await _raw_get(app, FILES_PATH.rstrip("/") + target, query.encode())
            assert status in (403, 404) and secret not in body, (target, status)
            for encoded in (target.replace("/", "%2F"), target.replace(".", "%2e"),
                            target.replace(".", "%2e").replace("/", "%2f"), target.replace(".", "%252e")):
                resp = await client.get(f"{FILES_PATH}{encoded}?{query}")
                assert resp.status_code in (403, 404) and secret not in resp.content, (encoded, resp.status_code)
        resp = await client.get(store.url(key, time.time())[0])
        assert resp.status_code == 200 and resp.content == PNG  # the route still serves what is inside
    monkeypatch.undo()
    outside_opens = [p for p in opened if not Path(p).resolve().is_relative_to(root.resolve())]
    assert outside_opens == [], "the route opened files outside the store's root"
    assert any(Path(p).resolve().is_relative_to(root.resolve()) for p in opened)
