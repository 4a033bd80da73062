"""Worker membership from DNS: a name whose A/AAAA records list the workers (a Kubernetes headless Service).

The name is re-resolved every ``interval`` seconds; new addresses are added, vanished ones removed (the
scheduler drains them: the current job finishes, nothing new is sent). Only addresses this watcher added itself
are ever removed by it, so a static or admin-added worker that DNS also lists is left alone.

Also the address rules of the AddWorker RPC: ``parse_worker_address`` (what a well-formed worker address is) and
``AllowRule`` (the operator's ``--worker-allow`` patterns an added address must match).
"""
from __future__ import annotations

import asyncio
import ipaddress
import logging
import re
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from gateway.scheduler.types import WorkerRole
from runtime.tls import PLAINTEXT_SCHEME, TLS_SCHEME, split_scheme

log = logging.getLogger(__name__)

Resolver = Callable[[str, int], Awaitable[frozenset[str]]]


def split_host_port(target: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port``, optionally behind ``tls://`` or ``plaintext://`` -> (host, port); ValueError
    naming what is wrong."""
    host, sep, port_text = split_scheme(target.strip())[0].rpartition(":")
    if not sep or not host:
        raise ValueError(f"expected HOST:PORT, got {target!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"put an IPv6 address in brackets, as [{host}]:{port_text}")
    if not (port_text.isascii() and port_text.isdigit()) or not 1 <= int(port_text) <= 65535:
        raise ValueError(f"port must be a number in 1-65535, got {port_text!r}")
    if not host or any(c.isspace() for c in host):
        raise ValueError(f"bad host {host!r}")
    return host, int(port_text)


def join_host_port(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
MAX_HOST_CHARS = 253  # the longest DNS name
_LABEL = re.compile(r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?")  # one DNS label, at most 63 characters


@dataclass(frozen=True)
class WorkerAddress:
    """A worker address as AddWorker accepts it: a DNS name or an IP literal (``ip`` set), and a port, maybe
    behind a ``tls://`` or ``plaintext://`` scheme that says how to dial it (runtime.tls.make_channel)."""

    host: str  # lower case; an IPv6 literal without brackets
    port: int
    ip: IpAddress | None = None
    scheme: str = ""  # TLS_SCHEME, PLAINTEXT_SCHEME, or "": the gateway's default

    @property
    def target(self) -> str:
        """The canonical ``[scheme]host:port`` (``[v6]:port``) the gateway dials and lists the worker under."""
        return self.scheme + join_host_port(self.host, self.port)

    @property
    def spellings(self) -> tuple[str, ...]:
        """Its target under every scheme: one worker, however it is dialled."""
        return tuple(scheme + join_host_port(self.host, self.port) for scheme in ("", TLS_SCHEME, PLAINTEXT_SCHEME))


def _ip(text: str) -> IpAddress | None:
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped  # ::ffff:10.0.0.1 is 10.0.0.1, for the allow-list as for the socket
    return ip


def parse_worker_address(text: str) -> WorkerAddress:
    """Strict ``[tls://|plaintext://]host:port`` parsing for addresses a caller asks the gateway to dial; ValueError
    saying why. The scheme, as in ``--ar``/``--denoiser``, says how to dial it; the rules below are the host's.

    Refused: whitespace or control characters anywhere, a host over 253 characters or with a label over 63, a
    character outside letters, digits, ``-``, ``_`` and ``.``, an all-digit last label, IPv4 in a non-dotted-quad
    form (``127.1``, ``0x7f000001``: resolvers read those as addresses), an IPv6 zone id, the unspecified
    addresses (``0.0.0.0``, ``::``), multicast and broadcast, and a port outside 1-65535.
    """
    rest, _ = split_scheme(text)
    scheme, text = text[:len(text) - len(rest)], rest
    if len(text) > MAX_HOST_CHARS + 8:  # "[...]:65535"
        raise ValueError(f"longer than {MAX_HOST_CHARS + 8} characters ({len(text)})")
    if not text:
        raise ValueError("expected HOST:PORT, got ''")
    if "://" in text:
        raise ValueError(f"the only schemes are {TLS_SCHEME} and {PLAINTEXT_SCHEME} (lower case), got "
                         f"{text[:text.index('://') + 3]!r}")
    if any(c.isspace() or not c.isprintable() for c in text) or not text.isascii():
        raise ValueError(f"must be printable ASCII without whitespace: {text!r}")
    host, sep, port_text = text.rpartition(":")
    if not sep or not host:
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise ValueError(f"port must be a number in 1-65535, got {port_text!r}")
    port = int(port_text)
    if host.startswith("[") and host.endswith("]"):
        ip = _ip(host[1:-1]) if "%" not in host else None
        if ip is None or not isinstance(ipaddress.ip_address(host[1:-1]), ipaddress.IPv6Address):
            raise ValueError(f"{host} is not an IPv6 address (without a zone id)")
    elif ":" in host and _ip(host) is not None:
        raise ValueError(f"put an IPv6 address in brackets, as [{host}]:{port_text}")
    else:
        ip = _ip(host)
    if ip is not None:
        if ip.is_unspecified or ip.is_multicast or ip == ipaddress.IPv4Address("255.255.255.255"):
            raise ValueError(f"{ip} is not a worker's address (unspecified, multicast or broadcast)")
        return WorkerAddress(str(ip), port, ip, scheme)
    name = host.lower()
    if len(name) > MAX_HOST_CHARS:
        raise ValueError(f"host name is {len(name)} characters, more than {MAX_HOST_CHARS}")
    try:
        socket.inet_aton(name)
    except OSError:
        pass
    else:
        raise ValueError(f"{host!r} reads as an IPv4 address in a non-standard form; write it as a.b.c.d")
    labels = name.split(".")
    if not all(_LABEL.fullmatch(label) for label in labels):
        raise ValueError(f"bad host name {host!r}: labels of 1-63 letters, digits, '-' or '_', separated by '.'")
    if labels[-1].isdigit():
        raise ValueError(f"bad host name {host!r}: its last label is all digits")
    return WorkerAddress(name, port, scheme=scheme)


_PORTS = re.compile(r"(\d{1,5})(?:-(\d{1,5}))?")
_GLOB = re.compile(r"[a-z0-9_*?.-]+")


@dataclass(frozen=True)
class AllowRule:
    """One ``--worker-allow`` pattern.

    ``NAME-GLOB[:PORTS]``: a host name pattern, ``*`` standing for any run of characters within one DNS label
    (``*.denoiser.ns.svc.cluster.local`` matches ``10-0-0-7.denoiser.ns.svc.cluster.local``, not
    ``a.b.denoiser.ns.svc.cluster.local``), ``?`` for one character; names only, never IP literals.
    ``CIDR[:PORTS]`` or ``IP[:PORTS]`` (IPv6 in brackets when a port follows): IP literals in that network.
    ``PORTS`` is ``*`` (the default), ``N`` or ``N-M``.
    """

    text: str
    network: IpNetwork | None = None
    host: re.Pattern[str] | None = None
    ports: tuple[int, int] = (1, 65535)

    def matches(self, address: WorkerAddress) -> bool:
        if not self.ports[0] <= address.port <= self.ports[1]:
            return False
        if address.ip is not None:
            return self.network is not None and address.ip.version == self.network.version and \
                address.ip in self.network
        return self.host is not None and self.host.fullmatch(address.host) is not None


def _ports(text: str, rule: str) -> tuple[int, int]:
    if text == "*":
        return (1, 65535)
    m = _PORTS.fullmatch(text)
    low, high = (int(m.group(1)), int(m.group(2) or m.group(1))) if m else (0, 0)
    if not 1 <= low <= high <= 65535:
        raise ValueError(f"--worker-allow {rule!r}: the port must be *, N or N-M within 1-65535, got {text!r}")
    return low, high


def _network(text: str, rule: str) -> IpNetwork | None:
    try:
        net = ipaddress.ip_network(text, strict=True)
    except ValueError as exc:
        if "has host bits set" in str(exc):
            raise ValueError(f"--worker-allow {rule!r}: {exc} (did you mean "
                             f"{ipaddress.ip_network(text, strict=False)}?)") from None
        return None
    if isinstance(net, ipaddress.IPv6Network) and net.network_address.ipv4_mapped is not None:
        raise ValueError(f"--worker-allow {rule!r}: write IPv4-mapped addresses as IPv4 networks")
    return net


def parse_allow_rule(text: str) -> AllowRule:
    """A ``--worker-allow`` pattern (see AllowRule); ValueError saying what is wrong."""
    rule = text.strip()
    if not rule or any(c.isspace() for c in rule) or not rule.isascii():
        raise ValueError(f"--worker-allow {text!r}: expected NAME-GLOB[:PORTS], CIDR[:PORTS] or IP[:PORTS]")
    if rule.startswith("["):  # [v6 address or network] or [...]:PORTS
        inner, sep, rest = rule[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"--worker-allow {text!r}: expected [IPv6 address or network]:PORTS")
        net = _network(inner, rule)
        if net is None or net.version != 6:
            raise ValueError(f"--worker-allow {text!r}: {inner!r} is not an IPv6 address or network")
        return AllowRule(rule, network=net, ports=_ports(rest[1:], rule) if rest else (1, 65535))
    if (net := _network(rule, rule)) is not None:  # a whole address or network, no port (bare IPv6 too)
        return AllowRule(rule, network=net)
    host, sep, port_text = rule.rpartition(":")
    if not sep:
        host, port_text = rule, "*"
    ports = _ports(port_text, rule)
    if (net := _network(host, rule)) is not None:
        if net.version == 6:
            raise ValueError(f"--worker-allow {text!r}: put an IPv6 network in brackets before a port, as "
                             f"[{host}]:{port_text}")
        return AllowRule(rule, network=net, ports=ports)
    if "/" in host or ":" in host:
        raise ValueError(f"--worker-allow {text!r}: {host!r} is neither a network nor a host name pattern")
    name = host.lower()
    if not _GLOB.fullmatch(name) or len(name) > MAX_HOST_CHARS or any(not label for label in name.split(".")):
        raise ValueError(f"--worker-allow {text!r}: a host name pattern has letters, digits, '-', '_', '.', "
                         "'*' and '?'")
    if not re.search(r"[a-z0-9_-]", name):
        raise ValueError(f"--worker-allow {text!r}: a host name pattern must name at least one label (it can "
                         "never allow every name; networks such as 0.0.0.0/0 allow every IP literal)")
    if re.fullmatch(r"[0-9.*?]+", name):
        raise ValueError(f"--worker-allow {text!r}: IP addresses are matched by networks, not globs: write a CIDR "
                         "such as 10.0.0.0/24")
    pattern = "".join("[^.]*" if c == "*" else "[^.]" if c == "?" else re.escape(c) for c in name)
    return AllowRule(rule, host=re.compile(pattern), ports=ports)


def allowed(address: WorkerAddress, rules: tuple[AllowRule, ...]) -> AllowRule | None:
    """The first rule ``address`` matches, or None."""
    return next((r for r in rules if r.matches(address)), None)


async def resolve(host: str, port: int) -> frozenset[str]:
    """Every A and AAAA record of ``host``, as gRPC target addresses."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    out = set()
    for _family, _type, _proto, _canon, sockaddr in infos:
        ip = str(ipaddress.ip_address(sockaddr[0].split("%", 1)[0]))  # drop an IPv6 zone id
        out.add(join_host_port(ip, port))
    return frozenset(out)


@dataclass
class DnsMembership:
    host: str
    port: int
    role: WorkerRole
    add: Callable[[str, WorkerRole], bool]  # False: the address was already a member (not ours to remove)
    remove: Callable[[str], object]
    interval: float = 5.0
    resolver: Resolver = resolve
    known: set[str] = field(default_factory=set)  # the addresses this watcher added and still sees
    tls: bool | None = None  # the target's scheme, carried over to every address it resolves to

    @classmethod
    def from_target(cls, target: str, role: WorkerRole, add: Callable[[str, WorkerRole], bool],
                    remove: Callable[[str], object], interval: float = 5.0,
                    resolver: Resolver = resolve) -> DnsMembership:
        host, port = split_host_port(target)
        return cls(host, port, role, add, remove, interval, resolver, tls=split_scheme(target.strip())[1])

    async def refresh(self) -> None:
        """Resolve once and apply the difference."""
        try:
            prefix = {True: TLS_SCHEME, False: PLAINTEXT_SCHEME, None: ""}[self.tls]
            current = frozenset(prefix + a for a in await self.resolver(self.host, self.port))
        except OSError as exc:  # socket.gaierror included
            # A failed lookup says nothing about the workers (DNS hiccup): keep them; health decides.
            log.warning("resolving %s:%d failed (%s); keeping %d known %s worker(s)", self.host, self.port, exc,
                        len(self.known), self.role.value.lower())
            return
        for address in sorted(current - self.known):
            if self.add(address, self.role):
                log.info("DNS %s: %s worker %s appeared", self.host, self.role.value.lower(), address)
                self.known.add(address)
        for address in sorted(self.known - current):
            log.info("DNS %s: %s worker %s vanished; draining it", self.host, self.role.value.lower(), address)
            self.remove(address)
            self.known.discard(address)

    async def run(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.interval)
