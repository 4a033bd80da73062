"""Bearer credentials on gRPC servers: one interceptor, one table saying which role each method needs.

A credential travels as ``authorization: Bearer <secret>`` metadata and is compared in constant time with every
configured one, as UTF-8 bytes; a repeated one is refused. The REST front checks its API keys with the same two
functions (bearer_token, key_hits), so both paths treat odd headers alike. Methods the table does not name
(grpc.health.v1, reflection) stay open, so probes and grpcurl discovery work without a credential.

Used by the gateway (user and admin keys on GatewayService, see gateway.auth) and by the AR and denoiser servers
(the internal token the gateway presents on ArService and DenoiserService, see services.model.serving).
Torch-free, like the rest of runtime.
"""
from __future__ import annotations

import argparse
import hmac
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

log = logging.getLogger(__name__)

ENV_INTERNAL_TOKEN = "GLMIMAGE_INTERNAL_TOKEN"
MIN_TOKEN_CHARS = 16
INTERNAL = "internal"


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


_AUTHORIZATION = ("authorization", b"authorization")


def bearer_token(entries: Iterable[tuple[str | bytes, str | bytes]] | None) -> bytes | None:
    """The secret of the one ``authorization: Bearer <secret>`` among ``entries`` (a call's gRPC metadata, or an
    HTTP request's raw headers), as UTF-8 bytes. None when there is none, when it is not Bearer, and when there
    are several: servers disagree on which one counts (the first, the last, all joined), so a repeated credential
    is refused rather than guessed at, on every hop alike."""
    values = [v for k, v in entries or () if k.lower() in _AUTHORIZATION]
    if len(values) != 1:
        return None
    value = values[0] if isinstance(values[0], bytes) else values[0].encode("utf-8")
    scheme, _, token = value.partition(b" ")
    token = token.strip()
    return token if scheme.lower() == b"bearer" and token else None


def key_hits(token: bytes | None, keys: Sequence[bytes]) -> list[bool]:
    """For each of ``keys`` (UTF-8 bytes), whether ``token`` is it. Every key is compared, in constant time and
    without short-circuit, so the time taken does not tell which key nearly matched."""
    return [token is not None and hmac.compare_digest(token, key) for key in keys]


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata presenting ``token``; empty for None."""
    return (("authorization", f"Bearer {token}"),) if token else ()


@dataclass(frozen=True)
class Caller:
    """Whose credential a call presents, as BearerAuthInterceptor.caller found it."""

    roles: frozenset[str]  # the roles whose keys it is (a key configured for two roles is both); empty: none
    key: int | None = None  # which configured key (an index, never the secret); None: no key matched

    def holds(self, role: str) -> bool:
        return role in self.roles


class CheckingInterceptor(grpc.aio.ServerInterceptor):
    """Refuses a call its ``check`` refuses, before its message is read; lets every other call through."""

    def check(self, method: str, metadata: Iterable[tuple[str, str | bytes]] | None
              ) -> tuple[grpc.StatusCode, str] | None:
        raise NotImplementedError

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
        return refusal_handler(handler, code, message)


class BearerAuthInterceptor(CheckingInterceptor):
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

    def caller(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> Caller:
        """Who presents the call's credential: the roles whose keys it is, and which key. The one place a call's
        credential is compared with the configured keys (every key, without short-circuit: key_hits); ``check``
        and a servicer that shapes its answer by the caller's role (gateway GetStatus) both ask here."""
        hits = key_hits(bearer_token(metadata), [key for _, key in self._keys])
        matched = [i for i, hit in enumerate(hits) if hit]
        return Caller(frozenset(self._keys[i][0] for i in matched), matched[0] if matched else None)

    def check(self, method: str, metadata: Iterable[tuple[str, str | bytes]] | None
              ) -> tuple[grpc.StatusCode, str] | None:
        """None if the call may go ahead, else the status code and message to refuse it with."""
        role = self.role_of(method)
        if role is None:
            return None
        if not role.keys:
            return None if role.off_message is None else (grpc.StatusCode.PERMISSION_DENIED, role.off_message)
        matched = self.caller(metadata).roles
        if matched & {role.name, *role.also}:
            return None
        if matched:
            held = " or ".join(sorted(self._roles[name].credential for name in matched))
            return (grpc.StatusCode.PERMISSION_DENIED,
                    f"{method} needs the {role.name} role: an {role.credential}, not an {held}")
        return (grpc.StatusCode.UNAUTHENTICATED,
                f"missing or invalid {role.credential}: send metadata 'authorization: Bearer <key>'")



