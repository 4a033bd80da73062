"""Worker membership from DNS: a name whose A/AAAA records list the workers (a Kubernetes headless Service).

The name is re-resolved every ``interval`` seconds; new addresses are added, vanished ones removed (the
scheduler drains them: the current job finishes, nothing new is sent). Only addresses this watcher added itself
are ever removed by it, so a static or admin-added worker that DNS also lists is left alone.
"""
from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from gateway.scheduler import WorkerRole
from services.runtime.tls import PLAINTEXT_SCHEME, TLS_SCHEME, split_scheme

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
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise ValueError(f"port must be a number in 1-65535, got {port_text!r}")
    if not host or any(c.isspace() for c in host):
        raise ValueError(f"bad host {host!r}")
    return host, int(port_text)


def join_host_port(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


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
