"""`python -m rest`: serve the OpenAI-compatible REST front with uvicorn."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import uvicorn

from glmimage.wire.sizes import size_arg
from runtime.paths import write_port_file
from runtime.sockets import listen_socket
from runtime.tenants import TenantsError
from runtime.tracing import add_tracing_args, endpoint_from, setup_tracing

from .app import create_app
from .connections import GUARD_HELP, ConnectionGuards, protocol_class
from .settings import GATEWAY_AUTH_MODES, RestSettings, quality_profile_arg

_DEFAULTS = RestSettings()
_GUARDS = ConnectionGuards()


def _quality(text: str) -> tuple:
    try:
        return quality_profile_arg(text)
    except ValueError as exc:  # argparse shows an ArgumentTypeError's own text
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="glmimage-rest", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    p.add_argument("--listen-fd", type=int, default=None,
                   help="accept on this inherited listening socket instead of binding --host/--port (a supervisor "
                        "holds it over restarts, so connections wait in its backlog rather than being refused)")
    p.add_argument("--port-file", type=Path, default=None,
                   help="write the bound port here once listening (for supervisors and tests using --port 0)")
    p.add_argument("--gateway-address", default=_DEFAULTS.gateway_address,
                   help="GatewayService host:port; several comma-separated (round robin, a request a gateway "
                   "fails UNAVAILABLE goes to the next), or dns:///name:port (round robin over its addresses that "
                   "are SERVING; one that fails UNAVAILABLE goes round again, once per other address)")
    p.add_argument("--served-model", default=_DEFAULTS.served_model)
    p.add_argument("--model-alias", action="append", default=None,
                   help="accepted alias of the served model "
                   f"(repeatable; default {list(_DEFAULTS.model_aliases)})")
    p.add_argument("--default-size", type=size_arg, default=_DEFAULTS.default_size, help="size used for 'auto'")
    p.add_argument("--quality", type=_quality, action="append", default=[], metavar="NAME=STEPS[:STEP_CACHE]",
                   help="what a request's quality means: denoising steps (0: the denoiser's default) and a step "
                   "cache (off, balanced, aggressive), e.g. low=10:aggressive (repeatable; default " +
                   ", ".join(f"{name}={profile.spec()}" for name, profile in _DEFAULTS.quality_profiles.items()) + ")")
    p.add_argument("--api-key", action="append", default=[],
                   help="accepted Bearer key (repeatable; also GLMIMAGE_API_KEYS, comma-separated)")
    p.add_argument("--admin-key", action="append", default=[],
                   help="key that may see the live pool page /status when --api-key is set (repeatable; also "
                   "GLMIMAGE_ADMIN_KEYS, comma-separated, the gateway's own variable)")
    p.add_argument("--tenants", type=Path, default=None, metavar="FILE",
                   help="TOML file naming each tenant and its keys (docs/operating.md#tenants), instead of "
                   "--api-key/--admin-key: any tenant's key may call the API, an admin tenant's see /status; the "
                   "key goes on to the gateway, which resolves the tenant (give it the same file). SIGHUP reloads it")
    p.add_argument("--gateway-auth", choices=GATEWAY_AUTH_MODES, default="forward",
                   help="how generation calls authenticate to the gateway. forward (default): with the client's own "
                   "Authorization header, so the gateway checks every caller (give both the same keys). own: with "
                   "--gateway-api-key, after this front checked the client against its own --api-key list; needs "
                   "both")
    p.add_argument("--gateway-api-key", default=None,
                   help="key this front presents to the gateway: on its own calls (GetStatus behind /health) and, "
                   "with --gateway-auth own, on every generation call; also GLMIMAGE_GATEWAY_API_KEY. Default with "
                   "forward: the first key this front accepts itself (the Helm chart gives both the same keys)")
    p.add_argument("--enable-cache-report", action="store_true",
                   help="report usage.prompt_tokens_details.cached_tokens")
    p.add_argument("--request-timeout", type=float, default=_DEFAULTS.request_timeout, help="seconds")
    p.add_argument("--drain-seconds", type=float, default=60.0,
                   help="on SIGTERM: stop taking connections and give the requests in flight this long to finish "
                        "(streams included) before the front exits anyway (default %(default)s)")
    p.add_argument("--cors-origin", action="append", default=[],
                   help="browser origin allowed to call the API, e.g. https://app.example.com (repeatable; "
                   "default none: CORS off)")
    p.add_argument("--max-body-bytes", type=int, default=_DEFAULTS.max_body_bytes,
                   help="largest request body accepted; larger ones get 413, chunked ones as soon as they pass it "
                   f"(default {_DEFAULTS.max_body_bytes}, 1 MiB)")
    p.add_argument("--image-store", type=Path, default=None, metavar="DIR",
                   help="the gateways' disk image store, whose files this front serves at their signed links "
                        "(default: the gateways' default directory; an s3:// store serves its own links)")
    p.add_argument("--url-secret-file", type=Path, default=None, metavar="FILE",
                   help="the image links' HMAC key, the gateways' --url-secret-file (default: $GLMIMAGE_URL_SECRET, "
                        "else the cache directory's default file)")
    tls = p.add_argument_group("TLS to the gateway", "any of these turns TLS on for the gateway channel")
    tls.add_argument("--gateway-tls-ca", type=Path, default=None,
                     help="PEM CA bundle that signed the gateway's certificate (default: the system roots)")
    tls.add_argument("--gateway-tls-client-cert", type=Path, default=None,
                     help="PEM client certificate chain, for mutual TLS (with --gateway-tls-client-key)")
    tls.add_argument("--gateway-tls-client-key", type=Path, default=None,
                     help="PEM private key of --gateway-tls-client-cert")
    tls.add_argument("--gateway-tls-server-name", default=None,
                     help="name the gateway's certificate must carry, when it differs from the dialled host")
    slow = p.add_argument_group("client connections", "deadlines for slow clients, and the bound on connections")
    for name, text in GUARD_HELP.items():
        default = getattr(_GUARDS, name)
        slow.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default,
                          help=f"{text} (default {default:g})")
    p.add_argument("--log-level", default="info", type=str.lower, choices=["debug", "info", "warning", "error"])
    add_tracing_args(p)
    args = p.parse_args(argv)
    if (args.gateway_tls_client_cert is None) != (args.gateway_tls_client_key is None):
        p.error("--gateway-tls-client-cert and --gateway-tls-client-key go together")
    try:  # the flag values RestSettings and ConnectionGuards refuse, reported as usage errors at start-up
        settings_from_args(args)
        guards_from_args(args)
    except ValueError as exc:
        p.error(str(exc))
    return args


def _env_list(name: str) -> list[str]:
    return [k.strip() for k in os.environ.get(name, "").split(",")]


def settings_from_args(args: argparse.Namespace) -> RestSettings:
    env_keys = [k.strip() for k in os.environ.get("GLMIMAGE_API_KEYS", "").split(",")]
    api_keys = tuple(dict.fromkeys(k for k in [*args.api_key, *env_keys] if k))
    return RestSettings(
        gateway_address=args.gateway_address,
        served_model=args.served_model,
        model_aliases=tuple(args.model_alias) if args.model_alias is not None else _DEFAULTS.model_aliases,
        default_size=args.default_size,
        quality_profiles={**_DEFAULTS.quality_profiles, **dict(args.quality)},
        api_keys=api_keys,
        admin_keys=tuple(dict.fromkeys(k for k in [*args.admin_key, *_env_list("GLMIMAGE_ADMIN_KEYS")] if k)),
        tenants_file=args.tenants,
        request_timeout=args.request_timeout,
        max_body_bytes=args.max_body_bytes,
        cors_origins=tuple(args.cors_origin),
        image_store=args.image_store,
        url_secret_file=args.url_secret_file,
        enable_cache_report=args.enable_cache_report,
        gateway_tls_ca=args.gateway_tls_ca,
        gateway_tls_client_cert=args.gateway_tls_client_cert,
        gateway_tls_client_key=args.gateway_tls_client_key,
        gateway_tls_server_name=args.gateway_tls_server_name,
        # Without one, /health could not read the gateway's status when both sides require keys, and the
        # readiness probe would never pass: fall back on a key of this front's own.
        # With own, only an explicit key: falling back on a client key would defeat separate keys per hop.
        gateway_api_key=(args.gateway_api_key or os.environ.get("GLMIMAGE_GATEWAY_API_KEY")
                         or (next(iter(api_keys), None) if args.gateway_auth == "forward" else None)),
        gateway_auth=args.gateway_auth,
    )


def guards_from_args(args: argparse.Namespace) -> ConnectionGuards:
    return ConnectionGuards(**{name: getattr(args, name) for name in GUARD_HELP})


def inherited_socket(fd: int) -> socket.socket:
    """The listening socket a supervisor passed as ``fd`` (family, type and protocol read from the socket)."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError as exc:
        sys.exit(f"glmimage-rest: error: --listen-fd {fd}: {exc.strerror or exc}")
    if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
        sys.exit(f"glmimage-rest: error: --listen-fd {fd} is not a listening socket")
    return sock


