"""Tenants: who a caller is, from one TOML file (``--tenants FILE``) or, without one, from the key flags.

A tenant is a name, its keys (or their SHA-256 digests, so the file need not hold secrets), its weight (its share of
both stages while several tenants wait), its role (``user`` or ``admin``), the highest priority class its requests may
ask for, and optional quotas. The form::

    [tenants.alpha]
    keys = ["sk-alpha-1"]            # or keys_sha256 = ["<hex>"]
    weight = 1
    role = "user"                    # or "admin"
    max_priority = "interactive"     # interactive > default > batch; absent: default

    [tenants.beta]
    keys = ["sk-beta-1"]
    weight = 2
    requests_per_minute = 30         # optional quotas; absent: no quota
    images_per_minute = 60
    max_inflight_images = 8
    max_stored_bytes = 1073741824    # jobs: its stored images' bytes; absent: the gateway's --max-stored-bytes
    webhook_secret = "whsec_..."     # jobs: signs its webhooks; absent: derived from the gateway's master secret

Without a file, ``--api-key`` keys are tenant ``default`` and ``--admin-key`` keys tenant ``admin``; with no user key
at all, user methods stay open and every caller without a key is ``default`` (as before tenants existed).

A bad file is refused whole, with its line and field named (``FILE:LINE: tenants.NAME.FIELD: why``): at start-up that
stops the server; on a reload (SIGHUP, TenantsFile.reload) the tenants in force stay. Pure: no gRPC, no asyncio.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import math
import re
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from runtime.priority import DEFAULT, INTERACTIVE, PRIORITY_NAMES

log = logging.getLogger(__name__)

USER, ADMIN = "user", "admin"
ROLES = (USER, ADMIN)
DEFAULT_TENANT, ADMIN_TENANT = "default", "admin"
# Tenant names become metric label values and log fields: short, plain.
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_HEX64_RE = re.compile(r"[0-9a-fA-F]{64}")
QUOTA_FIELDS = ("requests_per_minute", "images_per_minute", "max_inflight_images")
# Jobs (gateway.jobs): the bound on the bytes of its stored images, and the secret its webhooks are signed with.
JOB_FIELDS = ("max_stored_bytes", "webhook_secret")
FIELDS = ("keys", "keys_sha256", "weight", "role", "max_priority", *QUOTA_FIELDS, *JOB_FIELDS)
# A weight's range: 1/weight is what a job costs its tenant in virtual time, and a weight near 0 (5e-324) makes it
# infinite, which would stop every tenant's clock at once.
MIN_WEIGHT, MAX_WEIGHT = 0.001, 1_000_000.0


class TenantsError(ValueError):
    """A tenants file that cannot be used; the message names the file, the line and the field."""


def digest(key: str | bytes) -> bytes:
    return hashlib.sha256(key.encode("utf-8") if isinstance(key, str) else key).digest()


@dataclass(frozen=True)
class Tenant:
    name: str
    weight: float = 1.0
    role: str = USER
    max_priority: int = DEFAULT  # a scheduler class (gateway.scheduler.types): INTERACTIVE is 0, the highest
    requests_per_minute: int | None = None
    images_per_minute: int | None = None
    max_inflight_images: int | None = None
    max_stored_bytes: int | None = None  # None: the gateway's --max-stored-bytes
    webhook_secret: str | None = field(default=None, repr=False)  # None: derived from the gateway's master secret
    digests: tuple[bytes, ...] = field(default=(), repr=False)  # SHA-256 of each key

    @property
    def has_quotas(self) -> bool:
        return any(getattr(self, f) is not None for f in QUOTA_FIELDS)

    def holds(self, role: str) -> bool:
        """Whether its calls may use methods of ``role`` (an admin may do what a user may)."""
        return self.role == role or self.role == ADMIN

    def allows(self, priority: int) -> bool:
        """Whether its requests may ask for ``priority`` (lower is higher)."""
        return priority >= self.max_priority


@dataclass(frozen=True)
class Tenants:
    by_name: Mapping[str, Tenant]
    source: str = "flags"  # the file's path, or "flags"
    # No user key is configured (flags only): user methods are open, and a caller without a key is `default`.
    open_users: bool = False

    def __post_init__(self) -> None:
        # (name, digest) once per key: each lookup compares with every one of them, without short-circuit.
        object.__setattr__(self, "_digests", [(t.name, d) for t in self.by_name.values() for d in t.digests])

    @property
    def open(self) -> bool:
        """No key at all: authentication is off and every caller is tenant `default`."""
        return not self._digests  # type: ignore[attr-defined]

    @property
    def has_admin(self) -> bool:
        return any(t.role == ADMIN and t.digests for t in self.by_name.values())

    def get(self, name: str) -> Tenant | None:
        return self.by_name.get(name)

    def lookup(self, token: bytes | None) -> Tenant | None:
        """The tenant whose key ``token`` is (None: none). Every digest is compared, in constant time, so the time
        taken does not tell which key nearly matched."""
        if token is None:
            return None
        probe = digest(token)
        hit: str | None = None
        for name, key in self._digests:  # type: ignore[attr-defined]
            if hmac.compare_digest(probe, key) and hit is None:
                hit = name
        return None if hit is None else self.by_name[hit]

    def caller(self, token: bytes | None) -> Tenant | None:
        """Whom a call is from: its key's tenant; on a gateway with open user methods, `default` without a key."""
        found = self.lookup(token)
        if found is None and self.open_users:  # (any key or none: user methods do not check one)
            return self.by_name.get(DEFAULT_TENANT)
        return found


