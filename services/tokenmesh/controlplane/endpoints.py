"""Endpoints, full snapshots of them per cluster, and the interface every source implements."""

from __future__ import annotations

import ipaddress
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, order=True)
class Endpoint:
    """One upstream instance: an IP and port, and whether its source reports it healthy."""

    host: str
    port: int
    healthy: bool = True

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


# A complete endpoint set: cluster name -> its endpoints, sorted and without duplicates.
Snapshot = Mapping[str, tuple[Endpoint, ...]]


class EndpointSource(Protocol):
    """Anything that produces full endpoint snapshots: a new one whenever the set may have
    changed (repeats are harmless), running until cancelled. A source that cannot read its
    backend keeps quiet (and reports the error) rather than yielding an empty snapshot."""

    def snapshots(self) -> AsyncIterator[Snapshot]: ...


def check_ip(host: str) -> str:
    """host if it is an IPv4/IPv6 literal (EDS addresses are never resolved through DNS)."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        raise ValueError(f"{host!r} is not an IP address (EDS endpoints need IPs)") from None


def check_port(port: int) -> int:
    if not 1 <= port <= 65535:
        raise ValueError(f"port {port} is not in 1..65535")
    return port


def parse_address(text: str) -> tuple[str, int]:
    """ "10.0.0.1:50061" or "[::1]:50061" -> (host, port)."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"{text!r} is not IP:port")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"{text!r}: write IPv6 addresses as [ip]:port")
    return check_ip(host), check_port(int(port))


def normalized(clusters: Mapping[str, Iterable[Endpoint]]) -> dict[str, tuple[Endpoint, ...]]:
    """Sorted clusters with sorted endpoints, one per address (healthy if any report says so),
    so equal sets compare equal whatever order a source listed them in."""
    result: dict[str, tuple[Endpoint, ...]] = {}
    for name in sorted(clusters):
        by_address: dict[tuple[str, int], Endpoint] = {}
        for endpoint in clusters[name]:
            key = (endpoint.host, endpoint.port)
            seen = by_address.get(key)
            if seen is None or (endpoint.healthy and not seen.healthy):
                by_address[key] = endpoint
        result[name] = tuple(sorted(by_address.values()))
    return result
