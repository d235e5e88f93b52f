"""A minimal state-of-the-world xDS client for tests: speaks DiscoveryRequest/Response on an
ADS (or EDS) stream the way Envoy does, and decodes ClusterLoadAssignments."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from envoy.config.core.v3 import health_check_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from envoy.service.endpoint.v3 import eds_pb2_grpc
from google.rpc import status_pb2
from grpc import aio

EDS = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"

# cluster -> [(ip, port, "HEALTHY"/"UNHEALTHY"), ...]
Endpoints = dict[str, list[tuple[str, int, str]]]


def decode(response: Any) -> Endpoints:
    result: Endpoints = {}
    for resource in response.resources:
        assignment = endpoint_pb2.ClusterLoadAssignment()
        assert resource.Unpack(assignment), resource.type_url
        result[assignment.cluster_name] = [
            (
                lb.endpoint.address.socket_address.address,
                lb.endpoint.address.socket_address.port_value,
                health_check_pb2.HealthStatus.Name(lb.health_status),
            )
            for locality in assignment.endpoints
            for lb in locality.lb_endpoints
        ]
    return result


class XdsClient:
    """One stream; responses are read in the background into a queue so a test can wait for
    one with a timeout (or check that none came) without cancelling a gRPC read."""

    def __init__(self, channel: aio.Channel, api: str = "ads", node_id: str = "test-envoy") -> None:
        if api == "ads":
            self.call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(
                channel
            ).StreamAggregatedResources()
        else:
            self.call = eds_pb2_grpc.EndpointDiscoveryServiceStub(channel).StreamEndpoints()
        self.node_id = node_id
        self.responses: asyncio.Queue[Any] = asyncio.Queue()
        self.ended = asyncio.Event()
        # Cleared by pause(): the client stops reading, as a stuck Envoy would.
        self._reading = asyncio.Event()
        self._reading.set()
        self._reader = asyncio.create_task(self._read())
        self.last: Any = None

    async def _read(self) -> None:
        try:
            while (
                await self._reading.wait() and (response := await self.call.read()) is not aio.EOF
            ):
                self.responses.put_nowait(response)
        finally:
            self.ended.set()

    def pause(self) -> None:
        """Stop reading responses (after the one being read, if any)."""
        self._reading.clear()

    def resume(self) -> None:
        self._reading.set()

    async def send(
        self,
        names: list[str],
        version: str = "",
        nonce: str = "",
        error: str | None = None,
        type_url: str = EDS,
    ) -> None:
        request = discovery_pb2.DiscoveryRequest(
            version_info=version,
            resource_names=names,
            type_url=type_url,
            response_nonce=nonce,
        )
        request.node.id = self.node_id
        if error is not None:
            request.error_detail.CopyFrom(status_pb2.Status(code=3, message=error))
        await self.call.write(request)

    async def receive(self, within: float = 10.0) -> Any:
        self.last = await asyncio.wait_for(self.responses.get(), within)
        return self.last

    async def ack(self, names: list[str], response: Any | None = None) -> None:
        response = response or self.last
        await self.send(names, version=response.version_info, nonce=response.nonce)

    async def nothing_within(self, seconds: float) -> None:
        """Assert no response arrives for `seconds` (a bounded negative check)."""
        with contextlib.suppress(TimeoutError):
            unexpected = await asyncio.wait_for(self.responses.get(), seconds)
            raise AssertionError(
                f"unexpected response version={unexpected.version_info} "
                f"nonce={unexpected.nonce}: {decode(unexpected)}"
            )

    async def close(self) -> None:
        self.call.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._reader
