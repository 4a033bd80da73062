"""The one client-side channel builder of the suite: plaintext or TLS (CA, client certificate for mutual TLS,
a target name override), with the shared keepalive and reconnect settings (glmimage.wire.keepalive), as a blocking or
an asyncio channel. The SDK's clients, the REST front's gateway channel and the gateway's worker channels are all
built here; the servers' side of TLS is runtime.tls."""
from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from glmimage.wire.keepalive import CLIENT_OPTIONS

ChannelOptions = Sequence[tuple[str, Any]]


@dataclass(frozen=True)
class TlsConfig:
    """TLS settings. PEM bytes; no ``root_ca`` means the system trust store. Give both cert and key for mTLS."""

    root_ca: bytes | None = None
    client_cert: bytes | None = None
    client_key: bytes | None = None
    # Name to check the server certificate against when it differs from the dialled host (e.g. an IP, or pod IPs
    # resolved from a headless Service with a certificate issued for the Service name).
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.client_cert is None) != (self.client_key is None):
            raise ValueError("give both client_cert and client_key, or neither")

    @classmethod
    def from_files(cls, root_ca: str | Path | None = None, client_cert: str | Path | None = None,
                   client_key: str | Path | None = None, server_name: str | None = None) -> TlsConfig:
        """Reads the PEM files now, so a bad path fails here rather than on the first call."""
        def read(p: str | Path | None) -> bytes | None:
            return Path(p).read_bytes() if p else None

        return cls(read(root_ca), read(client_cert), read(client_key), server_name)

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.root_ca, self.client_key, self.client_cert)


def channel_options(tls: TlsConfig | None = None, options: ChannelOptions = ()) -> list[tuple[str, Any]]:
    """What a channel is given: the shared keepalive settings, the TLS name override, then ``options`` (the hop's
    own, e.g. message sizes). grpc lets a later argument override an earlier one, so ``options`` win."""
    override = [("grpc.ssl_target_name_override", tls.server_name)] if tls is not None and tls.server_name else []
    return [*CLIENT_OPTIONS, *override, *options]


def sync_channel(target: str, tls: TlsConfig | None = None, options: ChannelOptions = ()) -> grpc.Channel:
    """A blocking channel to ``target``: TLS when ``tls`` is given, plaintext otherwise."""
    return _build(grpc, target, tls, options)


def aio_channel(target: str, tls: TlsConfig | None = None, options: ChannelOptions = ()) -> grpc.aio.Channel:
    """As `sync_channel`, for asyncio; create it in the event loop that uses it."""
    return _build(grpc.aio, target, tls, options)


def _build(api: Any, target: str, tls: TlsConfig | None, options: ChannelOptions) -> Any:
    # grpc and grpc.aio spell both constructors the same way.
    opts = channel_options(tls, options)
    if tls is None:
        return api.insecure_channel(target, options=opts)
    return api.secure_channel(target, tls.credentials(), options=opts)


# grpc's own round robin over every address a target resolves to (the default, pick_first, sticks to one).
ROUND_ROBIN_CONFIG = '{"loadBalancingConfig":[{"round_robin":{}}]}'
_RESOLVER_SCHEMES = ("dns:", "ipv4:", "ipv6:", "unix:", "xds:")
# Schemes whose target may name several addresses: they get round_robin.
_MULTI_SCHEMES = ("dns:", "ipv4:", "ipv6:")


def split_addresses(address: str | Sequence[str]) -> list[str]:
    """The gateway addresses in ``address``: a list, or a comma-separated string. A target with a resolver
    scheme (``dns:///name:port``, ``ipv4:a:p,b:p``) stays whole: grpc resolves it, commas included."""
    items = [address] if isinstance(address, str) else list(address)
    out: list[str] = []
    for item in items:
        item = item.strip()
        if item.startswith(_RESOLVER_SCHEMES):
            out.append(item)
        else:
            out.extend(a.strip() for a in item.split(",") if a.strip())
    if not out:
        raise ValueError(f"no gateway address in {address!r}")
    return out


def balanced_target(address: str | Sequence[str]) -> tuple[str, list[tuple[str, Any]]]:
    """One grpc target for ``address`` and the channel options it needs: several IP addresses become one
    ``ipv4:``/``ipv6:`` target, and a target that may resolve to several addresses gets round_robin, so the
    calls (and the retries after an UNAVAILABLE) spread over them. One plain host:port is left as it is."""
    addrs = split_addresses(address)
    if len(addrs) == 1:
        target = addrs[0]
    elif all(not a.startswith(_RESOLVER_SCHEMES) and _ip_version(a) == 4 for a in addrs):
        target = "ipv4:" + ",".join(addrs)
    elif all(not a.startswith(_RESOLVER_SCHEMES) and _ip_version(a) == 6 for a in addrs):
        target = "ipv6:" + ",".join(addrs)
    else:  # grpc has no target naming several host names, nor mixing families
        raise ValueError(f"several addresses must all be IPv4 or all IPv6 host:port literals, not {addrs}; "
                         "for a name resolving to several gateways give one dns:///name:port")
    if target.startswith(_MULTI_SCHEMES):
        return target, [("grpc.service_config", ROUND_ROBIN_CONFIG)]
    return target, []


def _ip_version(host_port: str) -> int | None:
    host = host_port.rsplit(":", 1)[0].strip("[]")
    try:
        return ipaddress.ip_address(host).version
    except ValueError:
        return None
