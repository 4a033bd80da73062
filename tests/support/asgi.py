"""Driving an ASGI app by hand, for tests that decide when the HTTP client hangs up."""
from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import FastAPI


class RawClient:
    """Drives the ASGI app directly so the test decides when the client hangs up.

    receive() hands over the body once, then reports http.disconnect when `hang_up()` is called.
    """

    def __init__(self, app: FastAPI, body: dict[str, Any]) -> None:
        self.body = json.dumps(body).encode()
        self.disconnect = asyncio.Event()
        self.body_chunk_sent = asyncio.Event()
        self.sent: list[dict[str, Any]] = []
        self._body_given = False
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
            "scheme": "http", "path": "/v1/images/generations", "raw_path": b"/v1/images/generations",
            "query_string": b"", "root_path": "",
            "headers": [(b"host", b"test"), (b"content-type", b"application/json")],
            "client": ("127.0.0.1", 1234), "server": ("test", 80),
        }
        self.task = asyncio.create_task(app(scope, self._receive, self._send))

    async def _receive(self) -> dict[str, Any]:
        if not self._body_given:
            self._body_given = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.disconnect.wait()
        return {"type": "http.disconnect"}

    async def _send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)
        if message["type"] == "http.response.body" and message.get("body"):
            self.body_chunk_sent.set()

    def hang_up(self) -> None:
        self.disconnect.set()
