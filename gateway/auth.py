"""Who may call what on GatewayService: user keys generate and read the status, admin keys manage the pool.

One interceptor (services.runtime.auth.BearerAuthInterceptor) with one table, METHOD_ROLES:

- public: GetLimits, open to every caller (the limits are what /openapi.json advertises anyway).
- user methods (GenerateImages, GenerateImagesStream, GetStatus): open when no ``--api-key`` is set (as before);
  otherwise they need a user key or an admin key.
- admin methods (AddWorker, RemoveWorker, and any GatewayService method the table does not name): refused for
  everyone with PERMISSION_DENIED while no ``--admin-key`` is set (the default); otherwise they need an admin key.
  A user key there gets PERMISSION_DENIED; no key or an unknown one, UNAUTHENTICATED.

Health and reflection stay open, so probes and grpcurl discovery work without a key.
"""
from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

from glmimage.v1 import gateway_service_pb2
from services.runtime.auth import BearerAuthInterceptor, Role

ENV_KEYS = "GLMIMAGE_API_KEYS"
ENV_ADMIN_KEYS = "GLMIMAGE_ADMIN_KEYS"
USER, ADMIN, PUBLIC = "user", "admin", "public"
SERVICE = gateway_service_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name

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
}
ADMIN_OFF = ("the admin RPCs (AddWorker, RemoveWorker, LoadLoras, UnloadLoras) are off on this gateway: start it "
             f"with --admin-key (or ${ENV_ADMIN_KEYS}) to turn them on, and call them with "
             "'authorization: Bearer <admin key>'")


def keys_from(flags: Iterable[str], env: str, environ: Mapping[str, str] = os.environ) -> tuple[str, ...]:
    """Keys from flags plus the comma-separated env var ``env``, de-duplicated, blanks dropped."""
    from_env = [k.strip() for k in environ.get(env, "").split(",")]
    return tuple(dict.fromkeys(k for k in [*(f.strip() for f in flags), *from_env] if k))


def api_keys_from(flags: Iterable[str], environ: Mapping[str, str] = os.environ) -> tuple[str, ...]:
    """``--api-key`` flags plus ``$GLMIMAGE_API_KEYS``."""
    return keys_from(flags, ENV_KEYS, environ)


def admin_keys_from(flags: Iterable[str], environ: Mapping[str, str] = os.environ) -> tuple[str, ...]:
    """``--admin-key`` flags plus ``$GLMIMAGE_ADMIN_KEYS``."""
    return keys_from(flags, ENV_ADMIN_KEYS, environ)


def gateway_interceptor(api_keys: Iterable[str], admin_keys: Iterable[str]) -> BearerAuthInterceptor:
    """The GatewayService interceptor; install it always (with no admin keys it is what keeps the admin RPCs off)."""
    roles = [Role(USER, tuple(api_keys), credential="API key", also=(ADMIN,)),
             Role(ADMIN, tuple(admin_keys), credential="admin key", off_message=ADMIN_OFF),
             Role(PUBLIC, ())]  # no keys, no off message: open
    return BearerAuthInterceptor(roles, METHOD_ROLES)