def refusal_handler(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler for ``handler``'s method that answers ``code`` without reading the request: served as
    client-streaming on raw bytes (the same on the wire as unary), so no message of an unknown caller is ever
    received, let alone decoded (runtime.intake)."""
    ser = handler.response_serializer

    async def unary(requests, context: grpc.aio.ServicerContext):
        await context.abort(code, message)

    async def stream(requests, context: grpc.aio.ServicerContext):
        await context.abort(code, message)
        yield  # pragma: no cover - makes this an async generator; abort always raises

    if handler.unary_unary or handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary, None, ser)
    return grpc.stream_stream_rpc_method_handler(stream, None, ser)


# ---- the internal token (gateway -> AR and denoisers) -----------------------------------------------------------


def check_token(token: str, source: str) -> str:
    """``token`` if it can serve as the internal token; ValueError naming ``source`` otherwise."""
    if len(token) < MIN_TOKEN_CHARS:
        raise ValueError(f"the internal token from {source} is {len(token)} characters; use at least "
                         f"{MIN_TOKEN_CHARS} (e.g. `openssl rand -hex 32`)")
    if not token.isascii() or not token.isprintable() or any(c.isspace() for c in token):
        raise ValueError(f"the internal token from {source} must be printable ASCII without spaces")
    return token


def _tokens(text: str, source: str) -> tuple[str, ...]:
    """The tokens of ``text``, one a line (blank lines skipped, surrounding whitespace dropped), in order, each
    once; ValueError when there is none or one is unusable."""
    lines = [line.strip() for line in text.splitlines()]
    tokens = tuple(dict.fromkeys(line for line in lines if line))
    if not tokens:
        check_token("", source)  # says "0 characters"
    for i, token in enumerate(tokens):
        check_token(token, source if len(tokens) == 1 else f"{source} (token {i + 1})")
    return tokens


def internal_tokens_from(path: Path | None, environ: Mapping[str, str] = os.environ) -> tuple[str, ...]:
    """Every token in ``path``, one a line, else in ``$GLMIMAGE_INTERNAL_TOKEN`` (the same rule); empty when
    neither is set. ValueError for an unreadable file or an unusable token.

    Several tokens are for a rotation: a server accepts all of them, the gateway presents the first. So the new
    token can be accepted everywhere before any gateway presents it, and the old one dropped once none does."""
    if path is not None:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--internal-token-file {path}: {exc}") from None
        return _tokens(text, f"--internal-token-file {path}")
    text = environ.get(ENV_INTERNAL_TOKEN, "")
    return _tokens(text, f"${ENV_INTERNAL_TOKEN}") if text.strip() else ()


def internal_token_from(path: Path | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """The token the gateway presents: the first of internal_tokens_from; None when none is set."""
    tokens = internal_tokens_from(path, environ)
    return tokens[0] if tokens else None


def add_internal_token_args(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--internal-token-file", type=Path, default=None, metavar="PATH",
                   help=f"{what} (also ${ENV_INTERNAL_TOKEN}; the file wins). A file or the environment, never a "
                        "flag value, so `ps` does not show it. One token a line: a server accepts every one (for a "
                        "rotation), a gateway presents the first. Off when neither is set.")


def internal_tokens_from_args(args: argparse.Namespace, environ: Mapping[str, str] = os.environ
                              ) -> tuple[str, ...]:
    try:
        return internal_tokens_from(args.internal_token_file, environ)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


def internal_token_from_args(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> str | None:
    """The token a gateway presents (the first one)."""
    tokens = internal_tokens_from_args(args, environ)
    return tokens[0] if tokens else None


def internal_token_interceptor(tokens: str | Sequence[str], services: Iterable[str]) -> BearerAuthInterceptor:
    """Every method of ``services`` needs ``authorization: Bearer <token>`` with one of ``tokens`` (several
    during a rotation); health and reflection stay open."""
    accepted = (tokens,) if isinstance(tokens, str) else tuple(tokens)
    role = Role(INTERNAL, accepted, credential="internal token")
    return BearerAuthInterceptor([role], {f"/{s}/": INTERNAL for s in services})
