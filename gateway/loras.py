"""LoRA adapters across the pool, for GatewayService's ListLoras, LoadLoras and UnloadLoras: each denoiser's listing
re-read (coalesced, so a burst of callers costs the denoisers one round), and the admin's loads and unloads fanned
out to the denoisers, each answering for itself.

Which adapters a request may name (the catalogue) is the pool's (Members.lora_catalogue, merged from the listings
kept on each worker); where jobs go is the scheduler's (it follows what each denoiser holds from its occupancy
stream). This module only performs the calls.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Container, Sequence

import grpc

from gateway.workers import Worker, WorkerHealth
from glmimage.v1 import denoiser_service_pb2, gateway_service_pb2
from runtime.errors import InvalidArgument
from runtime.limits import Limits, check_lora_names

log = logging.getLogger(__name__)

# A listing at most this old is answered from what the last round of ListLoras calls said.
LISTING_MAX_AGE_S = 1.0


def check_names(names: Sequence[str], limits: Limits | None, known: Container[str] | None) -> None:
    """An admin call's adapter names, checked as a denoiser would (runtime.limits.check_lora_names; with
    ``limits``, a load: no more than one job may name), at least one, and (``known``: a load) each one the pool
    serves. INVALID_ARGUMENT naming ``names`` or ``names[i]``."""
    if not names:
        raise InvalidArgument("names", "give at least one adapter name")
    check_lora_names(names, limits)
    for i, name in enumerate(names):
        if known is not None and name not in known:
            raise InvalidArgument(f"names[{i}]", f"no adapter named {name!r} is served here (see ListLoras)")


def pick_workers(addresses: Sequence[str], denoisers: Sequence[Worker]) -> list[Worker]:
    """The denoisers an admin call names (empty: all of them); INVALID_ARGUMENT naming ``workers[i]`` for an
    address that is not a denoiser of the pool."""
    if not addresses:
        return list(denoisers)
    by_address = {w.address: w for w in denoisers}
    picked = []
    for i, address in enumerate(addresses):
        worker = by_address.get(address.strip())
        if worker is None:
            shown = address if len(address) <= 200 else f"{address[:200]}..."
            raise InvalidArgument(f"workers[{i}]", f"{shown!r} is not a denoiser of this gateway's pool")
        if worker not in picked:
            picked.append(worker)
    return picked


def _error(err: grpc.aio.AioRpcError) -> str:
    return f"{err.code().name}: {err.details()}"


def _not_called(w: Worker) -> gateway_service_pb2.LoraPlacement | None:
    """The placement of a denoiser not worth a call, or None: one that is not serving as the gateway last saw it
    (hung, gone, draining) would only hold the admin's call until its deadline."""
    if w.health is WorkerHealth.SERVING:
        return None
    return gateway_service_pb2.LoraPlacement(worker=w.address,
                                             error=f"UNAVAILABLE: not called: it is {w.health.value}")


class PoolLoras:
    """The calls behind the adapter RPCs of GatewayService, over the denoisers ``denoisers()`` returns."""

    def __init__(self, denoisers: Callable[[], list[Worker]], metadata: Sequence[tuple[str, str]]) -> None:
        self._denoisers = denoisers
        self._metadata = tuple(metadata)
        self._round: asyncio.Task | None = None
        self._round_at = float("-inf")
        self._placement: list[gateway_service_pb2.LoraPlacement] = []

    async def listing(self) -> list[gateway_service_pb2.LoraPlacement]:
        """Re-read every denoiser's listing (each Worker keeps its own, which the catalogue merges), unless a round
        ended less than LISTING_MAX_AGE_S ago; callers that come during a round share it. What each holds, or why
        it did not answer."""
        if self._round is None and time.monotonic() - self._round_at >= LISTING_MAX_AGE_S:
            self._round = asyncio.ensure_future(self._read_all())
        if self._round is not None:
            round_ = self._round
            try:
                self._placement = await asyncio.shield(round_)
            finally:
                if self._round is round_ and round_.done():
                    self._round, self._round_at = None, time.monotonic()
        return self._placement

    async def _read_all(self) -> list[gateway_service_pb2.LoraPlacement]:
        async def one(w: Worker) -> gateway_service_pb2.LoraPlacement:
            if (skipped := _not_called(w)) is not None:
                return skipped  # its listing, as it last said, stays in the catalogue's merge
            try:
                reply = await w.read_loras()
            except grpc.aio.AioRpcError as err:
                return gateway_service_pb2.LoraPlacement(worker=w.address, error=_error(err))
            return gateway_service_pb2.LoraPlacement(worker=w.address, loaded=reply.loaded)

        return list(await asyncio.gather(*(one(w) for w in self._denoisers())))

    async def load(self, names: Sequence[str], workers: Sequence[Worker], timeout: float, *, unload: bool = False
                   ) -> list[gateway_service_pb2.LoraPlacement]:
        """LoadLoras (``unload``: UnloadLoras) on each of ``workers``."""
        log.info("admin: %s LoRA adapter(s) %s on %d denoiser(s)", "unloading" if unload else "loading",
                 ", ".join(names), len(workers))
        if unload:
            request: object = denoiser_service_pb2.DenoiserServiceUnloadLorasRequest(names=names)
        else:
            request = denoiser_service_pb2.DenoiserServiceLoadLorasRequest(names=names)
        method = "UnloadLoras" if unload else "LoadLoras"
        return await self._fan_out(workers, lambda w: getattr(w.stub, method)(request, timeout=timeout,
                                                                              metadata=self._metadata))

    @staticmethod
    async def _fan_out(workers: Sequence[Worker], call: Callable[[Worker], Awaitable]
                       ) -> list[gateway_service_pb2.LoraPlacement]:
        """Each denoiser's answer: what it holds afterwards, or its error (one not serving is not called). When every
        one called refused the names as bad input (a file that fails its checks), that refusal is the call's own:
        INVALID_ARGUMENT, as it said it."""
        async def one(w: Worker) -> tuple[gateway_service_pb2.LoraPlacement, grpc.aio.AioRpcError | None]:
            if (skipped := _not_called(w)) is not None:
                return skipped, None
            try:
                reply = await call(w)
            except grpc.aio.AioRpcError as err:
                log.warning("admin: LoRA call on %s failed: %s", w.address, _error(err))
                return gateway_service_pb2.LoraPlacement(worker=w.address, error=_error(err)), err
            return gateway_service_pb2.LoraPlacement(worker=w.address, loaded=reply.loaded), None

        results = await asyncio.gather(*(one(w) for w in workers))
        called = [err for placement, err in results if err is not None or not placement.error]
        if called and all(e is not None and e.code() is grpc.StatusCode.INVALID_ARGUMENT for e in called):
            first = called[0]
            assert first is not None
            field, _, message = (first.details() or "").partition(": ")
            raise InvalidArgument(field if field.startswith("names") else "names", message or first.details())
        return [placement for placement, _ in results]
