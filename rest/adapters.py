"""The LoRA adapters the pool serves, as this front knows them: GatewayService.ListLoras, read when something needs
them (a `model` that is no served name, GET /v1/models) and kept TTL_S seconds, one read in flight at a time.

Read with the credential any call of the caller carries (dispatch.gateway_metadata) and kept per credential: a
caller is shown what the gateway shows that credential, never a list another key read. A failed read never touches
a request that names no adapter (nothing else reads the list), and /v1/models then lists the served names alone. A
gateway without ListLoras (UNIMPLEMENTED) serves no adapters, and a credential it refuses the list
(PERMISSION_DENIED) is shown none: its `model` must then be a served name.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

import grpc
from fastapi import Request

from glmimage.v1 import common_pb2, gateway_service_pb2
from runtime.errors import InvalidArgument
from runtime.limits import check_lora_name

from . import upstream
from .dispatch import gateway_metadata
from .errors import from_rpc_error
from .middleware import request_id
from .settings import RestSettings
from .translate import model_not_found

log = logging.getLogger("glmimage.rest")

TTL_S = 5.0
# A failed read stands this long: a gateway that is away is asked about once a second, not once a request.
RETRY_S = 1.0
# Credentials with a list kept; past it the one read longest ago goes.
MAX_CREDENTIALS = 64

# After these a gateway's read is not the answer: it is away, or older than ListLoras (then the next one is asked).
_AWAY = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
_NEXT_GATEWAY = (*_AWAY, grpc.StatusCode.UNIMPLEMENTED)

Adapters = Mapping[str, common_pb2.LoraInfo]


async def list_adapters(gateways: upstream.Gateways, metadata: tuple[tuple[str, str], ...],
                        timeout: float) -> dict[str, common_pb2.LoraInfo]:
    """The adapters by name from the first gateway that answers ListLoras, within one ``timeout`` for all; {} when
    it refuses this credential the list (PERMISSION_DENIED) or those that answered predate it. Otherwise the last
    failure (AioRpcError)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    last: grpc.aio.AioRpcError | None = None
    older = False
    for gateway in gateways.attempts():  # those whose channel is down last
        await gateway.connected()  # a gateway reconnecting (just restarted) is given its moment, as for generations
        try:
            reply = await gateway.stub.ListLoras(gateway_service_pb2.ListLorasRequest(), metadata=metadata,
                                                 timeout=max(deadline - loop.time(), 0.001))
        except grpc.aio.AioRpcError as err:
            if err.code() is grpc.StatusCode.PERMISSION_DENIED:  # this credential is shown none
                return {}
            if err.code() not in _NEXT_GATEWAY:
                raise
            older = older or err.code() is grpc.StatusCode.UNIMPLEMENTED
            last = err
            continue
        return {info.name: info for info in reply.loras}
    if older:
        return {}
    assert last is not None  # Gateways holds one gateway at least
    raise last


@dataclass
class _Entry:
    adapters: dict[str, common_pb2.LoraInfo] | None = None  # the last list read, kept while the gateway is away
    error: grpc.aio.AioRpcError | None = None  # the last read's failure
    fresh_until: float = float("-inf")
    reading: asyncio.Task[None] | None = None


class AdapterCache:
    """The adapter lists read, one per credential, each re-read lazily once TTL_S old (RETRY_S after a failure)."""

    def __init__(self, ttl: float = TTL_S, retry: float = RETRY_S, max_credentials: int = MAX_CREDENTIALS) -> None:
        self.ttl, self.retry, self.max_credentials = ttl, retry, max_credentials
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()

    async def get(self, gateways: upstream.Gateways, metadata: tuple[tuple[str, str], ...],
                  timeout: float) -> Adapters:
        """The adapters by name for the credential in ``metadata``; the read's AioRpcError when it failed and no
        earlier list stands in."""
        key = _credential(metadata)
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry()
            while len(self._entries) > self.max_credentials:
                self._entries.popitem(last=False)
        loop = asyncio.get_running_loop()
        if loop.time() >= entry.fresh_until:
            if entry.reading is None:
                entry.reading = asyncio.create_task(self._read(entry, gateways, metadata, timeout),
                                                    name="list-loras")
            # Shielded: a caller that goes away does not cancel the read the others wait for.
            await asyncio.shield(entry.reading)
        if entry.adapters is None:
            assert entry.error is not None
            raise entry.error
        return entry.adapters

    async def _read(self, entry: _Entry, gateways: upstream.Gateways, metadata: tuple[tuple[str, str], ...],
                    timeout: float) -> None:
        loop = asyncio.get_running_loop()
        try:
            entry.adapters, entry.error = await list_adapters(gateways, metadata, timeout), None
            entry.fresh_until = loop.time() + self.ttl
        except grpc.aio.AioRpcError as err:
            log.info("gateway ListLoras failed: %s: %s", err.code().name, err.details())
            if err.code() not in _AWAY:  # refused, not away: what was read before no longer holds
                entry.adapters = None
            entry.error, entry.fresh_until = err, loop.time() + self.retry
        finally:
            entry.reading = None


def _credential(metadata: tuple[tuple[str, str], ...]) -> bytes:
    """The key of a credential's list: a digest, so the cache holds no key."""
    authorization = next((value for key, value in metadata if key == "authorization"), "")
    return hashlib.sha256(authorization.encode()).digest()


async def known_adapters(request: Request, settings: RestSettings, rid: str) -> Adapters:
    """The adapters as the caller's credential is shown them (AdapterCache.get's errors)."""
    state = request.app.state
    return await state.adapters.get(state.gateways, gateway_metadata(request, settings, rid),
                                    settings.health_timeout)


async def listed_adapters(request: Request, settings: RestSettings) -> Adapters:
    """For listings: the adapters, or none when the gateway cannot say."""
    try:
        return await known_adapters(request, settings, request_id(request))
    except grpc.aio.AioRpcError:  # logged by the read
        return {}


async def model_adapter(model: str | None, request: Request, settings: RestSettings, rid: str) -> str | None:
    """The adapter a request's `model` names (vLLM's convention), None for the served model or an alias; otherwise
    404 model_not_found, or the client's error for a ListLoras that failed (the pool could not say)."""
    if model is None or model in settings.model_names:
        return None
    try:
        check_lora_name(model, "model")
    except InvalidArgument:  # could not be an adapter: the gateway is not asked
        raise model_not_found(model, settings) from None
    try:
        adapters = await known_adapters(request, settings, rid)
    except grpc.aio.AioRpcError as err:
        raise from_rpc_error(err, rid) from None
    if model not in adapters:
        raise model_not_found(model, settings)
    return model
