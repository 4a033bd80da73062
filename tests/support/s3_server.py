"""An S3 server for the tests: moto's server mode (ThreadedMotoServer), which speaks the S3 HTTP protocol, on a free
127.0.0.1 port, with fake credentials in the environment and a bucket made. No S3 server is packaged for these
machines (MinIO is not in Debian), so this is what the S3 image store is tested against.

moto does not check a presigned URL's expiry (it serves an expired one as a fresh one), so the server here puts one
check in front of moto, AWS's: a GET that carries ``X-Amz-Date`` and ``X-Amz-Expires`` after that many seconds have
passed is refused 403 ``AccessDenied`` "Request has expired", as S3 refuses it."""
from __future__ import annotations

import calendar
import os
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import parse_qs

import boto3
from moto.moto_server.threaded_moto_server import ThreadedMotoServer
from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
from werkzeug.serving import make_server

BUCKET = "glmimage-test"
FAKE_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                    "AWS_DEFAULT_REGION": "us-east-1"}
# Read by boto3 instead of the fake ones above, if set in the environment the tests run in.
_CLEARED = ("AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3",
            "AWS_REGION")

_EXPIRED = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code>'
            b"<Message>Request has expired</Message></Error>")


class _PresignedExpiry:
    """WSGI: refuse an expired presigned request before moto sees it."""

    def __init__(self, app: Callable[..., Iterable[bytes]]) -> None:
        self.app = app

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        query = parse_qs(environ.get("QUERY_STRING", ""))
        signed_at, expires = query.get("X-Amz-Date", [""])[0], query.get("X-Amz-Expires", [""])[0]
        if signed_at and expires.isdigit():
            start = calendar.timegm(time.strptime(signed_at, "%Y%m%dT%H%M%SZ"))
            if time.time() > start + int(expires):
                start_response("403 Forbidden", [("Content-Type", "application/xml"),
                                                  ("Content-Length", str(len(_EXPIRED)))])
                return [_EXPIRED]
        return self.app(environ, start_response)


class _S3Server(ThreadedMotoServer):
    def _server_entry(self) -> None:  # ThreadedMotoServer's, with the expiry check in front of moto's app
        app = _PresignedExpiry(DomainDispatcherApplication(create_backend_app))
        self._server = make_server(self._ip_address, self._port, app, True, request_handler=MotoRequestHandler)
        self._server_ready_event.set()
        self._server.serve_forever()


@contextmanager
def moto_s3(bucket: str = BUCKET) -> Iterator[str]:
    """A running S3 with ``bucket`` made; yields its endpoint URL (``--s3-endpoint``). The fake credentials stay in
    the environment while it runs (boto3 clients made meanwhile read them)."""
    saved = {name: os.environ.get(name) for name in (*FAKE_CREDENTIALS, *_CLEARED)}
    for name in _CLEARED:
        os.environ.pop(name, None)
    os.environ.update(FAKE_CREDENTIALS)
    server = _S3Server(ip_address="127.0.0.1", port=0, verbose=False)  # port 0: the kernel's pick, no race
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        boto3.session.Session().client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
        yield endpoint
    finally:
        server.stop()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
