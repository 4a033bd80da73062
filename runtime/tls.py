"""Optional TLS for every gRPC hop: server credentials (with mutual TLS when a client CA is given), and the
gateway's flags for reaching the AR and denoiser servers (per-address tls:// and plaintext:// included). The
channels themselves are built by glmimage.wire.channels, the one client-side builder of the suite.

Plaintext stays the default (loopback in `make run`); everything here is off unless a flag names a file.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import grpc

from glmimage.wire.channels import ChannelOptions, TlsConfig, aio_channel


def _read(path: Path | None) -> bytes | None:
    return None if path is None else path.read_bytes()


@dataclass(frozen=True)
class ServerTls:
    cert: Path  # PEM chain presented to clients
    key: Path
    client_ca: Path | None = None  # set: clients must present a certificate signed by it (mutual TLS)

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.key.read_bytes(), self.cert.read_bytes())],
            root_certificates=_read(self.client_ca),
            require_client_auth=self.client_ca is not None)


@dataclass(frozen=True)
class ClientTls:
    ca: Path | None = None  # None: the system roots
    cert: Path | None = None  # client certificate, for servers that require mutual TLS
    key: Path | None = None
    # Name to check the server certificate against when it differs from the dialled host (e.g. pod IPs
    # resolved from a headless Service, with a certificate issued for the Service name).
    server_name: str | None = None
    # Only addresses written tls://host:port dial TLS; bare ones stay plaintext (moving a pool to TLS one at a time).
    only_marked: bool = False

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("a client certificate needs both --tls-client-cert and --tls-client-key")

    def config(self) -> TlsConfig:
        """The PEM material, read now (so a rotated certificate is picked up by the next channel)."""
        return TlsConfig.from_files(self.ca, self.cert, self.key, self.server_name)


# An upstream address may say how to dial it, so one worker can move to TLS (or stay plaintext) on its own:
# "tls://host:port" always dials TLS (with the --tls-* settings, or the system roots when none are given),
# "plaintext://host:port" never does, and a bare "host:port" follows the process-wide default: TLS when a --tls-*
# flag is given, unless --tls-only-marked says only tls:// addresses use it.
TLS_SCHEME, PLAINTEXT_SCHEME = "tls://", "plaintext://"


def split_scheme(address: str) -> tuple[str, bool | None]:
    """``(host:port, tls)``: tls is True or False when the address names a scheme, None for the default."""
    for scheme, tls in ((TLS_SCHEME, True), (PLAINTEXT_SCHEME, False)):
        if address.startswith(scheme):
            return address[len(scheme):], tls
    return address, None


def make_channel(address: str, tls: ClientTls | None = None, options: ChannelOptions = ()) -> grpc.aio.Channel:
    """An aio channel to ``address`` (glmimage.wire.channels, with the shared keepalive): TLS when ``tls`` is given or
    the address says ``tls://``, plaintext when it says ``plaintext://`` or no TLS is configured."""
    target, wanted = split_scheme(address)
    if wanted is True and tls is None:
        tls = ClientTls()  # the system roots
    if wanted is False or tls is None or (wanted is None and tls.only_marked):
        return aio_channel(target, None, options)
    return aio_channel(target, tls.config(), options)


def add_server_tls_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls-cert", type=Path, default=None, metavar="PEM",
                   help="serve TLS with this certificate chain (needs --tls-key); plaintext when unset")
    p.add_argument("--tls-key", type=Path, default=None, metavar="PEM", help="private key of --tls-cert")
    p.add_argument("--tls-client-ca", type=Path, default=None, metavar="PEM",
                   help="require client certificates signed by this CA (mutual TLS)")


def server_tls_from_args(args: argparse.Namespace) -> ServerTls | None:
    cert, key, ca = args.tls_cert, args.tls_key, args.tls_client_ca
    if cert is None and key is None:
        if ca is not None:
            raise SystemExit("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    if cert is None or key is None:
        raise SystemExit("TLS needs both --tls-cert and --tls-key")
    return ServerTls(cert=cert, key=key, client_ca=ca)


def client_tls_args() -> argparse.ArgumentParser:
    """Flags of a process that dials other gRPC servers; use as an argparse parent."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--tls-ca", type=Path, default=None, metavar="PEM",
                   help="dial upstream servers over TLS, trusting this CA; plaintext when no --tls-ca* flag is set")
    p.add_argument("--tls-client-cert", type=Path, default=None, metavar="PEM",
                   help="client certificate for upstream servers that require mutual TLS")
    p.add_argument("--tls-client-key", type=Path, default=None, metavar="PEM")
    p.add_argument("--tls-server-name", default=None,
                   help="name to verify upstream certificates against instead of the dialled host")
    p.add_argument("--tls-only-marked", action="store_true",
                   help="use the --tls-* settings only for upstream addresses written tls://HOST:PORT; bare "
                        "addresses stay plaintext (plaintext://HOST:PORT is always plaintext)")
    return p


def client_tls_from_args(args: argparse.Namespace) -> ClientTls | None:
    if not any((args.tls_ca, args.tls_client_cert, args.tls_client_key, args.tls_server_name)):
        return None
    try:
        return ClientTls(ca=args.tls_ca, cert=args.tls_client_cert, key=args.tls_client_key,
                         server_name=args.tls_server_name, only_marked=args.tls_only_marked)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
