"""Bearer credentials on gRPC servers: one interceptor, one table saying which role each method needs.

A credential travels as ``authorization: Bearer <secret>`` metadata and is compared in constant time with every
configured one. Methods the table does not name (grpc.health.v1, reflection) stay open, so probes and grpcurl
discovery work without a credential.

Used by the gateway (user and admin keys on GatewayService, see gateway.auth). Torch-free, like the rest of
services.runtime.
"""
from __future__ import annotations

import hmac
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import grpc

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class Role:
    """Who may call a group of methods, and with which credentials."""

    name: str  # the table's values name roles by this
    keys: tuple[str, ...]
    credential: str = "API key"  # how messages name the credential ("admin key", "internal token")
    # With no keys of its own, a role's methods are open (authentication off) when this is None; otherwise they
    # are refused for everyone with PERMISSION_DENIED and this message (a feature off until it gets a credential).
    off_message: str | None = None
    # Other roles whose keys are accepted here too (an admin key may do what a user key may).
    also: tuple[str, ...] = ()


def bearer_token(metadata: Iterable[tuple[str, str | bytes]] | None) -> bytes | None:
    """The token of the first ``authorization`` entry if it is ``Bearer <token>``; None otherwise."""
    for key, value in metadata or ():
        if key == "authorization":
            text = value if isinstance(value, str) else value.decode("latin-1")
            scheme, _, token = text.partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip().encode()
            return None
    return None


class BearerAuthInterceptor(grpc.aio.ServerInterceptor):
    """Checks every call against ``table``: ``"/pkg.Service/Method"`` -> role name, or ``"/pkg.Service/"`` -> the
    role of that service's methods the table does not name (so a method added later is not open by accident).

    Refusals: no credential, or one that matches no configured key: UNAUTHENTICATED. A valid credential of a
    role the method does not accept (a user key on an admin method): PERMISSION_DENIED. A method whose role has no
    keys and an ``off_message``: PERMISSION_DENIED with that message, whatever the caller sends.
    """

    def __init__(self, roles: Iterable[Role], table: Mapping[str, str]) -> None:
        self._roles = {r.name: r for r in roles}
        unknown = {name for name in table.values() if name not in self._roles}
        unknown |= {name for r in self._roles.values() for name in r.also if name not in self._roles}
        if unknown:
            raise ValueError(f"unknown role(s) {sorted(unknown)}")
        self._table = dict(table)
        # Every configured key once, with its role: each call is compared with all of them, without short-circuit,
        # so the time taken does not tell which key (or which role's key) nearly matched.
        self._keys = [(r.name, k.encode()) for r in self._roles.values() for k in dict.fromkeys(r.keys) if k]

    def role_of(self, method: str) -> Role | None:
        """The role ``method`` needs; None: the method is open."""
        name = self._table.get(method)
        if name is None:
            service, sep, _ = method.rpartition("/")
            name = self._table.get(service + sep) if sep else None
        return None if name is None else self._roles[name]

    def check(self, method: str, metadata: Iterable[tuple[str, str | bytes]] | None
              ) -> tuple[grpc.StatusCode, str] | None:
        """None if the call may go ahead, else the status code and message to refuse it with."""
        role = self.role_of(method)
        if role is None:
            return None
        if not role.keys:
            return None if role.off_message is None else (grpc.StatusCode.PERMISSION_DENIED, role.off_message)
        token = bearer_token(metadata)
        matched = set()
        if token is not None:
            hits = [hmac.compare_digest(token, key) for _, key in self._keys]
            matched = {name for (name, _), hit in zip(self._keys, hits, strict=True) if hit}
        if matched & {role.name, *role.also}:
            return None
        if matched:
            held = " or ".join(sorted(self._roles[name].credential for name in matched))
            return (grpc.StatusCode.PERMISSION_DENIED,
                    f"{method} needs the {role.name} role: an {role.credential}, not an {held}")
        return (grpc.StatusCode.UNAUTHENTICATED,
                f"missing or invalid {role.credential}: send metadata 'authorization: Bearer <key>'")

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        refusal = self.check(method, handler_call_details.invocation_metadata)
        if refusal is None:
            return handler
        code, message = refusal
        log.info("%s refused: %s: %s", method, code.name, message)
        return _refusal(handler, code, message)


def _refusal(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that only answers ``code``."""
    des, ser = handler.request_deserializer, handler.response_serializer

    async def unary(request, context: grpc.aio.ServicerContext):
        await context.abort(code, message)

    async def stream(request, context: grpc.aio.ServicerContext):
        await context.abort(code, message)
        yield  # pragma: no cover - makes this an async generator; abort always raises

    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary, des, ser)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(stream, des, ser)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary, des, ser)
    return grpc.stream_stream_rpc_method_handler(stream, des, ser)
