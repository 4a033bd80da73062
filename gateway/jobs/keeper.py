"""Images kept for later: a job's, or a synchronous response_format=url answer's. Written to the image store, counted
per tenant in the job store (one account: ``stored_bytes`` bounds what a tenant holds), handed out as signed links
that expire, and deleted with the job after the job TTL."""
from __future__ import annotations

import logging
import secrets

from gateway.jobs.images import ImageStore
from gateway.jobs.model import StoredObject
from gateway.jobs.store import JobStore
from gateway.jobs.urls import object_key
from glmimage.v1 import gateway_service_pb2
from glmimage.wire import formats
from runtime.errors import ResourceExhausted
from runtime.tenants import Tenant

log = logging.getLogger(__name__)

Response = gateway_service_pb2.GenerateImagesResponse


class ImageKeeper:
    def __init__(self, images: ImageStore, store: JobStore, job_ttl: float, max_stored_bytes: int) -> None:
        self.images = images
        self.store = store
        self.job_ttl = job_ttl
        self.max_stored_bytes = max_stored_bytes

    def bound(self, tenant: Tenant) -> int:
        return tenant.max_stored_bytes or self.max_stored_bytes

    async def check_room(self, tenant: Tenant, now: float) -> None:
        """Refuse (RESOURCE_EXHAUSTED) new work whose images would be stored while the tenant already holds its
        bound: what it holds expires after the job TTL. One job's images may go past the bound (they are counted
        once stored), so a tenant holds at most its bound and one request's images."""
        held = await self.store.stored_bytes(tenant.name, now)
        bound = self.bound(tenant)
        if held >= bound:
            raise ResourceExhausted(
                f"tenant {tenant.name!r} holds {held} bytes of stored images, its bound is {bound}: stored images "
                f"are deleted {self.job_ttl:g} s after they were made", retry_after=min(self.job_ttl, 3600.0))

    async def keep(self, tenant: str, response: Response, now: float, job_id: str | None = None
                   ) -> tuple[Response, tuple[StoredObject, ...]]:
        """Store each image; answer the response as stored (bytes dropped, GeneratedImage.url = the object key) and
        the objects to record. Keys are fresh per call: a retried job's images never overwrite a recorded one's."""
        fmt = formats.BY_PROTO.get(response.output_format, formats.DEFAULT)
        token = secrets.token_hex(16)
        stored = Response()
        stored.CopyFrom(response)
        objects = []
        expires_at = now + self.job_ttl
        for image in stored.images:
            key = object_key(tenant, fmt.name, token=token, index=image.index)
            await self.images.put(key, image.image, fmt.mime)
            objects.append(StoredObject(key=key, tenant=tenant, size=len(image.image), expires_at=expires_at,
                                        job_id=job_id))
            image.image = b""
            image.url = key
        return stored, tuple(objects)

    def present(self, stored: Response, now: float, not_after: float) -> Response:
        """The stored response with each key turned into a link signed now (it works until the URL TTL passes, or
        until the images are deleted, whichever is first)."""
        shown = Response()
        shown.CopyFrom(stored)
        for image in shown.images:
            image.url, image.url_expires_at = self.images.url(image.url, now, not_after)
        return shown

    async def with_bytes(self, stored: Response) -> Response:
        """The stored response with each image's bytes read back (GetJob's include_images)."""
        full = Response()
        full.CopyFrom(stored)
        for image in full.images:
            data = await self.images.get(image.url)
            image.image = data or b""
        return full