class RestServer(uvicorn.Server):
    """uvicorn's server, except that SIGTERM and SIGINT end the process with exit code 0 after the graceful
    shutdown (in-flight requests finish, the gateway channel closes), like every other server of the suite.

    uvicorn's own capture_signals() re-raises the captured signal once it has shut down, so the process then died
    of it: exit code 143 on SIGTERM, a KeyboardInterrupt traceback on SIGINT. main() installs the handlers itself,
    before the port is bound, so a signal that arrives while the front is still starting is handled the same way.
    """

    # With --tenants: what SIGHUP does (re-read the file), from the start-up on.
    on_sighup: Callable[[], object] | None = None

    def install_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.handle_exit)  # sets should_exit; a second SIGINT sets force_exit
        if self.on_sighup is not None:  # until startup() takes it over, a reload signal must not end the process
            signal.signal(signal.SIGHUP, signal.SIG_IGN)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        if self.on_sighup is not None:
            # On the loop, between requests: the tenants in force change in one assignment, none is dropped.
            try:
                asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self.on_sighup)
            except (RuntimeError, ValueError):  # a loop outside the main thread takes no signals
                logging.getLogger("rest").warning("SIGHUP will not reload the tenants file: the server does "
                                                          "not run in the main thread")
        await super().startup(sockets)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.on_sighup is not None:
            with contextlib.suppress(RuntimeError, ValueError):
                asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the handlers are in place already, and nothing is re-raised afterwards


