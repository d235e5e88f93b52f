"""One state-of-the-world xDS stream: subscriptions, ACK/NACK by nonce, pushes on change."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from envoy.service.discovery.v3 import discovery_pb2

from tokenmesh.controlplane.metrics import ControlPlaneMetrics
from tokenmesh.controlplane.snapshots import EDS_TYPE_URL, SnapshotCache, VersionedSnapshot

log = logging.getLogger(__name__)

SERVED_TYPE_URLS = frozenset({EDS_TYPE_URL})


@dataclass
class Subscription:
    """What one stream asked for of one type, and what it was last sent."""

    names: frozenset[str]
    # Version and nonce of the last response sent ("" before the first one).
    sent_version: str = ""
    sent_nonce: str = ""
    # The serialized resources last sent, to skip pushes that would change nothing for them.
    sent_content: tuple[bytes, ...] | None = None
    # The last version Envoy ACKed, and the last one it NACKed.
    acked_version: str = ""
    rejected_version: str = ""


class DiscoverySession:
    """The protocol of one stream (ADS, or EDS alone with default_type_url set).

    A request carrying the nonce of the last response sent is its ACK (or, with error_detail,
    its NACK: logged, counted, not resent; Envoy keeps the config it had, and the next change
    is pushed as usual). A request with any older nonce is stale and ignored: a newer
    response is already on its way. A request that changes the subscribed names, or a first
    request (no nonce), is answered at once. A new snapshot is pushed to every subscription
    whose resources it changes, without waiting for the previous ACK (allowed by the
    protocol; Envoy applies responses in order).
    """

    def __init__(
        self,
        cache: SnapshotCache,
        metrics: ControlPlaneMetrics,
        peer: str,
        default_type_url: str = "",
    ) -> None:
        self._cache = cache
        self._metrics = metrics
        self._peer = peer
        self._default_type_url = default_type_url
        self._subscriptions: dict[str, Subscription] = {}
        self._nonces = itertools.count(1)
        self._node = ""
        self._ignored_types: set[str] = set()

    @property
    def subscriptions(self) -> dict[str, Subscription]:
        return self._subscriptions

    def on_request(self, request: Any) -> Any | None:
        """The response a DiscoveryRequest calls for, if any."""
        if request.HasField("node") and not self._node:
            self._node = request.node.id
            log.info("xds stream opened", extra={"node": self._node, "peer": self._peer})
        type_url = request.type_url or self._default_type_url
        if type_url not in SERVED_TYPE_URLS:
            if type_url not in self._ignored_types:
                self._ignored_types.add(type_url)
                log.warning(
                    "ignoring requests for a type this control plane does not serve",
                    extra={"type_url": type_url, "node": self._node},
                )
            return None
        names = frozenset(request.resource_names)
        subscription = self._subscriptions.get(type_url)
        if request.response_nonce and subscription is not None:
            if request.response_nonce != subscription.sent_nonce:
                self._metrics.stale.inc()
                log.debug(
                    "stale xds request ignored",
                    extra={"nonce": request.response_nonce, "latest": subscription.sent_nonce},
                )
                return None
            self._acknowledge(subscription, request)
            if names == subscription.names:
                return None
        if subscription is None:
            subscription = self._subscriptions[type_url] = Subscription(names)
        subscription.names = names
        return self._respond(type_url, subscription, "request", force=True)

    def on_snapshot(self, snapshot: VersionedSnapshot) -> list[Any]:
        """Responses pushing snapshot to every subscription whose resources it changes."""
        responses = []
        for type_url, subscription in self._subscriptions.items():
            if subscription.sent_version == snapshot.version:
                continue
            response = self._respond(type_url, subscription, "update", force=False)
            if response is not None:
                responses.append(response)
        return responses

    def _acknowledge(self, subscription: Subscription, request: Any) -> None:
        if request.HasField("error_detail"):
            self._metrics.nacks.inc()
            subscription.rejected_version = subscription.sent_version
            log.warning(
                "envoy rejected endpoints (NACK); it keeps its last accepted version",
                extra={
                    "node": self._node,
                    "rejected_version": subscription.sent_version,
                    "kept_version": request.version_info,
                    "error": request.error_detail.message,
                },
            )
        elif request.version_info == subscription.sent_version:
            self._metrics.acks.inc()
            subscription.acked_version = request.version_info

    def _respond(
        self, type_url: str, subscription: Subscription, reason: str, force: bool
    ) -> Any | None:
        snapshot = self._cache.current
        if snapshot is None:
            return None  # answered when the first snapshot arrives
        resources = snapshot.resources_for(subscription.names)
        content = tuple(resource.value for resource in resources)
        if not force and content == subscription.sent_content:
            return None
        subscription.sent_version = snapshot.version
        subscription.sent_nonce = str(next(self._nonces))
        subscription.sent_content = content
        self._metrics.pushes.labels(reason).inc()
        log.debug(
            "xds push",
            extra={
                "node": self._node,
                "version": snapshot.version,
                "nonce": subscription.sent_nonce,
                "reason": reason,
                "resources": sorted(subscription.names),
            },
        )
        return discovery_pb2.DiscoveryResponse(
            version_info=snapshot.version,
            resources=resources,
            type_url=type_url,
            nonce=subscription.sent_nonce,
        )

    async def responses(self, requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
        """Serve the stream: answer requests and push snapshots until the client half-closes,
        the RPC is cancelled, or the cache is closed (shutdown)."""
        self._metrics.streams.inc()
        with self._cache.subscribe() as mailbox:
            next_request = asyncio.ensure_future(anext(requests))
            next_snapshot = asyncio.ensure_future(mailbox.get())
            try:
                while True:
                    await asyncio.wait(
                        {next_request, next_snapshot}, return_when=asyncio.FIRST_COMPLETED
                    )
                    if next_request.done():
                        try:
                            request = next_request.result()
                        except StopAsyncIteration:
                            return
                        response = self.on_request(request)
                        if response is not None:
                            yield response
                        next_request = asyncio.ensure_future(anext(requests))
                    if next_snapshot.done():
                        snapshot = next_snapshot.result()
                        if snapshot is None:
                            return  # shutting down: Envoy keeps its endpoints, reconnects
                        for response in self.on_snapshot(snapshot):
                            yield response
                        next_snapshot = asyncio.ensure_future(mailbox.get())
            finally:
                next_request.cancel()
                next_snapshot.cancel()
                self._metrics.streams.dec()
                log.info("xds stream closed", extra={"node": self._node, "peer": self._peer})
