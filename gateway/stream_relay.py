"""One streamed request's events on their way to its caller (GenerateImagesStream).

The denoise jobs of a streamed request report progress and previews as they run (gateway.downstream calls
``relay`` for each); the servicer yields what ``events()`` gives until the request has ended. A job that is retried
on another worker starts again from step 1 and sends its previews again: what the caller already has is dropped,
so its progress never moves backwards and no preview comes twice.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from glmimage.v1 import denoiser_service_pb2, gateway_service_pb2

Event = gateway_service_pb2.GenerateImagesStreamResponse


class StreamRelay:
    """Per image index: the highest step and the previews relayed so far; the events waiting for the caller, in the
    order they came; and whether the stream has ended (after which nothing more is queued)."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[Event | None] = asyncio.Queue()  # None: the end
        self._steps: dict[int, int] = {}  # image index -> highest step relayed
        self._previews: dict[int, int] = {}  # image index -> previews relayed
        self._ended = False

    def relay(self, index: int, message: denoiser_service_pb2.DenoiseStreamResponse) -> None:
        """A denoise job's progress or preview for image ``index`` (the downstream.Relay signature)."""
        if self._ended:
            return
        if message.WhichOneof("event") == "progress":
            step = message.progress.step
            if step <= self._steps.get(index, 0):
                return
            self._steps[index] = step
            self._queue.put_nowait(Event(progress=gateway_service_pb2.ImageProgress(
                image_index=index, step=step, total_steps=message.progress.total_steps)))
            return
        partial = message.partial_image
        if partial.partial_image_index < self._previews.get(index, 0):
            return
        self._previews[index] = partial.partial_image_index + 1
        self._queue.put_nowait(Event(partial_image=gateway_service_pb2.ImagePartial(
            image_index=index, partial_image_index=partial.partial_image_index, image=partial.image)))

    def end(self) -> None:
        """The request has ended: ``events()`` stops after what is already queued. Later calls change nothing."""
        if not self._ended:
            self._ended = True
            self._queue.put_nowait(None)

    async def events(self) -> AsyncIterator[Event]:
        """The relayed events in order, until ``end()``."""
        while (event := await self._queue.get()) is not None:
            yield event
