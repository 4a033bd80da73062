"""Whom the REST front lets in: everyone (no keys), the ``--api-key`` list (``--admin-key`` for the live pool page),
or the tenants of ``--tenants FILE`` (any tenant's key; the admin tenants' for the page), reloaded on SIGHUP.

Only the front's own check: the key still goes on to the gateway (``--gateway-auth forward``), which resolves the
tenant itself for fair share, priorities and quotas.
"""

from __future__ import annotations

import enum

from runtime.auth import key_hits
from runtime.tenants import ADMIN, TenantsFile, tenants_from_keys

from .settings import RestSettings


class Admission(enum.Enum):
    """What the live pool page's data says to a caller."""

    ALLOWED = "allowed"
    UNKNOWN = "unknown"  # no key, or one nobody has: 401
    NOT_ADMIN = "not_admin"  # a key, not an admin's: 403


class FrontKeys:
    def __init__(self, settings: RestSettings) -> None:
        self.api_keys = tuple(k.encode() for k in settings.api_keys)
        self.admin_keys = tuple(k.encode() for k in settings.admin_keys)
        # Read now: a bad file raises TenantsError (file:line: field), which stops the front at start-up.
        self.tenants = None if settings.tenants_file is None else \
            TenantsFile(settings.tenants_file, tenants_from_keys((), ()))

    @property
    def checked(self) -> bool:
        """Whether the API needs a key at all."""
        return self.tenants is not None or bool(self.api_keys)

    def user(self, token: bytes | None) -> bool:
        """Whether ``token`` may call the API."""
        if self.tenants is not None:
            return self.tenants.current.lookup(token) is not None
        return not self.api_keys or any(key_hits(token, self.api_keys))

    def admin(self, token: bytes | None) -> Admission:
        """Whether ``token`` may see the live pool page's data: anyone without keys; with --api-key, an --admin-key;
        with tenants, a key of a tenant whose role is admin."""
        if not self.checked:
            return Admission.ALLOWED
        if token is None:
            return Admission.UNKNOWN
        if self.tenants is not None:
            tenant = self.tenants.current.lookup(token)
            if tenant is None:
                return Admission.UNKNOWN
            return Admission.ALLOWED if tenant.role == ADMIN else Admission.NOT_ADMIN
        return Admission.ALLOWED if any(key_hits(token, self.admin_keys)) else Admission.NOT_ADMIN

    def reload(self) -> bool:
        """SIGHUP: read the tenants file again (a bad one is logged, the tenants in force stay). A request already
        let in is not affected; the next ones are checked against the new keys."""
        return self.tenants is not None and self.tenants.reload()
