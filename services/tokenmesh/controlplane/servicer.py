"""ADS and EDS RPC handlers: each stream is one DiscoverySession over the shared cache."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from envoy.service.endpoint.v3 import eds_pb2_grpc
from grpc import aio

from tokenmesh.common.errors import ServiceError, Unavailable
from tokenmesh.controlplane.discovery import DiscoverySession
from tokenmesh.controlplane.metrics import ControlPlaneMetrics
from tokenmesh.controlplane.snapshots import EDS_TYPE_URL, SnapshotCache


class Unimplemented(ServiceError):
    code = grpc.StatusCode.UNIMPLEMENTED


DELTA_UNSUPPORTED = "incremental (delta) xDS is not served: use api_type GRPC (state of the world)"


class AggregatedDiscoveryServicer(ads_pb2_grpc.AggregatedDiscoveryServiceServicer):
    """envoy.service.discovery.v3.AggregatedDiscoveryService: every type on one stream (only
    EDS is served; requests for other types are logged and ignored)."""

    def __init__(self, cache: SnapshotCache, metrics: ControlPlaneMetrics) -> None:
        self._cache = cache
        self._metrics = metrics

    async def StreamAggregatedResources(
        self, request_iterator: AsyncIterator[Any], context: aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[Any]:
        session = DiscoverySession(self._cache, self._metrics, context.peer())
        async for response in session.responses(request_iterator):
            yield response

    async def DeltaAggregatedResources(
        self, request_iterator: AsyncIterator[Any], context: aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[Any]:
        raise Unimplemented(DELTA_UNSUPPORTED)
        yield  # an async generator, as the interceptors expect of streaming handlers


class EndpointDiscoveryServicer(eds_pb2_grpc.EndpointDiscoveryServiceServicer):
    """envoy.service.endpoint.v3.EndpointDiscoveryService: EDS alone, same protocol."""

    def __init__(self, cache: SnapshotCache, metrics: ControlPlaneMetrics) -> None:
        self._cache = cache
        self._metrics = metrics

    async def StreamEndpoints(
        self, request_iterator: AsyncIterator[Any], context: aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[Any]:
        session = DiscoverySession(
            self._cache, self._metrics, context.peer(), default_type_url=EDS_TYPE_URL
        )
        async for response in session.responses(request_iterator):
            yield response

    async def DeltaEndpoints(
        self, request_iterator: AsyncIterator[Any], context: aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[Any]:
        raise Unimplemented(DELTA_UNSUPPORTED)
        yield  # an async generator, as the interceptors expect of streaming handlers

    async def FetchEndpoints(self, request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
        """One-shot (REST-style) fetch of the current endpoints: handy with grpcurl."""
        snapshot = self._cache.current
        if snapshot is None:
            raise Unavailable("no endpoint snapshot loaded yet")
        return discovery_pb2.DiscoveryResponse(
            version_info=snapshot.version,
            resources=snapshot.resources_for(frozenset(request.resource_names)),
            type_url=EDS_TYPE_URL,
        )
