"""An S3 server for the tests: moto's server mode (ThreadedMotoServer), which speaks the S3 HTTP protocol, on a free
127.0.0.1 port, with fake credentials in the environment and a bucket made. No S3 server is packaged for these
machines (MinIO is not in Debian), so this is what the S3 image store is tested against.

moto checks neither a presigned URL's expiry (it serves an expired one as a fresh one) nor its signature (it serves a
tampered one; moto reads signatures from the Authorization header only, and only with its auth switched on), so the
server here puts S3's checks of a presigned request in front of moto: a request that carries ``X-Amz-Date`` and
``X-Amz-Expires`` after that many seconds have passed is refused 403 ``AccessDenied`` "Request has expired", and one
whose ``X-Amz-Signature`` is not the SigV4 query signature of the request under the fake credentials' secret is
refused 403 ``SignatureDoesNotMatch`` (an access key other than the fake one: 403 ``InvalidAccessKeyId``)."""
from __future__ import annotations

import calendar
import hashlib
import hmac
import os
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlsplit

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


def _error(code: str, message: str) -> bytes:
    return (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
            "</Error>").encode()


_EXPIRED = _error("AccessDenied", "Request has expired")
_BAD_SIGNATURE = _error("SignatureDoesNotMatch", "The request signature we calculated does not match the signature "
                        "you provided. Check your key and signing method.")
_BAD_KEY = _error("InvalidAccessKeyId", "The AWS Access Key Id you provided does not exist in our records.")


def _aws_quote(text: str, safe: str = "") -> str:
    """SigV4's URI encoding: every byte but A-Z a-z 0-9 - _ . ~ (and ``safe``) percent-encoded, upper-case hex."""
    return quote(text, safe="-_.~" + safe)


def presigned_signature(environ: dict[str, Any], query: list[tuple[str, str]], secret: str) -> str:
    """The SigV4 query-string signature S3 computes for this request (AWS's "Authenticating Requests: Using Query
    Parameters"): the canonical request (method, URI, the query but X-Amz-Signature, the signed headers, an
    unsigned payload) hashed into the string to sign, HMAC'd with the key derived from ``secret`` and the
    credential's scope."""
    params = dict(query)
    scope = params["X-Amz-Credential"].split("/", 1)[1]  # DATE/REGION/SERVICE/aws4_request
    date, region, service, _ = scope.split("/")
    raw_path = urlsplit(environ.get("RAW_URI") or environ.get("PATH_INFO", "/")).path
    canonical_query = "&".join(f"{_aws_quote(k)}={_aws_quote(v)}"
                               for k, v in sorted(query) if k != "X-Amz-Signature")
    signed = params["X-Amz-SignedHeaders"].split(";")
    headers = {"host": environ.get("HTTP_HOST", "")}
    headers.update((k[5:].replace("_", "-").lower(), v) for k, v in environ.items() if k.startswith("HTTP_"))
    canonical_headers = "".join(f"{h}:{' '.join(headers.get(h, '').split())}\n" for h in signed)
    canonical = "\n".join([environ["REQUEST_METHOD"], _aws_quote(unquote(raw_path), safe="/"), canonical_query,
                           canonical_headers, ";".join(signed), "UNSIGNED-PAYLOAD"])
    to_sign = "\n".join(["AWS4-HMAC-SHA256", params["X-Amz-Date"], scope,
                         hashlib.sha256(canonical.encode()).hexdigest()])
    key = ("AWS4" + secret).encode()
    for part in (date, region, service, "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    return hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()


class _PresignedChecks:
    """WSGI: refuse an expired or wrongly signed presigned request before moto sees it."""

    def __init__(self, app: Callable[..., Iterable[bytes]]) -> None:
        self.app = app

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        query = parse_qsl(environ.get("QUERY_STRING", ""), keep_blank_values=True)
        params = dict(query)
        signed_at, expires = params.get("X-Amz-Date", ""), params.get("X-Amz-Expires", "")
        if signed_at and expires.isdigit():
            start = calendar.timegm(time.strptime(signed_at, "%Y%m%dT%H%M%SZ"))
            if time.time() > start + int(expires):
                return _refuse(start_response, _EXPIRED)
        if "X-Amz-Signature" in params:
            credential = params.get("X-Amz-Credential", "")
            if credential.split("/", 1)[0] != FAKE_CREDENTIALS["AWS_ACCESS_KEY_ID"]:
                return _refuse(start_response, _BAD_KEY)
            try:
                expected = presigned_signature(environ, query, FAKE_CREDENTIALS["AWS_SECRET_ACCESS_KEY"])
            except (KeyError, ValueError):  # a parameter missing or malformed: no signature can match
                expected = ""
            if not hmac.compare_digest(expected.encode(), params["X-Amz-Signature"].encode()):
                return _refuse(start_response, _BAD_SIGNATURE)
        return self.app(environ, start_response)


def _refuse(start_response: Callable[..., Any], body: bytes) -> list[bytes]:
    start_response("403 Forbidden", [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))])
    return [body]


class _S3Server(ThreadedMotoServer):
    def _server_entry(self) -> None:  # ThreadedMotoServer's, with the presigned checks in front of moto's app
        app = _PresignedChecks(DomainDispatcherApplication(create_backend_app))
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