def build_server(args: argparse.Namespace) -> RestServer:
    """The front's server as main() runs it, not yet listening: serve(sockets=[listen_socket(...)]) starts it."""
    guards = guards_from_args(args)
    # The stdlib loop: uvloop measured no faster here (the time goes to FastAPI and the gRPC client). No
    # websockets: the API has none, and an upgraded connection would leave the slow-client guards behind.
    app = create_app(settings_from_args(args))  # reads the tenants file: TenantsError when it is bad
    config = uvicorn.Config(app, log_level=args.log_level, lifespan="on",
                            loop="asyncio", http=protocol_class(guards), ws="none",
                            timeout_keep_alive=guards.keep_alive_timeout,
                            timeout_graceful_shutdown=args.drain_seconds)  # type: ignore[arg-type]
    server = RestServer(config)
    if args.tenants is not None:
        server.on_sighup = app.state.keys.reload
    return server


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    setup_tracing("glmimage-rest", endpoint_from(args.otlp_endpoint))
    try:
        server = build_server(args)
    except TenantsError as exc:  # FILE:LINE: tenants.NAME.FIELD: why; the line to fix, not a traceback
        sys.exit(f"glmimage-rest: error: {exc}")
    server.install_handlers()
    # Bind here rather than in uvicorn so that --port 0 can report the port it got.
    sock = inherited_socket(args.listen_fd) if args.listen_fd is not None else listen_socket(args.host, args.port)
    if args.port_file is not None:
        write_port_file(args.port_file, sock.getsockname()[1])
    logging.getLogger("rest").info("REST front listening on %s:%d", args.host, sock.getsockname()[1])
    server.run(sockets=[sock])


if __name__ == "__main__":
    main()
