"""Object keys and the HMAC-signed, expiring URLs the REST front serves a disk image store's files at.

A key is ``{tenant_tag}/{token}/{index}.{ext}``: the tag is a hash of the tenant's name (the front can tell whose an
object is without a database), the token is unguessable. A URL is
``/v1/images/files/{key}?expires={unix seconds}&signature={base64url HMAC-SHA256 of "{key}\\n{expires}"}``, so it
grants one object until one time, to whoever holds it, like OpenAI's links. The gateways and the REST fronts share
the secret (``--url-secret-file`` or ``$GLMIMAGE_URL_SECRET``).

Keys come back from URLs, which are client input: ``tenant_tag_of_key`` is the one gate every path built from a key
goes through, and it admits only the exact form ``object_key`` makes (no ``..``, no ``/`` at either end, hex only).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import re
import secrets
from collections.abc import Mapping
from pathlib import Path

FILES_PATH = "/v1/images/files/"
SECRET_ENV = "GLMIMAGE_URL_SECRET"
MIN_SECRET_BYTES = 16
EXTENSIONS = ("png", "jpeg", "webp")
CONTENT_TYPES = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}
# An index is an image's place in its answer (n is at most tens); no leading zeros, so each object has one key.
MAX_INDEX = 9999
_KEY_RE = re.compile(r"([0-9a-f]{16})/([0-9a-f]{32})/(0|[1-9][0-9]{0,3})\.(png|jpeg|webp)", re.ASCII)
_TOKEN_RE = re.compile(r"[0-9a-f]{32}", re.ASCII)
# Unix seconds as a URL writes them: ASCII digits only (str.isdigit would take "²" and int() " 1" or "+1"), and at
# most 12 of them (year 33658), so a huge value is refused before any arithmetic.
_EXPIRES_RE = re.compile(r"0|[1-9][0-9]{0,11}", re.ASCII)
# 32 bytes of HMAC-SHA256 in base64url without padding.
_SIGNATURE_RE = re.compile(r"[A-Za-z0-9_-]{43}", re.ASCII)


def tenant_tag(name: str) -> str:
    """The tenant part of its objects' keys: 16 hex digits of a domain-separated SHA-256 of its name."""
    return hashlib.sha256(b"glmimage-tenant\0" + name.encode("utf-8")).hexdigest()[:16]


def object_key(tenant: str, ext: str, token: str | None = None, index: int = 0) -> str:
    """A new object's key; ``token`` (32 hex digits) names the answer its images share, a fresh one when None."""
    if ext not in EXTENSIONS:
        raise ValueError(f"an image's extension is one of {', '.join(EXTENSIONS)}, not {ext!r}")
    if token is None:
        token = secrets.token_hex(16)
    elif not _TOKEN_RE.fullmatch(token):
        raise ValueError(f"a key's token is 32 lower-case hex digits, not {token!r}")
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index <= MAX_INDEX:
        raise ValueError(f"an image's index is an int from 0 to {MAX_INDEX}, not {index!r}")
    return f"{tenant_tag(tenant)}/{token}/{index}.{ext}"


def tenant_tag_of_key(key: object) -> str | None:
    """The tenant tag of a well-formed key; None for anything else (the caller answers "no such object")."""
    if not isinstance(key, str):
        return None
    match = _KEY_RE.fullmatch(key)
    return None if match is None else match.group(1)


def ext_of_key(key: str) -> str:
    """The extension of a key ``tenant_tag_of_key`` admitted."""
    return key.rpartition(".")[2]


class UrlSigner:
    """Signs and checks the files route's URLs. ``ttl``: how long a URL is good for at most (``--url-ttl``)."""

    def __init__(self, secret: bytes, ttl: float) -> None:
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"the URL secret needs at least {MIN_SECRET_BYTES} bytes, it has {len(secret)}")
        if not ttl > 0:  # (NaN too)
            raise ValueError(f"a URL's lifetime must be positive, not {ttl}")
        self._secret = bytes(secret)
        self.ttl = float(ttl)

    def __repr__(self) -> str:  # never the secret
        return f"UrlSigner(ttl={self.ttl})"

    def _signature(self, key: str, expires: int) -> str:
        mac = hmac.new(self._secret, f"{key}\n{expires}".encode("ascii"), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(mac).rstrip(b"=").decode("ascii")

    def sign(self, key: str, now: float, not_after: float | None = None) -> tuple[str, int]:
        """(the URL's path and query, when it expires): at ``now + ttl``, or ``not_after`` (the object's own
        expiry) if sooner, rounded down so that the URL never outlives the object."""
        if tenant_tag_of_key(key) is None:
            raise ValueError(f"not an object key: {key!r}")
        until = now + self.ttl if not_after is None else min(now + self.ttl, not_after)
        expires = max(0, int(until))
        return f"{FILES_PATH}{key}?expires={expires}&signature={self._signature(key, expires)}", expires

    def check(self, key: str, expires: str | None, signature: str | None, now: float) -> str:
        """"ok", "expired" (signed by us, past its time) or "invalid" (malformed, tampered, or not ours). A URL is
        "expired" only once its signature holds, so a forged one learns nothing from the answer."""
        if (tenant_tag_of_key(key) is None or not isinstance(expires, str) or not isinstance(signature, str)
                or not _EXPIRES_RE.fullmatch(expires) or not _SIGNATURE_RE.fullmatch(signature)):
            return "invalid"
        expected = self._signature(key, int(expires))
        if not hmac.compare_digest(expected.encode("ascii"), signature.encode("ascii")):
            return "invalid"
        return "ok" if now < int(expires) else "expired"

    def verify(self, key: str, expires: str | None, signature: str | None, now: float) -> bool:
        return self.check(key, expires, signature, now) == "ok"


def load_secret(path: Path | None, env: str, *, what: str, flag: str, default: Path | None = None,
                environ: Mapping[str, str] = os.environ) -> bytes:
    """A secret shared by processes: the file's bytes (``flag``), else ``$env``, else (given a ``default``) that
    file, created once; surrounding whitespace stripped (a trailing newline from an editor or ``echo`` is no part of
    it). ValueError when there is none, or it is shorter than 16 bytes."""
    if path is None and not environ.get(env) and default is not None:
        path = ensure_secret_file(default)
    if path is not None:
        secret, where = Path(path).read_bytes().strip(), str(path)
    elif environ.get(env):
        secret, where = environ[env].encode("utf-8").strip(), f"${env}"
    else:
        raise ValueError(f"no {what}: give {flag} FILE or set ${env}")
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"the {what} in {where} has {len(secret)} bytes, at least {MIN_SECRET_BYTES} are needed")
    return secret


def load_url_secret(path: Path | None, environ: Mapping[str, str] = os.environ, default: Path | None = None) -> bytes:
    """The image links' HMAC key (``--url-secret-file``, else ``$GLMIMAGE_URL_SECRET``, else ``default``)."""
    return load_secret(path, SECRET_ENV, what="URL secret", flag="--url-secret-file", default=default,
                       environ=environ)


def ensure_secret_file(path: Path) -> Path:
    """``path``, created with 32 random bytes (hex) and mode 0600 if it does not exist yet. Written to a temporary
    file and linked into place, so a reader never sees a half-written secret, and when several processes race the
    first link wins and every one of them ends up using that secret."""
    path = Path(path)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_hex(32).encode("ascii") + b"\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)  # unlike os.replace, fails when another process got there first: its secret stays
        except FileExistsError:
            pass
    finally:
        tmp.unlink(missing_ok=True)
    return path
