"""The stream relay on its own: what a streamed request's caller is sent of its denoise jobs' events."""
from __future__ import annotations

import asyncio

from gateway.stream_relay import StreamRelay
from glmimage.v1 import denoiser_service_pb2 as dpb


def progress(step: int, total: int = 4) -> dpb.DenoiseStreamResponse:
    return dpb.DenoiseStreamResponse(progress=dpb.DenoiseProgress(step=step, total_steps=total))


def preview(k: int, image: bytes = b"p") -> dpb.DenoiseStreamResponse:
    return dpb.DenoiseStreamResponse(partial_image=dpb.PartialImage(partial_image_index=k, image=image))


def sent(relay: StreamRelay) -> list[tuple]:
    """What the caller is sent, as (kind, image index, step or preview index)."""
    async def drain() -> list:
        return [e async for e in relay.events()]

    out = []
    for e in asyncio.run(drain()):
        if e.WhichOneof("event") == "progress":
            out.append(("progress", e.progress.image_index, e.progress.step))
        else:
            out.append(("partial", e.partial_image.image_index, e.partial_image.partial_image_index))
    return out


def test_events_come_in_the_order_relayed_per_image_and_across_images() -> None:
    relay = StreamRelay()
    relay.relay(0, progress(1))
    relay.relay(1, progress(1))
    relay.relay(0, preview(0))
    relay.relay(0, progress(2))
    relay.relay(1, preview(0))
    relay.end()
    assert sent(relay) == [("progress", 0, 1), ("progress", 1, 1), ("partial", 0, 0), ("progress", 0, 2),
                           ("partial", 1, 0)]


def test_a_retried_job_repeats_nothing_the_caller_already_has() -> None:
    relay = StreamRelay()
    for step in (1, 2, 3):
        relay.relay(0, progress(step))
    relay.relay(0, preview(0))
    # The job is retried on another worker: it starts again at step 1 and sends its first preview again.
    for step in (1, 2, 3, 4):
        relay.relay(0, progress(step))
    relay.relay(0, preview(0))
    relay.relay(0, preview(1))
    relay.relay(1, progress(1))  # another image's count is its own
    relay.end()
    assert sent(relay) == [("progress", 0, 1), ("progress", 0, 2), ("progress", 0, 3), ("partial", 0, 0),
                           ("progress", 0, 4), ("partial", 0, 1), ("progress", 1, 1)]


def test_the_stream_ends_once_and_takes_nothing_after_its_end() -> None:
    relay = StreamRelay()
    relay.relay(0, progress(1))
    relay.end()
    relay.end()
    relay.relay(0, progress(2))  # a late event of a job cancelled as the request ended
    assert sent(relay) == [("progress", 0, 1)]


def test_a_preview_keeps_its_image_bytes() -> None:
    relay = StreamRelay()
    relay.relay(2, preview(0, b"\x89PNG"))
    relay.end()

    async def first():
        async for e in relay.events():
            return e

    event = asyncio.run(first())
    assert (event.partial_image.image_index, event.partial_image.image) == (2, b"\x89PNG")
