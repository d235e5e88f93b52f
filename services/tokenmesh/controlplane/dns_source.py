"""Endpoints from DNS: each cluster's name resolved to its A/AAAA records, polled.

Made for Kubernetes headless Services: their DNS name resolves to the IPs of the ready pods
behind them (and to nothing at all when none is ready), so polling it gives Envoy every
replica as its own endpoint and per-stream balancing keeps working (a Service VIP would be one
endpoint, balanced per connection by kube-proxy).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

from tokenmesh.controlplane.endpoints import (
    Endpoint,
    Snapshot,
    check_ip,
    check_port,
    normalized,
)

log = logging.getLogger(__name__)

# host -> its IP addresses (empty when the name does not exist: no ready pod); raises OSError
# when the resolver itself fails.
Resolver = Callable[[str], Awaitable[list[str]]]

# getaddrinfo errors that mean "this name has no addresses", not "DNS is broken": a headless
# Service with no ready pod answers NXDOMAIN, which must empty the cluster, not keep stale IPs.
NO_SUCH_NAME = frozenset(
    code
    for code in (
        socket.EAI_NONAME,
        getattr(socket, "EAI_NODATA", None),
        getattr(socket, "EAI_ADDRFAMILY", None),
    )
    if code is not None
)


async def resolve(host: str) -> list[str]:
    """The host's IPv4/IPv6 addresses through the system resolver (getaddrinfo, in a thread)."""
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        if exc.errno in NO_SUCH_NAME:
            return []
        raise
    return [str(info[4][0]) for info in infos]


def parse_target(cluster: str, target: str) -> tuple[str, int]:
    """ "name:port" -> (name, port); ValueError naming the cluster otherwise."""
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"dns target of {cluster!r}: {target!r} is not host:port")
    return host, check_port(int(port))


class DnsSource:
    """Resolves every cluster's DNS name each poll and yields a snapshot when any address set
    changed (the first once every name has been resolved). A name that cannot be resolved
    (resolver error, not a missing name) keeps its last known endpoints and is retried on the
    next poll."""

    def __init__(
        self,
        targets: Mapping[str, str],
        poll_seconds: float,
        resolver: Resolver = resolve,
        on_error: Callable[[], None] = lambda: None,
    ) -> None:
        self._targets = {name: parse_target(name, target) for name, target in targets.items()}
        self._poll_seconds = poll_seconds
        self._resolver = resolver
        self._on_error = on_error
        self._known: dict[str, list[Endpoint]] = {}

    async def _resolve_cluster(self, name: str, host: str, port: int) -> None:
        try:
            addresses = await self._resolver(host)
        except OSError as exc:
            self._on_error()
            log.warning(
                "dns lookup failed; keeping the last known endpoints",
                extra={"cluster": name, "host": host, "error": str(exc)},
            )
            return
        endpoints = []
        for address in addresses:
            try:
                endpoints.append(Endpoint(check_ip(address), port))
            except ValueError:  # not an IP: Envoy would reject it
                log.warning("skipping an unusable address", extra={"address": address})
        self._known[name] = endpoints

    async def snapshots(self) -> AsyncIterator[Snapshot]:
        last: Snapshot | None = None
        while True:
            await asyncio.gather(
                *(
                    self._resolve_cluster(name, host, port)
                    for name, (host, port) in self._targets.items()
                )
            )
            if len(self._known) == len(self._targets):
                snapshot = normalized(self._known)
                if snapshot != last:
                    last = snapshot
                    log.info(
                        "dns endpoints changed",
                        extra={"endpoints": {name: len(eps) for name, eps in snapshot.items()}},
                    )
                    yield snapshot
            await asyncio.sleep(self._poll_seconds)
