"""Where webhooks may go: ``--webhook-allow`` patterns, checked when a job names a URL and again at each delivery.

A webhook URL is user input aimed at our own network (SSRF). Two checks close it:

- at submit, ``EgressPolicy.check_url``: scheme, no userinfo, a host some pattern admits, and a literal IP only
  where a pattern names it (an IP or a CIDR containing it);
- at delivery, ``EgressPolicy.resolve``: the host is resolved once, every address is checked (a hostname pattern
  admits only public addresses, a pattern naming an IP or CIDR admits the addresses it contains), and the sender
  connects to the checked address alone, so a DNS answer that changes between the check and the connection
  (rebinding) cannot steer it.

A pattern is ``[http://|https://]HOST[:PORT]``. HOST is a hostname glob (``*`` matches any run of characters, dots
included: ``*.example.com`` admits ``a.example.com`` and ``a.b.example.com``, not ``example.com``), an IP literal
(``10.1.2.3``, ``[fd00::1]``) or a CIDR (``10.0.0.0/8``, ``[fd00::/8]``). No PORT admits any port. The scheme is
https unless the pattern says ``http://``, which admits http and https (TLS is never the less safe of the two).
A hostname glob never admits a URL written with a literal IP: that takes an IP or CIDR pattern.
"""
from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

MAX_URL_LENGTH = 2048
OFF_MESSAGE = "webhooks are off on this gateway: start it with --webhook-allow PATTERN"
_DEFAULT_PORTS = {"https": 443, "http": 80}
_HOST_CHARS = re.compile(r"[a-z0-9_-]+(\.[a-z0-9_-]+)*")
_GLOB_CHARS = re.compile(r"[a-z0-9_*-]+(\.[a-z0-9_*-]+)*")
# URLs go through two parsers (urllib here, yarl in aiohttp); refusing what they might read differently
# (whitespace, controls, backslashes, non-ASCII) keeps the host this module checked the host aiohttp dials.
_URL_CHARS = re.compile(r"[!-~]+")
# NAT64 prefixes (RFC 6052, RFC 8215): the address is as public as the IPv4 address embedded in its low 32 bits.
_NAT64 = (ipaddress.IPv6Network("64:ff9b::/96"), ipaddress.IPv6Network("64:ff9b:1::/48"))


