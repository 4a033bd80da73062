"""Image storage for jobs and response_format=url answers (gateway/jobs/urls.py, gateway/jobs/images.py): the URL
signer, object keys and their validation, the disk store on a real directory and the S3 store against moto's S3
server (tests/support/s3_server.py) over real HTTP."""
from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import os
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import boto3
import httpx
import pytest

from gateway.jobs import images
from gateway.jobs.images import DiskImageStore, ImageStore, ImageStoreUnavailable, S3ImageStore, open_image_store
from gateway.jobs.urls import (
    FILES_PATH,
    UrlSigner,
    ensure_secret_file,
    load_url_secret,
    object_key,
    tenant_tag,
    tenant_tag_of_key,
)
from tests.support.net import free_port
from tests.support.s3_server import BUCKET, moto_s3

SECRET = b"0123456789abcdef0123456789abcdef"
REPO = Path(__file__).resolve().parents[1]


def query_of(url: str) -> dict[str, str]:
    return {k: v[0] for k, v in parse_qs(urlsplit(url).query).items()}


def forge(key: str, expires: int, secret: bytes = SECRET) -> str:
    """A signature made by hand, as an attacker holding the secret could: for keys sign() refuses to sign."""
    mac = hmac.new(secret, f"{key}\n{expires}".encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(mac).rstrip(b"=").decode()


# ---- the signer ------------------------------------------------------------------------------------------------


def test_signed_url_round_trip() -> None:
    signer = UrlSigner(SECRET, ttl=3600)
    key = object_key("alpha", "png")
    now = 1_700_000_000.7
    url, expires = signer.sign(key, now, not_after=now + 86400)
    assert expires == 1_700_003_600
    assert url.startswith(f"{FILES_PATH}{key}?")
    q = query_of(url)
    assert q["expires"] == str(expires) and len(q["signature"]) == 43 and "=" not in q["signature"]
    assert q["signature"] == forge(key, expires)  # the documented form: b64url(HMAC-SHA256("{key}\n{expires}"))
    assert signer.verify(key, q["expires"], q["signature"], now)
    assert signer.check(key, q["expires"], q["signature"], expires - 0.001) == "ok"
    # Another signer with the same secret (another process: a gateway signs, the REST front checks) agrees.
    assert UrlSigner(SECRET, ttl=60).verify(key, q["expires"], q["signature"], now)


def test_expiry_is_capped_by_the_object_and_ends_the_url() -> None:
    signer = UrlSigner(SECRET, ttl=3600)
    key = object_key("alpha", "webp")
    now = 1_700_000_000.0
    _, capped = signer.sign(key, now, not_after=now + 10.9)
    assert capped == 1_700_000_010  # rounded down: never past the object's own expiry
    _, uncapped = signer.sign(key, now, not_after=now + 99999)
    assert uncapped == 1_700_003_600
    _, no_cap = signer.sign(key, now)
    assert no_cap == 1_700_003_600
    url, expires = signer.sign(key, now, not_after=now + 10)
    q = query_of(url)
    assert signer.check(key, q["expires"], q["signature"], expires - 1) == "ok"
    assert signer.check(key, q["expires"], q["signature"], expires) == "expired"
    assert signer.check(key, q["expires"], q["signature"], expires + 10**6) == "expired"
    assert not signer.verify(key, q["expires"], q["signature"], expires)


def test_tampering_is_refused() -> None:
    signer = UrlSigner(SECRET, ttl=3600)
    key = object_key("alpha", "png")
    now = 1_700_000_000.0
    url, expires = signer.sign(key, now)
    sig = query_of(url)["signature"]
    other_key = object_key("alpha", "png")
    assert signer.check(other_key, str(expires), sig, now) == "invalid"
    assert signer.check(key.replace("/0.png", "/1.png"), str(expires), sig, now) == "invalid"
    assert signer.check(key.replace(".png", ".webp"), str(expires), sig, now) == "invalid"
    assert signer.check(key, str(expires + 1), sig, now) == "invalid"  # a later expiry
    # An expired URL whose expiry was pushed back is "invalid", never "expired": a forgery learns nothing.
    assert signer.check(key, str(expires + 10), sig, expires + 5) == "invalid"
    flipped = ("A" if sig[0] != "A" else "B") + sig[1:]
    assert signer.check(key, str(expires), flipped, now) == "invalid"
    assert signer.check(key, str(expires), sig.swapcase(), now) == "invalid"
    assert UrlSigner(b"another secret, 32 bytes long!!!", 3600).check(key, str(expires), sig, now) == "invalid"


@pytest.mark.parametrize("expires", [None, "", "-1", "+1700003600", " 1700003600", "1700003600 ", "1700003600.0",
                                     "0x10", "01700003600", "9" * 13, "1" * 400, "١٧٠٠٠٠٣٦٠٠", "¹²³", "1e10"])
def test_malformed_expiry_is_refused(expires: str | None) -> None:
    signer = UrlSigner(SECRET, ttl=3600)
    key = object_key("alpha", "png")
    # Signed as the attacker would need it to be (where it has an integer meaning at all): still refused.
    try:
        as_int = int(expires)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        as_int = 1_700_003_600
    signature = forge(key, as_int)
    assert signer.check(key, expires, signature, 1_700_000_000.0) == "invalid"


def test_malformed_signature_or_key_is_refused() -> None:
    signer = UrlSigner(SECRET, ttl=3600)
    key = object_key("alpha", "png")
    url, expires = signer.sign(key, 1_700_000_000.0)
    sig = query_of(url)["signature"]
    now = 1_700_000_000.0
    for bad in (None, "", sig[:-1], sig + "A", sig + "=", sig[:-1] + "=", sig[:-1] + "é", "é" * 43, sig[:-1] + "+",
                sig[:-1] + "/", sig[:-1] + "\n", sig[:-1] + "\0", base64.b64encode(b"\xff" * 32).decode()):
        assert signer.check(key, str(expires), bad, now) == "invalid", bad
    for bad_key in ("", "../" + key, "/" + key, key + "/", key.upper(), key + "\n", 7, None):
        assert signer.check(bad_key, str(expires), forge(str(bad_key), expires), now) == "invalid"  # type: ignore
        with pytest.raises(ValueError):
            signer.sign(bad_key, now)  # type: ignore[arg-type]


def test_signer_refuses_weak_settings() -> None:
    with pytest.raises(ValueError, match="16 bytes"):
        UrlSigner(b"short", 3600)
    for ttl in (0, -1, float("nan")):
        with pytest.raises(ValueError):
            UrlSigner(SECRET, ttl)
    assert "0123" not in repr(UrlSigner(SECRET, 60))


def test_load_url_secret(tmp_path: Path) -> None:
    f = tmp_path / "secret"
    f.write_bytes(b"  file-secret-of-enough-bytes\n")
    env = {"GLMIMAGE_URL_SECRET": "env-secret-of-enough-bytes\n"}
    assert load_url_secret(f, env) == b"file-secret-of-enough-bytes"  # the file wins, whitespace stripped
    assert load_url_secret(None, env) == b"env-secret-of-enough-bytes"
    with pytest.raises(ValueError, match="--url-secret-file"):
        load_url_secret(None, {})
    with pytest.raises(ValueError, match="GLMIMAGE_URL_SECRET"):
        load_url_secret(None, {"GLMIMAGE_URL_SECRET": "short"})
    f.write_bytes(b"fifteen bytes..\n\n")
    with pytest.raises(ValueError, match="at least 16"):
        load_url_secret(f, env)
    with pytest.raises(FileNotFoundError):
        load_url_secret(tmp_path / "missing", env)


def test_ensure_secret_file(tmp_path: Path) -> None:
    path = tmp_path / "glmimage" / "url-secret"
    assert ensure_secret_file(path) == path
    first = path.read_bytes()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(first.strip()) == 64 and bytes.fromhex(first.strip().decode())
    assert ensure_secret_file(path) == path and path.read_bytes() == first  # never replaced
    assert len(load_url_secret(path, {})) == 64
    assert [p.name for p in path.parent.iterdir()] == ["url-secret"]


def test_ensure_secret_file_racing_processes(tmp_path: Path) -> None:
    path = tmp_path / "url-secret"
    go = tmp_path / "go"
    script = ("import sys, time, pathlib\nfrom gateway.jobs.urls import ensure_secret_file\n"
              "go = pathlib.Path(sys.argv[2])\nwhile not go.exists(): time.sleep(0.001)\n"
              "p = ensure_secret_file(pathlib.Path(sys.argv[1]))\nsys.stdout.write(p.read_text())\n")
    procs = [subprocess.Popen([sys.executable, "-c", script, str(path), str(go)], cwd=REPO, stdout=subprocess.PIPE,
                              text=True) for _ in range(6)]
    go.touch()  # all six wait for this, so they create the file at once
    seen = {p.communicate(timeout=60)[0] for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert seen == {path.read_text()}, "every racer must end up with the one secret that was written"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["go", "url-secret"]  # no temporary file left


# ---- keys ------------------------------------------------------------------------------------------------------


def test_object_keys() -> None:
    tag = hashlib.sha256(b"glmimage-tenant\0alpha").hexdigest()[:16]
    assert tenant_tag("alpha") == tag and tenant_tag("beta") != tag and len(tag) == 16
    key = object_key("alpha", "jpeg")
    t, token, name = key.split("/")
    assert t == tag and len(token) == 32 and name == "0.jpeg"
    assert object_key("alpha", "jpeg") != key  # a fresh token each time
    token = "ab" * 16
    assert object_key("alpha", "webp", token, 3) == f"{tag}/{token}/3.webp"
    assert tenant_tag_of_key(object_key("alpha", "png", token, 9999)) == tag
    for bad in ({"ext": "jpg"}, {"ext": "gif"}, {"ext": "png/.."}, {"ext": "png", "token": "AB" * 16},
                {"ext": "png", "token": "ab"}, {"ext": "png", "token": "../" + "a" * 29},
                {"ext": "png", "index": -1}, {"ext": "png", "index": 10000}, {"ext": "png", "index": True},
                {"ext": "png", "index": 1.0}):
        with pytest.raises(ValueError):
            object_key("alpha", **bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("key", [
    "", "a", "../etc/passwd", "/etc/passwd", "..", "./{k}", "../{k}", "{k}/..", "/{k}", "{k}/", "//{k}",
    "{tag}/../{token}/0.png", "{tag}/{token}/../0.png", "{tag}/{token}/0.png/..", "{tag}/./{token}/0.png",
    "{tag}//{token}/0.png", "{tag}\\{token}\\0.png", "{tag}/{token}/%2e%2e", "%2e%2e/%2e%2e/etc/passwd",
    "..%2f..%2fetc%2fpasswd", "{tag}%2f{token}%2f0.png", "{k}\n", "{k}\0", "\0{k}", " {k}", "{k} ",
    "{TAG}/{token}/0.png", "{tag}/{TOKEN}/0.png", "{tag}/{token}/00.png", "{tag}/{token}/01.png",
    "{tag}/{token}/0.PNG", "{tag}/{token}/0.jpg", "{tag}/{token}/0.png.tmp", "{tag}/{token}/.0.png",
    "{tag}/{token}/0", "{tag}/{token}", "{tag}/{token}/x/0.png", "x/{k}", "{tag}0/{token}/0.png",
    "{tag}/{token}0/0.png", "{tag}/{token}/12345.png", "{tag}/{token}/١.png", "C:\\{k}",
])
def test_keys_outside_the_form_are_refused(key: str) -> None:
    good = object_key("alpha", "png", "ab" * 16, 0)
    tag, token, _ = good.split("/")
    key = key.format(k=good, tag=tag, token=token, TAG=tag.upper(), TOKEN=token.upper())
    assert tenant_tag_of_key(key) is None
    assert DiskImageStore(Path("/nonexistent"), UrlSigner(SECRET, 60)).path_of(key) is None


def test_key_validation_takes_only_strings() -> None:
    for not_a_key in (None, 1, b"x", ["a"]):
        assert tenant_tag_of_key(not_a_key) is None


# ---- the disk store --------------------------------------------------------------------------------------------


@pytest.fixture
def disk(tmp_path: Path) -> DiskImageStore:
    return DiskImageStore(tmp_path / "images", UrlSigner(SECRET, 3600))


def stored_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


async def test_disk_put_get_delete(disk: DiskImageStore) -> None:
    assert isinstance(disk, ImageStore)
    key = object_key("alpha", "png")
    assert await disk.get(key) is None
    await disk.put(key, b"\x89PNG one", "image/png")
    assert await disk.get(key) == b"\x89PNG one"
    path = disk.root / key
    assert path.is_file() and stat.S_IMODE(path.stat().st_mode) == 0o644
    await disk.put(key, b"\x89PNG two", "image/png")  # replaced whole
    assert await disk.get(key) == b"\x89PNG two"
    with pytest.raises(ValueError):
        await disk.put("../escape.png", b"x", "image/png")
    assert await disk.get("../" + key) is None
    other = object_key("alpha", "png", key.split("/")[1], 1)
    await disk.put(other, b"second", "image/png")
    await disk.delete([key, object_key("alpha", "png"), "../not-a-key", "/etc/passwd"])  # missing, invalid: ignored
    assert await disk.get(key) is None and await disk.get(other) == b"second"
    await disk.delete([other])
    assert not (disk.root / key).parent.exists(), "an emptied answer directory goes too"
    assert stored_files(disk.root) == []


async def test_disk_urls(tmp_path: Path) -> None:
    signer = UrlSigner(SECRET, 3600)
    key = object_key("alpha", "png")
    now = time.time()
    url, expires = DiskImageStore(tmp_path, signer).url(key, now, now + 60)
    assert url.startswith(f"{FILES_PATH}{key}?") and expires == int(now + 60)
    assert signer.verify(key, query_of(url)["expires"], query_of(url)["signature"], now)
    absolute, _ = DiskImageStore(tmp_path, signer, "https://img.example.com/").url(key, now)
    assert absolute.startswith(f"https://img.example.com{FILES_PATH}{key}?")


async def test_disk_sweep(disk: DiskImageStore) -> None:
    old, new = object_key("alpha", "png"), object_key("beta", "webp")
    await disk.put(old, b"old", "image/png")
    await disk.put(new, b"new", "image/webp")
    then = time.time() - 3600
    os.utime(disk.root / old, (then, then))
    # A write that died half-way (its temporary file), and files this store never makes: only the first is swept.
    orphan = (disk.root / new).parent / ".3.png.0123456789abcdef.tmp"
    orphan.write_bytes(b"half")
    os.utime(orphan, (then, then))
    foreign = [disk.root / "notes.txt", (disk.root / new).parent / "notes.txt", disk.root / "zz" / "x.png"]
    for f in foreign:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(b"not ours")
        os.utime(f, (then, then))
    assert await disk.sweep(time.time() - 60) == 2
    assert await disk.get(old) is None and await disk.get(new) == b"new"
    assert not orphan.exists() and all(f.exists() for f in foreign)
    assert not (disk.root / old).parent.exists()
    assert await disk.sweep(time.time() - 60) == 0
    assert await images.DiskImageStore(disk.root / "missing", disk.signer).sweep(time.time()) == 0


async def test_disk_failed_write_leaves_nothing(disk: DiskImageStore, monkeypatch: pytest.MonkeyPatch) -> None:
    key = object_key("alpha", "png")
    await disk.put(key, b"before", "image/png")

    def broken_fsync(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(images.os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="No space"):
        await disk.put(key, b"after, never whole", "image/png")
    monkeypatch.undo()
    assert await disk.get(key) == b"before", "a failed replace leaves the old object whole"
    assert stored_files(disk.root) == [key], "and no temporary file"


def test_disk_concurrent_writers_and_readers(disk: DiskImageStore) -> None:
    key = object_key("alpha", "png")
    payloads = [bytes([i]) * (256 * 1024 + i) for i in range(8)]
    start = threading.Barrier(len(payloads) + 1)
    done = threading.Event()
    seen: list[bytes | None] = []

    def write(data: bytes) -> None:
        start.wait()
        for _ in range(5):
            disk._put(key, data)

    def read() -> None:
        start.wait()
        while not done.is_set():
            seen.append(disk._get(key))

    writers = [threading.Thread(target=write, args=(p,)) for p in payloads]
    reader = threading.Thread(target=read)
    for t in [*writers, reader]:
        t.start()
    for t in writers:
        t.join(timeout=60)
    done.set()
    reader.join(timeout=60)
    assert seen and all(s is None or s in payloads for s in seen), "a reader saw a partial object"
    assert disk._get(key) in payloads
    assert stored_files(disk.root) == [key]


def test_disk_writers_racing_deletes_on_one_directory(disk: DiskImageStore) -> None:
    # Writers of one answer's images race puts and deletes of another of its images, which remove the directory
    # whenever it is left empty: every write still lands.
    token = "cd" * 16
    keys = [object_key("alpha", "png", token, i) for i in range(40)]
    start = threading.Barrier(2)

    def write() -> None:
        start.wait()
        for k in keys:
            disk._put(k, k.encode())

    def delete() -> None:
        sibling = object_key("alpha", "png", token, 9000)
        start.wait()
        for _ in range(200):
            disk._put(sibling, b"x")
            disk._delete([sibling])

    threads = [threading.Thread(target=write), threading.Thread(target=delete)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(disk._get(k) == k.encode() for k in keys)


# ---- the S3 store, against moto's S3 server ------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    with moto_s3() as endpoint:
        yield endpoint


def s3_client(endpoint: str) -> Any:  # boto3's clients are untyped
    return boto3.session.Session().client("s3", endpoint_url=endpoint)


async def test_s3_put_get_and_presigned_url(s3_endpoint: str) -> None:
    store = S3ImageStore(BUCKET, "/jobs/images/", 3600, endpoint_url=s3_endpoint)
    assert isinstance(store, ImageStore) and store.prefix == "jobs/images/"
    key = object_key("alpha", "webp")
    data = os.urandom(300_000)
    await store.put(key, data, "image/webp")
    assert await store.get(key) == data
    head = s3_client(s3_endpoint).head_object(Bucket=BUCKET, Key=f"jobs/images/{key}")
    assert head["ContentType"] == "image/webp" and head["ContentLength"] == len(data)
    now = time.time()
    url, expires = store.url(key, now, now + 86400)
    assert expires == int(now + 3600) and url.startswith(f"{s3_endpoint}/{BUCKET}/jobs/images/{key}?")
    assert query_of(url)["X-Amz-Expires"] == "3600"
    async with httpx.AsyncClient() as http:  # no credentials: the URL alone
        answer = await http.get(url)
    assert answer.status_code == 200 and answer.content == data
    assert answer.headers["content-type"] == "image/webp"
    _, capped = store.url(key, now, now + 90.5)
    assert capped == int(now + 90.5)
    assert query_of(store.url(key, now, now + 90.5)[0])["X-Amz-Expires"] == str(int(now + 90.5) - int(now))
    week = S3ImageStore(BUCKET, "", 30 * 86400, endpoint_url=s3_endpoint).url(key, now)
    assert week[1] == int(now + 7 * 86400) and query_of(week[0])["X-Amz-Expires"] == str(7 * 86400)
    assert await store.get(object_key("alpha", "webp")) is None
    assert await store.get("../" + key) is None
    with pytest.raises(ValueError):
        store.url("../" + key, now)


async def test_s3_expired_presigned_url_is_refused(s3_endpoint: str) -> None:
    store = S3ImageStore(BUCKET, "short", 1, endpoint_url=s3_endpoint)
    key = object_key("alpha", "png")
    await store.put(key, b"\x89PNG soon gone", "image/png")
    url, expires = store.url(key, time.time())
    assert query_of(url)["X-Amz-Expires"] == "1"
    deadline = time.monotonic() + 10
    while time.time() <= expires + 1:  # an expiry needs time to pass: about two seconds, bounded
        assert time.monotonic() < deadline, "the clock did not pass the URL's expiry"
        await asyncio.sleep(0.05)
    async with httpx.AsyncClient() as http:
        answer = await http.get(url)
        fresh = await http.get(store.url(key, time.time(), time.time() + 600)[0])
    assert answer.status_code == 403 and b"Request has expired" in answer.content
    assert fresh.status_code == 200 and fresh.content == b"\x89PNG soon gone"


async def test_s3_delete_and_sweep(s3_endpoint: str) -> None:
    store = S3ImageStore(BUCKET, "sweep", 3600, endpoint_url=s3_endpoint)
    client = s3_client(s3_endpoint)
    keys = [object_key("alpha", "png", index=i) for i in range(3)]
    for k in keys:
        await store.put(k, k.encode(), "image/png")
    client.put_object(Bucket=BUCKET, Key="sweep/notes.txt", Body=b"not ours")
    client.put_object(Bucket=BUCKET, Key="elsewhere/" + keys[0], Body=b"another prefix")
    await store.delete([keys[0], object_key("alpha", "png"), "../bad"])  # missing and invalid keys: ignored
    assert await store.get(keys[0]) is None and await store.get(keys[1]) == keys[1].encode()
    assert await store.sweep(time.time() - 3600) == 0  # nothing that old
    assert await store.sweep(time.time() + 60) == 2
    assert await store.get(keys[1]) is None and await store.get(keys[2]) is None
    left = {o["Key"] for o in client.list_objects_v2(Bucket=BUCKET)["Contents"]}
    assert {"sweep/notes.txt", "elsewhere/" + keys[0]} <= left


async def test_s3_deletes_in_batches_of_a_thousand(s3_endpoint: str) -> None:
    store = S3ImageStore(BUCKET, "batches", 3600, endpoint_url=s3_endpoint)
    sizes: list[int] = []
    store._client.meta.events.register("before-call.s3.DeleteObjects",
                                       lambda params, **_: sizes.append(params["body"].count(b"<Key>")))
    await store.delete([object_key("alpha", "png") for _ in range(1001)])  # S3 deletes missing keys as no error
    assert sizes == [1000, 1]


async def test_s3_unreachable_or_refusing_is_unavailable(s3_endpoint: str) -> None:
    key = object_key("alpha", "png")
    down = S3ImageStore(BUCKET, "", 3600, endpoint_url=f"http://127.0.0.1:{free_port()}")
    for call in (down.put(key, b"x", "image/png"), down.get(key), down.delete([key]), down.sweep(time.time())):
        with pytest.raises(ImageStoreUnavailable):
            await call
    no_bucket = S3ImageStore("no-such-bucket", "", 3600, endpoint_url=s3_endpoint)
    with pytest.raises(ImageStoreUnavailable, match="NoSuchBucket"):
        await no_bucket.put(key, b"x", "image/png")


def test_open_image_store(tmp_path: Path) -> None:
    signer = UrlSigner(SECRET, 1800)
    disk = open_image_store(str(tmp_path / "images"), signer, "http://rest:8000")
    assert isinstance(disk, DiskImageStore) and disk.root == tmp_path / "images"
    assert disk.public_url == "http://rest:8000"
    s3 = open_image_store("s3://my-bucket/glm/images", signer, None, "http://127.0.0.1:9")
    assert isinstance(s3, S3ImageStore) and (s3.bucket, s3.prefix, s3.ttl) == ("my-bucket", "glm/images/", 1800)
    bare = open_image_store("s3://my-bucket", signer, None, "http://127.0.0.1:9")
    assert isinstance(bare, S3ImageStore) and bare.prefix == ""
    for bad in ("", "http://host/images", "gs://bucket/x", "s3://", "s3://Bad_Bucket/x", "s3:///x"):
        with pytest.raises(ValueError):
            open_image_store(bad, signer, None, None)
    with pytest.raises(ValueError, match="S3 client"):  # a configuration error, found at start-up
        open_image_store("s3://my-bucket/x", signer, None, "not a URL")
