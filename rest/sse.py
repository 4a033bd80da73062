"""Server-sent events: the wire format and a minimal ASGI response that streams them."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from typing import Any

from starlette.background import BackgroundTask
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

MEDIA_TYPE = "text/event-stream"


def event(name: str, data: Mapping[str, Any]) -> bytes:
    """One named event; json.dumps never emits a raw newline, so `data` stays on one line."""
    payload = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return f"event: {name}\ndata: {payload}\n\n".encode()


def comment(text: str) -> bytes:
    """A comment line: ignored by SSE parsers (the openai SDK included), but it keeps idle proxies from closing."""
    return f": {text}\n\n".encode()


class EventStreamResponse(Response):
    """Sends each chunk of `chunks` as it comes and always finalises the iterator, even when the client is gone.

    Starlette's StreamingResponse would also read `receive` to spot a disconnect; here the route owns
    `receive` (it cancels the gRPC call on disconnect), so this response only sends.
    """

    media_type = MEDIA_TYPE

    def __init__(self, chunks: AsyncIterator[bytes], headers: Mapping[str, str] | None = None) -> None:
        self.chunks = chunks
        self.status_code = 200
        self.background: BackgroundTask | None = None
        # no-cache: events are live; x-accel-buffering: nginx would otherwise hold them back.
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no", **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        try:
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        finally:
            aclose = getattr(self.chunks, "aclose", None)
            if aclose is not None:
                await aclose()
        await send({"type": "http.response.body", "body": b"", "more_body": False})