class EgressRefused(Exception):
    """A webhook URL this gateway will not call; ``message`` reads as an error on the webhook_url field."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class EgressUnresolved(Exception):
    """The host did not resolve (or not in time): a DNS failure may heal, so the delivery is tried again."""


def is_public(addr: IPAddress) -> bool:
    """An address on the public internet: not private, loopback, link-local, multicast, reserved, unspecified,
    shared (CGNAT), nor an IPv6 form that carries one of those (IPv4-mapped, Teredo, 6to4 or NAT64 of a
    non-public IPv4 address)."""
    if isinstance(addr, ipaddress.IPv6Address):
        if addr.ipv4_mapped is not None or addr.teredo is not None:
            return False
        if addr.sixtofour is not None:
            return is_public(addr.sixtofour)
        if any(addr in net for net in _NAT64):
            return is_public(ipaddress.IPv4Address(int(addr) & 0xFFFFFFFF))
    return addr.is_global and not (addr.is_private or addr.is_loopback or addr.is_link_local or addr.is_multicast
                                   or addr.is_reserved or addr.is_unspecified)


@dataclass(frozen=True)
class ParsedTarget:
    """A checked webhook URL, in the parts the sender uses."""
    url: str
    scheme: str  # "https" or "http"
    host: str  # lower-case ASCII hostname, or an IP address's text (IPv6 without brackets)
    port: int  # explicit, else the scheme's default
    path: str  # as written (percent-encoded), "" for none
    query: str  # without the "?"
    ip: IPAddress | None  # the URL names a literal IP

    @property
    def netloc_host(self) -> str:
        """The host as it is written in a URL (an IPv6 address in brackets)."""
        return f"[{self.host}]" if isinstance(self.ip, ipaddress.IPv6Address) else self.host


@dataclass(frozen=True)
class _Pattern:
    text: str
    schemes: frozenset[str]
    port: int | None  # None: any port
    glob: re.Pattern[str] | None  # hostname patterns
    network: IPNetwork | None  # IP (a /32 or /128) and CIDR patterns

    def admits_endpoint(self, scheme: str, port: int) -> bool:
        return scheme in self.schemes and (self.port is None or self.port == port)

    def admits_host(self, host: str) -> bool:
        return self.glob is not None and self.glob.fullmatch(host.rstrip(".")) is not None

    def contains(self, addr: IPAddress) -> bool:
        return self.network is not None and addr.version == self.network.version and addr in self.network


def _parse_pattern(text: str) -> _Pattern:
    def bad(why: str) -> ValueError:
        return ValueError(f"--webhook-allow {text!r}: {why} (a pattern is [http://|https://]HOST[:PORT], HOST a "
                          f"hostname glob such as *.example.com, an IP address or a CIDR)")

    rest = text.strip()
    schemes = frozenset({"https"})
    if "://" in rest:
        scheme, rest = rest.split("://", 1)
        if scheme.lower() == "http":
            schemes = frozenset({"http", "https"})
        elif scheme.lower() != "https":
            raise bad(f"scheme {scheme!r} is not http or https")
    if rest.endswith("/"):
        rest = rest[:-1]
    if not rest:
        raise bad("no host")
    port_text: str | None = None
    if rest.startswith("["):
        end = rest.find("]")
        if end < 0:
            raise bad("an unclosed [")
        host, after = rest[1:end], rest[end + 1:]
        if after:
            if not after.startswith(":"):
                raise bad(f"{after!r} after the address")
            port_text = after[1:]
        if ":" not in host:
            raise bad("brackets are for IPv6 addresses")
    elif rest.count(":") == 1:
        host, port_text = rest.split(":")
    else:
        host = rest  # an unbracketed IPv6 address or network names no port
    port: int | None = None
    if port_text is not None:
        if not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise bad(f"port {port_text!r} is not a number from 1 to 65535")
        port = int(port_text)
    if "/" in host and not _looks_like_ip(host.split("/", 1)[0]):
        raise bad("a pattern names no path")
    if "/" in host or _looks_like_ip(host):
        try:
            network = ipaddress.ip_network(host, strict=True)
        except ValueError as e:
            raise bad(f"{host!r} is not an IP address or network ({e})") from None
        return _Pattern(text, schemes, port, None, network)
    glob = host.lower().rstrip(".")
    if not _GLOB_CHARS.fullmatch(glob):
        raise bad(f"{host!r} is not a hostname glob (letters, digits, '-', '_', '.' and '*')")
    regex = re.compile("".join(r"[a-z0-9_.-]*" if c == "*" else re.escape(c) for c in glob))
    return _Pattern(text, schemes, port, regex, None)


def _looks_like_ip(host: str) -> bool:
    """An IP literal or a numeric form of one: a last label of digits (or 0x...) is no DNS name, and resolvers
    read "127.1" or "2130706433" as 127.0.0.1."""
    if ":" in host:
        return True
    last = host.rstrip(".").rsplit(".", 1)[-1].lower()
    return last.isdigit() or (last.startswith("0x") and all(c in "0123456789abcdef" for c in last[2:]))


@dataclass(frozen=True)
class EgressPolicy:
    patterns: tuple[_Pattern, ...]

    @classmethod
    def from_patterns(cls, patterns: Sequence[str]) -> EgressPolicy:
        """Parse ``--webhook-allow`` values; a bad one is a ValueError naming it."""
        return cls(tuple(_parse_pattern(p) for p in patterns))

    @property
    def enabled(self) -> bool:
        return bool(self.patterns)

    def check_url(self, url: str) -> ParsedTarget:
        """The submit-time check: EgressRefused with a message for the webhook_url field, else the URL's parts."""
        if not self.patterns:
            raise EgressRefused(OFF_MESSAGE)
        target = _parse_url(url)
        if not any(p.admits_endpoint(target.scheme, target.port) for p in self.patterns):
            if target.scheme == "http" and any(p.admits_endpoint("https", target.port) for p in self.patterns):
                raise EgressRefused("webhook_url must be an https URL")
            raise EgressRefused(f"webhook_url's {target.scheme} port {target.port} is not allowed by --webhook-allow")
        endpoint = [p for p in self.patterns if p.admits_endpoint(target.scheme, target.port)]
        if target.ip is not None:
            if not any(p.contains(target.ip) for p in endpoint):
                raise EgressRefused(f"webhook_url's address {target.ip} is not allowed by --webhook-allow"
                                    + ("" if is_public(target.ip) else " (a private, loopback, link-local or "
                                       "reserved address is called only where a pattern names it)"))
        elif not any(p.admits_host(target.host) for p in endpoint):
            raise EgressRefused(f"webhook_url's host {target.host} is not allowed by --webhook-allow")
        return target

    def address_allowed(self, target: ParsedTarget, addr: IPAddress) -> bool:
        """May the sender connect to ``addr`` for ``target``? A pattern naming an IP or CIDR that contains it, or,
        for a hostname a hostname pattern admitted, a public address."""
        endpoint = [p for p in self.patterns if p.admits_endpoint(target.scheme, target.port)]
        if any(p.contains(addr) for p in endpoint):
            return True
        return target.ip is None and is_public(addr) and any(p.admits_host(target.host) for p in endpoint)

    async def resolve(self, target: ParsedTarget, timeout: float = 5.0) -> IPAddress:
        """The delivery-time check: the address to connect to, the first allowed one of a single resolution.

        EgressRefused when no address is allowed (or the URL no longer passes ``check_url``: the patterns may have
        changed since the job was submitted); EgressUnresolved when the name did not resolve in ``timeout``."""
        target = self.check_url(target.url)
        if target.ip is not None:
            return target.ip
        loop = asyncio.get_running_loop()
        try:
            infos = await asyncio.wait_for(
                loop.getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP),
                timeout)
        except TimeoutError:
            raise EgressUnresolved(f"{target.host} did not resolve within {timeout:g}s") from None
        except OSError as e:
            raise EgressUnresolved(f"{target.host} did not resolve: {e}") from None
        refused: list[str] = []
        for family, _, _, _, sockaddr in infos:
            if family not in (socket.AF_INET, socket.AF_INET6):
                continue
            addr = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])  # a scope id says nothing of the range
            if self.address_allowed(target, addr):
                return addr
            refused.append(str(addr))
        raise EgressRefused(f"webhook_url's host {target.host} resolves to {', '.join(refused) or 'no address'}, "
                            f"which --webhook-allow does not allow (a hostname pattern admits only public addresses)")