def tenants_from_keys(api_keys: Iterable[str], admin_keys: Iterable[str]) -> Tenants:
    """Today's flags as tenants: ``--api-key`` keys are `default`, ``--admin-key`` keys `admin`; every class and no
    quota for both, weight 1."""
    api, admin = tuple(api_keys), tuple(admin_keys)
    tenants = {DEFAULT_TENANT: Tenant(DEFAULT_TENANT, max_priority=INTERACTIVE, digests=tuple(map(digest, api)))}
    if admin:
        tenants[ADMIN_TENANT] = Tenant(ADMIN_TENANT, role=ADMIN, max_priority=INTERACTIVE,
                                       digests=tuple(map(digest, admin)))
    return Tenants(tenants, "flags", open_users=not api)


# ---- the file -------------------------------------------------------------------------------------------------


def _lines_of(text: str) -> dict[tuple[str, str | None], int]:
    """(tenant, field) -> its line, and (tenant, None) -> its table header's, found by reading the text again:
    tomllib keeps no positions. Good enough to point at the line a person has to look at."""
    where: dict[tuple[str, str | None], int] = {}
    current: str | None = None
    header = re.compile(r"\s*\[\s*tenants\s*\.\s*(?:\"([^\"]*)\"|'([^']*)'|([A-Za-z0-9_-]+))\s*\]")
    assignment = re.compile(r"\s*([A-Za-z0-9_-]+)\s*=")
    for number, line in enumerate(text.splitlines(), 1):
        if m := header.match(line):
            current = next(g for g in m.groups() if g is not None)
            where.setdefault((current, None), number)
        elif line.lstrip().startswith("["):
            current = None
        elif current is not None and (m := assignment.match(line)):
            where.setdefault((current, m.group(1)), number)
    return where


