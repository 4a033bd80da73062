"""Optional API keys on GatewayService: ``authorization: Bearer <key>`` metadata, checked by a server interceptor.

Health and reflection stay open, so probes and grpcurl discovery work without a key.
"""
from __future__ import annotations

import hmac
import logging
import os
from collections.abc import Iterable

import grpc

log = logging.getLogger(__name__)

ENV_KEYS = "GLMIMAGE_API_KEYS"


def api_keys_from(flags: Iterable[str], environ: dict[str, str] | os._Environ = os.environ) -> tuple[str, ...]:
    """``--api-key`` flags plus the comma-separated env var, de-duplicated, blanks dropped."""
    env = [k.strip() for k in environ.get(ENV_KEYS, "").split(",")]
    return tuple(dict.fromkeys(k for k in [*flags, *env] if k))


def _bearer(metadata: Iterable[tuple[str, str | bytes]] | None) -> bytes | None:
    for key, value in metadata or ():
        if key == "authorization":
            text = value if isinstance(value, str) else value.decode("latin-1")
            scheme, _, token = text.partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip().encode()
            return None
    return None


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls to the protected services with UNAUTHENTICATED unless a configured key is presented."""

    def __init__(self, keys: Iterable[str], protected_services: Iterable[str]) -> None:
        self._keys = tuple(k.encode() for k in keys)
        self._prefixes = tuple(f"/{s}/" for s in protected_services)

    def authorized(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> bool:
        token = _bearer(metadata)
        if token is None:
            return False
        # Compare with every key, without short-circuit, so timing does not tell which key nearly matched.
        return any([hmac.compare_digest(token, key) for key in self._keys])

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not self._keys or not method.startswith(self._prefixes):
            return handler
        if self.authorized(handler_call_details.invocation_metadata):
            return handler
        log.info("%s refused: missing or invalid API key", method)
        return _refusal(handler)


_MESSAGE = "missing or invalid API key: send metadata 'authorization: Bearer <key>'"


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that only answers UNAUTHENTICATED."""
    des, ser = handler.request_deserializer, handler.response_serializer

    async def unary(request, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _MESSAGE)

    async def stream(request, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _MESSAGE)
        yield  # pragma: no cover - makes this an async generator; abort always raises

    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary, des, ser)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(stream, des, ser)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary, des, ser)
    return grpc.stream_stream_rpc_method_handler(stream, des, ser)
