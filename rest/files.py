"""The disk image store's files at their signed URLs: ``GET|HEAD /v1/images/files/{key}?expires=&signature=``.

The signature is the capability, as with OpenAI's image links: a request without a key is served. A request that
presents a key (``Authorization: Bearer``) is checked like any other: an unknown key is 401, and the key of another
tenant than the object's gets 404, as it does for another tenant's job. The tenant of a key is read as the front
reads it (keys.py): the tenants file's when there is one, else the flags' (``--api-key`` keys are ``default``,
``--admin-key`` keys ``admin``); a front with no keys at all knows no tenants, and takes any key for ``default``, as
a gateway with open user methods does.

The objects come from ``app.state.image_store`` (a DiskImageStore; None or an S3 store, which serves its own URLs:
the route answers 404 as if it did not exist) and the signatures are checked with ``app.state.url_signer``.
"""

from __future__ import annotations

import asyncio
import functools
import os
import time
from collections.abc import Iterator
from typing import Any, BinaryIO

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.jobs.images import DiskImageStore
from gateway.jobs.urls import CONTENT_TYPES, FILES_PATH, UrlSigner, ext_of_key, tenant_tag, tenant_tag_of_key
from runtime.auth import bearer_token
from runtime.tenants import Tenants, tenants_from_keys

from .errors import APIError
from .keys import FrontKeys
from .schemas import ErrorResponse
from .settings import RestSettings

__all__ = ["FILES_PATH", "IMAGE_STORE_STATE", "URL_SIGNER_STATE", "router"]

# The app.state attributes the route reads.
IMAGE_STORE_STATE = "image_store"
URL_SIGNER_STATE = "url_signer"
_CHUNK = 256 * 1024

router = APIRouter()


@functools.lru_cache(maxsize=4)
def _flag_tenants(api_keys: tuple[str, ...], admin_keys: tuple[str, ...]) -> Tenants:
    return tenants_from_keys(api_keys, admin_keys)


def caller_tenant(keys: FrontKeys, settings: RestSettings, token: bytes) -> str | None:
    """The tenant whose key ``token`` is, as this front knows tenants; None when it is nobody's."""
    if keys.tenants is not None:
        tenant = keys.tenants.current.lookup(token)
    else:
        tenant = _flag_tenants(settings.api_keys, settings.admin_keys).caller(token)
    return None if tenant is None else tenant.name


def _not_found() -> APIError:
    # The same answer for a missing object and another tenant's: neither tells whether the key exists.
    return APIError(404, "no such image file", code="not_found")


def _chunks(f: BinaryIO) -> Iterator[bytes]:
    # A plain iterator: StreamingResponse reads it in its thread pool, so the loop never waits on the disk.
    with f:
        while chunk := f.read(_CHUNK):
            yield chunk


async def get_file(key: str, request: Request, expires: str | None = None,
                   signature: str | None = None) -> Response:
    state = request.app.state
    store = getattr(state, IMAGE_STORE_STATE, None)
    signer: UrlSigner | None = getattr(state, URL_SIGNER_STATE, None)
    if not isinstance(store, DiskImageStore) or signer is None:
        raise StarletteHTTPException(404, "Not Found")  # answered as any unknown path is
    token = bearer_token(request.scope["headers"])
    tenant = None if token is None else caller_tenant(state.keys, state.settings, token)
    if token is not None and tenant is None:
        raise APIError(401, "invalid or missing API key", type="authentication_error", code="invalid_api_key")
    now = time.time()
    verdict = signer.check(key, expires, signature, now)
    if verdict == "expired":
        raise APIError(403, "this image URL has expired; get a fresh one from the job or request it again",
                       code="url_expired")
    if verdict != "ok":
        raise APIError(403, "this image URL's signature is missing or invalid", code="invalid_signature")
    if tenant is not None and tenant_tag(tenant) != tenant_tag_of_key(key):
        raise _not_found()
    f = await asyncio.to_thread(store.open, key)
    if f is None:
        raise _not_found()
    assert expires is not None  # checked above
    headers = {
        "Content-Length": str(os.fstat(f.fileno()).st_size),
        # Only the holder's own cache, and no longer than the URL is good for.
        "Cache-Control": f"private, max-age={max(0, int(int(expires) - now))}",
        "X-Content-Type-Options": "nosniff",
    }
    media_type = CONTENT_TYPES[ext_of_key(key)]
    if request.method == "HEAD":
        f.close()
        return Response(status_code=200, headers=headers, media_type=media_type)
    return StreamingResponse(_chunks(f), headers=headers, media_type=media_type)


_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"content": {media: {"schema": {"type": "string", "format": "binary"}} for media in CONTENT_TYPES.values()},
          "description": "The image's bytes (a HEAD: its headers only)."},
    **{status: {"model": ErrorResponse} for status in (401, 403, 404)},
}
_DESCRIPTION = ("The URL (with its `expires` and `signature`) comes from `data[i].url`; no API key is needed. A "
                "presented key of another tenant than the image's gets 404.")
for _method in ("GET", "HEAD"):
    router.add_api_route(FILES_PATH + "{key:path}", get_file, methods=[_method], response_class=Response,
                         operation_id=f"{_method.lower()}_image_file", responses=_RESPONSES,
                         summary="An image stored by a job or a response_format=url request, at its signed URL",
                         description=_DESCRIPTION)
