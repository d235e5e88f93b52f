"""The versioned endpoint snapshot every xDS stream serves, its EDS resources, and fan-out."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from envoy.config.core.v3 import address_pb2, health_check_pb2
from envoy.config.endpoint.v3 import endpoint_components_pb2, endpoint_pb2
from google.protobuf import any_pb2

from tokenmesh.common.pools import pool_of_cluster
from tokenmesh.controlplane.endpoints import Endpoint, Snapshot, normalized

log = logging.getLogger(__name__)

EDS_TYPE_URL = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"


def cluster_load_assignment(cluster: str, endpoints: Collection[Endpoint]) -> Any:
    """The EDS resource of one cluster: one locality, each endpoint with the health its
    source reported (Envoy skips UNHEALTHY ones and still runs its own active checks)."""
    healthy = health_check_pb2.HEALTHY
    unhealthy = health_check_pb2.UNHEALTHY
    return endpoint_pb2.ClusterLoadAssignment(
        cluster_name=cluster,
        endpoints=[
            endpoint_components_pb2.LocalityLbEndpoints(
                lb_endpoints=[
                    endpoint_components_pb2.LbEndpoint(
                        endpoint=endpoint_components_pb2.Endpoint(
                            address=address_pb2.Address(
                                socket_address=address_pb2.SocketAddress(
                                    address=endpoint.host, port_value=endpoint.port
                                )
                            )
                        ),
                        health_status=healthy if endpoint.healthy else unhealthy,
                    )
                    for endpoint in endpoints
                ]
            )
        ]
        if endpoints
        else [],
    )


def packed(resource: Any) -> any_pb2.Any:
    message = any_pb2.Any()
    message.Pack(resource)
    return message


@dataclass(frozen=True)
class VersionedSnapshot:
    """One endpoint set with its version and its EDS resources, built once for all streams."""

    version: str
    clusters: Snapshot
    resources: Mapping[str, any_pb2.Any] = field(repr=False)

    @classmethod
    def build(cls, version: str, clusters: Snapshot) -> VersionedSnapshot:
        resources = {
            name: packed(cluster_load_assignment(name, endpoints))
            for name, endpoints in clusters.items()
        }
        return cls(version, clusters, resources)

    def resources_for(self, names: Collection[str]) -> list[any_pb2.Any]:
        """The resources of the named clusters; empty names mean every cluster (wildcard).
        A name with no endpoints at all gets an empty assignment, so Envoy finishes warming
        that cluster at once instead of waiting out its initial fetch timeout."""
        if not names or "*" in names:
            return [self.resources[name] for name in sorted(self.resources)]
        return [
            self.resources.get(name) or packed(cluster_load_assignment(name, ()))
            for name in sorted(names)
        ]


class Mailbox:
    """A stream's queue of snapshots, bounded at one: a new snapshot replaces an unread one,
    so the cache never waits for a stream and a slow stream skips to the newest version."""

    def __init__(self) -> None:
        self._item: VersionedSnapshot | None = None
        self._ready = asyncio.Event()
        self._closed = False

    def put(self, snapshot: VersionedSnapshot) -> None:
        self._item = snapshot
        self._ready.set()

    def close(self) -> None:
        self._closed = True
        self._ready.set()

    async def get(self) -> VersionedSnapshot | None:
        """The newest unread snapshot, or None once closed."""
        await self._ready.wait()
        self._ready.clear()
        if self._closed:
            return None
        item, self._item = self._item, None
        return item


class SnapshotCache:
    """The current endpoint snapshot. Versions are a counter that increases by one whenever
    the endpoint set changes (so "7" is newer than "6" within a process; Envoy treats them as
    opaque, and a restarted control plane starting again at "1" is fine). Setting an equal set
    is a no-op: no new version, no push."""

    def __init__(self, on_update: Callable[[VersionedSnapshot], None] = lambda _: None) -> None:
        self._current: VersionedSnapshot | None = None
        self._counter = 0
        self._mailboxes: set[Mailbox] = set()
        self._on_update = on_update
        self._closed = False
        self.loaded = asyncio.Event()

    @property
    def current(self) -> VersionedSnapshot | None:
        return self._current

    def update(self, clusters: Mapping[str, Collection[Endpoint]]) -> bool:
        """Make clusters the current set; True when that is a change (a new version, pushed)."""
        clean = normalized(clusters)
        if self._current is not None and self._current.clusters == clean:
            return False
        self._counter += 1
        snapshot = VersionedSnapshot.build(str(self._counter), clean)
        self._current = snapshot
        self.loaded.set()
        self._on_update(snapshot)
        log.info(
            "endpoint snapshot",
            extra={
                "version": snapshot.version,
                "clusters": {name: [str(e) for e in eps] for name, eps in clean.items()},
            },
        )
        for mailbox in self._mailboxes:
            mailbox.put(snapshot)
        return True

    @contextmanager
    def subscribe(self) -> Iterator[Mailbox]:
        """A mailbox receiving every later snapshot until the block exits (or close())."""
        mailbox = Mailbox()
        if self._closed:
            mailbox.close()
        self._mailboxes.add(mailbox)
        try:
            yield mailbox
        finally:
            self._mailboxes.discard(mailbox)

    def close(self) -> None:
        """End every stream's subscription (on shutdown), and any made later."""
        self._closed = True
        for mailbox in self._mailboxes:
            mailbox.close()


def worker_addresses(cache: SnapshotCache) -> dict[str, str]:
    """Every worker pool's addresses in the current endpoint snapshot, each with its pool ("":
    the default pool's cluster `worker`); none before the first snapshot."""
    current = cache.current
    if current is None:
        return {}
    return {
        str(endpoint): pool
        for cluster, endpoints in current.clusters.items()
        if (pool := pool_of_cluster(cluster)) is not None
        for endpoint in endpoints
    }