def load_tenants(path: str | Path) -> Tenants:
    """The tenants of ``path``; TenantsError naming the line and field of the first problem."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TenantsError(f"{path}: cannot read the tenants file: {exc}") from None
    return parse_tenants(text, str(path))


def parse_tenants(text: str, source: str = "<tenants>") -> Tenants:
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        m = re.search(r"at line (\d+)", str(exc))
        line = m.group(1) if m else max(1, len(text.splitlines()))  # (else "at end of document")
        raise TenantsError(f"{source}:{line}: not valid TOML: {exc}") from None
    where = _lines_of(text)

    def fail(name: str | None, fld: str | None, why: str) -> TenantsError:
        line = where.get((name, fld)) or where.get((name, None)) or 1 if name is not None else 1
        path = "tenants" + (f".{name}" if name is not None else "") + (f".{fld}" if fld else "")
        return TenantsError(f"{source}:{line}: {path}: {why}")

    if unknown := sorted(set(doc) - {"tenants"}):
        raise TenantsError(f"{source}:1: {unknown[0]}: unknown top-level key; the file holds [tenants.NAME] tables")
    table = doc.get("tenants")
    if not isinstance(table, dict) or not table:
        raise fail(None, None, "the file names no tenant: add a [tenants.NAME] table")
    owner: dict[bytes, str] = {}
    tenants: dict[str, Tenant] = {}
    for name, spec in table.items():
        if not _NAME_RE.fullmatch(name):
            raise fail(name, None, "a tenant name is 1 to 64 letters, digits, '_', '.' or '-', starting with a letter "
                                   "or digit")
        if not isinstance(spec, dict):
            raise fail(name, None, "must be a table ([tenants.NAME])")
        if unknown := [k for k in spec if k not in FIELDS]:
            raise fail(name, unknown[0], f"unknown field; the fields are {', '.join(FIELDS)}")
        digests: list[bytes] = []
        for fld in ("keys", "keys_sha256"):
            values = spec.get(fld, [])
            if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
                raise fail(name, fld, "must be a list of strings")
            for value in values:
                if fld == "keys":
                    if not value or not value.isascii() or not value.isprintable() or any(c.isspace() for c in value):
                        raise fail(name, fld, "a key is printable ASCII without spaces (it travels as "
                                              "'authorization: Bearer <key>')")
                    key = digest(value)
                else:
                    if not _HEX64_RE.fullmatch(value):
                        raise fail(name, fld, "a digest is 64 hex digits (`printf %s KEY | sha256sum`)")
                    key = bytes.fromhex(value)
                if key in owner:
                    other = owner[key]
                    raise fail(name, fld, "a key is listed twice" + ("" if other == name else
                                                                     f": tenant {other!r} has it too"))
                owner[key] = name
                digests.append(key)
        if not digests:
            raise fail(name, None, "needs at least one key (keys or keys_sha256)")
        weight = spec.get("weight", 1)
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight) \
                or not MIN_WEIGHT <= weight <= MAX_WEIGHT:
            raise fail(name, "weight", f"must be a number above 0, from {MIN_WEIGHT:g} to {MAX_WEIGHT:g}, got "
                                       f"{weight!r}")
        role = spec.get("role", USER)
        if role not in ROLES:
            raise fail(name, "role", f"must be one of {', '.join(map(repr, ROLES))}, got {role!r}")
        priority = spec.get("max_priority", PRIORITY_NAMES[DEFAULT])
        if priority not in PRIORITY_NAMES:
            raise fail(name, "max_priority", f"must be one of {', '.join(map(repr, PRIORITY_NAMES))}, got "
                                             f"{priority!r}")
        quotas: dict[str, int | None] = {}
        for fld in QUOTA_FIELDS:
            value = spec.get(fld)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 10**9):
                raise fail(name, fld, f"must be a whole number from 1 to 1000000000 (absent: no quota), got {value!r}")
            quotas[fld] = value
        stored = spec.get("max_stored_bytes")
        if stored is not None and (isinstance(stored, bool) or not isinstance(stored, int) or not 1 <= stored <= 2**50):
            raise fail(name, "max_stored_bytes", f"must be a whole number of bytes from 1 to {2**50} (absent: the "
                                                 f"gateway's --max-stored-bytes), got {stored!r}")
        secret = spec.get("webhook_secret")
        if secret is not None and not _valid_webhook_secret(secret):
            raise fail(name, "webhook_secret", "must be 'whsec_' and the base64 of 24 to 64 random bytes (the Standard "
                                               "Webhooks form)")
        tenants[name] = Tenant(name, float(weight), role, PRIORITY_NAMES.index(priority), digests=tuple(digests),
                               max_stored_bytes=stored, webhook_secret=secret, **quotas)
    return Tenants(tenants, source)


def _valid_webhook_secret(value: object) -> bool:
    if not isinstance(value, str) or not value.startswith("whsec_"):
        return False
    try:
        raw = base64.b64decode(value[len("whsec_"):], validate=True)
    except ValueError:
        return False
    return 24 <= len(raw) <= 64


class TenantsFile:
    """The tenants in force, reloadable: from ``path`` when given (read now: a bad file raises TenantsError, which
    stops the server), else ``fallback`` (the key flags) for good. A request keeps the Tenant it was admitted under;
    a reload only changes whom later calls resolve to."""

    def __init__(self, path: str | Path | None, fallback: Tenants) -> None:
        self.path = None if path is None else Path(path)
        self.current = fallback if self.path is None else load_tenants(self.path)
        self.reloads = 0

    def reload(self) -> bool:
        """Read the file again (SIGHUP). A bad one is logged and refused: the tenants in force stay."""
        if self.path is None:
            return False
        try:
            fresh = load_tenants(self.path)
        except TenantsError as exc:
            log.error("tenants file not reloaded, the %d tenant(s) in force stay: %s", len(self.current.by_name), exc)
            return False
        gone = sorted(set(self.current.by_name) - set(fresh.by_name))
        self.current = fresh
        self.reloads += 1
        log.info("tenants reloaded from %s: %d tenant(s)%s", self.path, len(fresh.by_name),
                 f"; removed: {', '.join(gone)}" if gone else "")
        return True


def add_tenants_args(p) -> None:
    p.add_argument("--tenants", default=None, metavar="FILE",
                   help="TOML file naming each tenant, its keys (or their SHA-256), weight, role, max_priority and "
                        "quotas (docs/operating.md#tenants); SIGHUP reloads it. With it, every call needs a key of "
                        "the file; --api-key/--admin-key must not be given too")