def _parse_url(url: str) -> ParsedTarget:
    if len(url) > MAX_URL_LENGTH:
        raise EgressRefused(f"webhook_url is longer than {MAX_URL_LENGTH} characters")
    if not _URL_CHARS.fullmatch(url) or "\\" in url:
        raise EgressRefused("webhook_url must be printable ASCII without spaces or backslashes "
                            "(percent-encode the path; write an international host in its xn-- form)")
    try:
        parts = urlsplit(url)
        port = parts.port
        host = parts.hostname
    except ValueError as e:
        raise EgressRefused(f"webhook_url is not a valid URL ({e})") from None
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS:
        raise EgressRefused("webhook_url must be an https URL")
    if "@" in parts.netloc:
        raise EgressRefused("webhook_url must not carry a user name or password")
    if parts.fragment or url.endswith("#"):
        raise EgressRefused("webhook_url must not have a fragment (#...)")
    if not host:
        raise EgressRefused("webhook_url has no host")
    if port == 0:
        raise EgressRefused("webhook_url's port must be from 1 to 65535")
    ip: IPAddress | None = None
    if ":" in host or _looks_like_ip(host):
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            raise EgressRefused(f"webhook_url's host {host!r} is neither a hostname nor a canonical IP address") \
                from None
        if isinstance(ip, ipaddress.IPv6Address) and ip.scope_id:
            raise EgressRefused("webhook_url must not name an IPv6 zone")
        host = str(ip)
        if "[" not in parts.netloc and isinstance(ip, ipaddress.IPv6Address):
            raise EgressRefused("webhook_url must write an IPv6 address in brackets")
    elif not _HOST_CHARS.fullmatch(host.rstrip(".")) or len(host) > 253 \
            or any(len(label) > 63 for label in host.split(".")):
        raise EgressRefused(f"webhook_url's host {host!r} is not a valid hostname")
    return ParsedTarget(url=url, scheme=scheme, host=host, port=port or _DEFAULT_PORTS[scheme], path=parts.path,
                        query=parts.query, ip=ip)
