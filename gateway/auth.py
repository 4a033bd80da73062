"""Who may call what on GatewayService: user keys generate and read the status, admin keys manage the pool.

One interceptor (GatewayAuth) over the tenants in force (runtime.tenants: the tenants file, or the key flags
as tenants `default` and `admin`), with one table, METHOD_ROLES:

- public: GetLimits, open to every caller (the limits are what /openapi.json advertises anyway).
- user methods (GenerateImages, GenerateImagesStream, GetStatus): open when no ``--api-key`` is set (as before);
  otherwise they need a user key or an admin key.
- admin methods (AddWorker, RemoveWorker, and any GatewayService method the table does not name): refused for
  everyone with PERMISSION_DENIED while no ``--admin-key`` is set (the default); otherwise they need an admin key.
  A user key there gets PERMISSION_DENIED; no key or an unknown one, UNAUTHENTICATED.

Health and reflection stay open, so probes and grpcurl discovery work without a key.
"""
from __future__ import annotations

import hmac
import logging
import os
from collections.abc import Iterable, Mapping

import grpc

from glmimage.v1 import gateway_service_pb2, job_service_pb2
from runtime.auth import CheckingInterceptor, bearer_token
from runtime.tenants import ADMIN, USER, Tenant, TenantsFile, digest

log = logging.getLogger(__name__)

ENV_KEYS = "GLMIMAGE_API_KEYS"
ENV_ADMIN_KEYS = "GLMIMAGE_ADMIN_KEYS"
# Keys that may call GetStatus and nothing else, and see no tenant and no job id with it: a probe's (the REST front's
# /health, which the launcher gives one of its own when the tenants file holds every other key).
ENV_STATUS_KEYS = "GLMIMAGE_STATUS_KEYS"
PUBLIC = "public"
SERVICE = gateway_service_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name
STATUS_METHOD = f"/{SERVICE}/GetStatus"
JOB_SERVICE = job_service_pb2.DESCRIPTOR.services_by_name["JobService"].full_name
# The services this interceptor guards (health and reflection stay open).
GUARDED = (f"/{SERVICE}/", f"/{JOB_SERVICE}/")

METHOD_ROLES: dict[str, str] = {
    f"/{SERVICE}/": ADMIN,  # a method not named below: fail closed
    f"/{SERVICE}/GenerateImages": USER,
    f"/{SERVICE}/GenerateImagesStream": USER,
    f"/{SERVICE}/GetStatus": USER,
    # The limits in force are public (the REST front's /openapi.json shows them); no key needed, like health.
    f"/{SERVICE}/GetLimits": PUBLIC,
    f"/{SERVICE}/AddWorker": ADMIN,
    f"/{SERVICE}/RemoveWorker": ADMIN,
    # The adapters requests may name: what any caller needs to make one (the REST front's /v1/models lists them).
    f"/{SERVICE}/ListLoras": USER,
    f"/{SERVICE}/LoadLoras": ADMIN,
    f"/{SERVICE}/UnloadLoras": ADMIN,
    # Jobs: each caller's own (JobService answers NOT_FOUND for another tenant's).
    f"/{JOB_SERVICE}/": ADMIN,
    **{f"/{JOB_SERVICE}/{m.name}": USER for m in job_service_pb2.DESCRIPTOR.services_by_name["JobService"].methods},
}
ADMIN_OFF = ("the admin RPCs (AddWorker, RemoveWorker, LoadLoras, UnloadLoras) are off on this gateway: start it "
             f"with --admin-key (or ${ENV_ADMIN_KEYS}) to turn them on, and call them with "
             "'authorization: Bearer <admin key>'")


def keys_from(flags: Iterable[str], env: str, environ: Mapping[str, str] = os.environ) -> tuple[str, ...]:
    """Keys from flags plus the comma-separated env var ``env``, de-duplicated, blanks dropped."""
    from_env = [k.strip() for k in environ.get(env, "").split(",")]
    return tuple(dict.fromkeys(k for k in [*(f.strip() for f in flags), *from_env] if k))


def status_keys_from(environ: Mapping[str, str] = os.environ) -> tuple[str, ...]:
    """``$GLMIMAGE_STATUS_KEYS``: never a flag, so `ps` does not show them."""
    return keys_from((), ENV_STATUS_KEYS, environ)


def api_keys_from(flags: Iterable[str], environ: Mapping[str, str] = os.environ) -> tuple[str, ...]:
    """``--api-key`` flags plus ``$GLMIMAGE_API_KEYS``."""
    return keys_from(flags, ENV_KEYS, environ)


def admin_keys_from(flags: Iterable[str], environ: Mapping[str, str] = os.environ) -> tuple[str, ...]:
    """``--admin-key`` flags plus ``$GLMIMAGE_ADMIN_KEYS``."""
    return keys_from(flags, ENV_ADMIN_KEYS, environ)


class GatewayAuth(CheckingInterceptor):
    """The GatewayService interceptor over the tenants in force (read anew on every call, so a reload applies to the
    next call): a key is its tenant's, and the tenant's role says which methods it may call (METHOD_ROLES)."""

    def __init__(self, tenants: TenantsFile, status_keys: Iterable[str] = ()) -> None:
        self.tenants = tenants
        self._status = [digest(k) for k in status_keys if k]

    @staticmethod
    def role_of(method: str) -> str:
        role = METHOD_ROLES.get(method)
        if role is None:
            service, sep, _ = method.rpartition("/")
            role = METHOD_ROLES.get(service + sep, ADMIN) if sep else ADMIN
        return role

    def caller(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> Tenant | None:
        """Whose call it is: its key's tenant (on a gateway with open user methods, `default` without one)."""
        return self.tenants.current.caller(bearer_token(metadata))

    def is_probe(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> bool:
        """Whether the call presents a status key (GetStatus only, no tenant's view)."""
        token = bearer_token(metadata)
        if token is None or not self._status:
            return False
        probe = digest(token)
        return any([hmac.compare_digest(probe, key) for key in self._status])

    def check(self, method: str, metadata: Iterable[tuple[str, str | bytes]] | None
              ) -> tuple[grpc.StatusCode, str] | None:
        """None if the call may go ahead, else the status code and message to refuse it with."""
        role = self.role_of(method)
        if role == PUBLIC or not method.startswith(GUARDED):
            return None
        tenants = self.tenants.current
        if role == USER and tenants.open_users:
            return None
        if method == STATUS_METHOD and self.is_probe(metadata):
            return None
        if role == ADMIN and not tenants.has_admin:
            return grpc.StatusCode.PERMISSION_DENIED, ADMIN_OFF
        tenant = tenants.lookup(bearer_token(metadata))
        credential = "admin key" if role == ADMIN else "API key"
        if tenant is None:
            return (grpc.StatusCode.UNAUTHENTICATED,
                    f"missing or invalid {credential}: send metadata 'authorization: Bearer <key>'")
        if not tenant.holds(role):
            return grpc.StatusCode.PERMISSION_DENIED, f"{method} needs the {role} role: an {credential}, not an API key"
        return None


