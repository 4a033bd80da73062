"""Who holds the denoiser's one slot, published to every gateway that follows it (DenoiserService.WatchOccupancy).

The denoiser is the one authority on its slot: the servicer takes and frees it here, and each gateway mirrors
the state in its availability bitmap, so a job another gateway sent shows as busy there too. A reader gets the
latest state, never a backlog of old ones: a gateway only needs to know who holds the slot now, and a slow or
stuck reader must not make the denoiser buffer without bound. Torch-free, like the servicer.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from glmimage.v1 import denoiser_service_pb2


@dataclass(frozen=True)
class Occupancy:
    # Starts from the wall clock in microseconds, so it also grows across restarts of the process: a gateway can
    # always tell an older state (e.g. the one a busy refusal reported) from a newer one.
    sequence: int
    busy: bool = False
    owner: str = ""  # the gateway that sent the job holding the slot (DenoiseRequest.owner)
    request_id: str = ""
    loras_loaded: tuple[str, ...] = ()  # the LoRA adapters the DiT holds, least recently used first
    # The job's steps done and of how many (0, 0 before its first step); progress keeps the sequence, which orders
    # the changes of who holds the slot.
    step: int = 0
    total_steps: int = 0


class OccupancyBoard:
    """The slot's state and the readers waiting for its next change (on the event loop thread)."""

    def __init__(self) -> None:
        self._state = Occupancy(sequence=time.time_ns() // 1000)
        self._changed = asyncio.Event()  # set and replaced at every change, so each waiter wakes once

    @property
    def state(self) -> Occupancy:
        return self._state

    def take(self, owner: str, request_id: str) -> None:
        self._publish(Occupancy(self._state.sequence + 1, True, owner, request_id,
                                loras_loaded=self._state.loras_loaded))

    def progress(self, sequence: int, step: int, total_steps: int) -> None:
        """The job that took the slot at ``sequence`` finished ``step`` of ``total_steps`` (a late report, after
        the slot changed hands, is dropped)."""
        state = self._state
        if state.busy and state.sequence == sequence:
            self._publish(replace(state, step=step, total_steps=total_steps))

    def release(self, loras_loaded: tuple[str, ...] | None = None) -> None:
        """Free the slot; ``loras_loaded`` as the job left them (None: unchanged)."""
        loras = self._state.loras_loaded if loras_loaded is None else loras_loaded
        self._publish(Occupancy(self._state.sequence + 1, loras_loaded=loras))

    def _publish(self, state: Occupancy) -> None:
        self._state = state
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def watch(self) -> AsyncIterator[Occupancy]:
        """The current state, then the latest one after each change, until the caller stops."""
        sent: Occupancy | None = None
        while True:
            changed = self._changed
            if self._state != sent:
                sent = self._state
                yield sent
            if self._state == sent:
                await changed.wait()

    async def messages(self) -> AsyncIterator[denoiser_service_pb2.WatchOccupancyResponse]:
        """``watch`` as WatchOccupancy sends it (the real servicer and the simulated one both serve this)."""
        async for state in self.watch():
            yield denoiser_service_pb2.WatchOccupancyResponse(sequence=state.sequence, busy=state.busy,
                                                              owner=state.owner, request_id=state.request_id,
                                                              loras_loaded=state.loras_loaded, step=state.step,
                                                              total_steps=state.total_steps)
