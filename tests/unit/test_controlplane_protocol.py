"""The control plane's xDS protocol over a real gRPC channel (in-process server, real
servicers and interceptors): initial responses, ACKs, NACKs, stale nonces, subscription
changes, pushes to every stream, slow streams, shutdown; plus the snapshot cache itself."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from envoy.service.endpoint.v3 import eds_pb2_grpc
from grpc import aio
from prometheus_client import CollectorRegistry

from tests.xds_client import EDS, XdsClient, decode
from tokenmesh.common.interceptors import standard_interceptors
from tokenmesh.controlplane.discovery import DiscoverySession
from tokenmesh.controlplane.endpoints import Endpoint
from tokenmesh.controlplane.metrics import ControlPlaneMetrics
from tokenmesh.controlplane.servicer import AggregatedDiscoveryServicer, EndpointDiscoveryServicer
from tokenmesh.controlplane.snapshots import SnapshotCache

# Long enough for a wrongly sent response to arrive on loopback, short enough to keep the suite
# fast; used only to show that something does NOT happen.
QUIET = 0.5

WORKERS = {
    "worker": [Endpoint("127.0.0.1", 50061), Endpoint("127.0.0.1", 50062, healthy=False)],
    "gateway": [Endpoint("127.0.0.1", 50050)],
}


@dataclass
class Plane:
    cache: SnapshotCache
    registry: CollectorRegistry
    channel: aio.Channel
    address: str

    def metric(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0

    def client(self, api: str = "ads", channel: aio.Channel | None = None) -> XdsClient:
        return XdsClient(channel or self.channel, api)


@pytest.fixture
async def plane() -> AsyncIterator[Plane]:
    registry = CollectorRegistry()
    metrics = ControlPlaneMetrics(registry)
    cache = SnapshotCache(on_update=metrics.observe_snapshot)
    server = aio.server(interceptors=standard_interceptors(registry))
    ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(
        AggregatedDiscoveryServicer(cache, metrics), server
    )
    eds_pb2_grpc.add_EndpointDiscoveryServiceServicer_to_server(
        EndpointDiscoveryServicer(cache, metrics), server
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield Plane(cache, registry, channel, f"127.0.0.1:{port}")
    finally:
        cache.close()
        await channel.close()
        await server.stop(0)


async def until(condition: Callable[[], bool], within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, f"not true within {within}s"
        await asyncio.sleep(0.01)


async def test_first_request_gets_the_named_clusters_with_their_health(plane: Plane) -> None:
    plane.cache.update(WORKERS)
    client = plane.client()
    await client.send(["worker"])
    response = await client.receive()
    assert response.type_url == EDS
    assert response.version_info == "1" and response.nonce
    assert decode(response) == {
        "worker": [("127.0.0.1", 50061, "HEALTHY"), ("127.0.0.1", 50062, "UNHEALTHY")]
    }
    assert plane.metric("tokenmesh_xds_connected_streams") == 1
    assert plane.metric("tokenmesh_xds_pushes_total", reason="request") == 1
    await client.close()


async def test_unknown_cluster_gets_an_empty_assignment(plane: Plane) -> None:
    plane.cache.update(WORKERS)
    client = plane.client()
    await client.send(["reranker"])
    assert decode(await client.receive()) == {"reranker": []}
    await client.close()


async def test_types_other_than_endpoints_are_ignored_on_the_same_stream(plane: Plane) -> None:
    plane.cache.update(WORKERS)
    client = plane.client()
    await client.send([], type_url="type.googleapis.com/envoy.config.cluster.v3.Cluster")
    await client.nothing_within(QUIET)  # an empty CDS answer would delete Envoy's clusters
    await client.send(["gateway"])
    assert decode(await client.receive()) == {"gateway": [("127.0.0.1", 50050, "HEALTHY")]}
    await client.close()


async def test_ack_is_counted_and_not_answered(plane: Plane) -> None:
    plane.cache.update(WORKERS)
    client = plane.client()
    await client.send(["worker"])
    await client.receive()
    await client.ack(["worker"])
    await until(lambda: plane.metric("tokenmesh_xds_acks_total") == 1)
    await client.nothing_within(QUIET)
    assert plane.metric("tokenmesh_xds_acks_total") == 1
    assert plane.metric("tokenmesh_xds_pushes_total", reason="request") == 1
    await client.close()


async def test_nack_is_counted_not_resent_and_later_changes_still_pushed(plane: Plane) -> None:
    plane.cache.update(WORKERS)
    client = plane.client()
    await client.send(["worker"])
    first = await client.receive()
    await client.ack(["worker"])
    # Let the ACK land before the change; otherwise it would carry a stale nonce.
    await until(lambda: plane.metric("tokenmesh_xds_acks_total") == 1)
    plane.cache.update({**WORKERS, "worker": [Endpoint("127.0.0.1", 50063)]})
    rejected = await client.receive()
    assert rejected.version_info == "2"
    # Envoy's NACK: the nonce of the rejected response, the version it still runs, an error.
    await client.send(
        ["worker"], version=first.version_info, nonce=rejected.nonce, error="bad endpoint"
    )
    await until(lambda: plane.metric("tokenmesh_xds_nacks_total") == 1)
    await client.nothing_within(QUIET)  # no resend loop
    assert plane.metric("tokenmesh_xds_nacks_total") == 1
    assert plane.metric("tokenmesh_xds_acks_total") == 1  # the NACK is no ACK
    plane.cache.update({**WORKERS, "worker": [Endpoint("127.0.0.1", 50064)]})
    fixed = await client.receive()
    assert fixed.version_info == "3"
    assert decode(fixed) == {"worker": [("127.0.0.1", 50064, "HEALTHY")]}
    await client.close()


def test_session_keeps_the_last_acked_version_through_a_nack() -> None:
    """The stream state behind the NACK test, without gRPC: ACKed v1 stays the version in use
    when v2 is rejected, and nothing is sent in reply to the NACK."""
    registry = CollectorRegistry()
    cache = SnapshotCache()
    cache.update(WORKERS)
    session = DiscoverySession(cache, ControlPlaneMetrics(registry), "test")

    def request(version: str = "", nonce: str = "", error: str = "") -> Any:
        message = discovery_pb2.DiscoveryRequest(
            type_url=EDS, resource_names=["worker"], version_info=version, response_nonce=nonce
        )
        if error:
            message.error_detail.message = error
        return message

    first = session.on_request(request())
    assert session.on_request(request(first.version_info, first.nonce)) is None
    cache.update({"worker": [Endpoint("127.0.0.1", 1)]})
    assert cache.current is not None
    [second] = session.on_snapshot(cache.current)
    assert session.on_request(request(first.version_info, second.nonce, "rejected")) is None
    subscription = session.subscriptions[EDS]
    assert (subscription.acked_version, subscription.rejected_version) == ("1", "2")


async def test_stale_nonce_is_ignored_and_the_latest_nonce_answered(plane: Plane) -> None:
    plane.cache.update(WORKERS)
    client = plane.client()
    await client.send(["worker"])
    old = await client.receive()
    plane.cache.update({**WORKERS, "worker": [Endpoint("127.0.0.1", 50065)]})
    new = await client.receive()
    # A request answering the older response, even one naming new resources, is stale: the
    # client has not seen the latest response yet and will answer it.
    await client.send(["worker", "gateway"], version=old.version_info, nonce=old.nonce)
    await until(lambda: plane.metric("tokenmesh_xds_stale_requests_total") == 1)
    await client.nothing_within(QUIET)
    assert plane.metric("tokenmesh_xds_stale_requests_total") == 1
    await client.send(["worker", "gateway"], version=new.version_info, nonce=new.nonce)
    answered = await client.receive()
    assert set(decode(answered)) == {"worker", "gateway"}
    assert plane.metric("tokenmesh_xds_acks_total") == 1
    await client.close()


async def test_changed_resource_names_are_answered_at_once(plane: Plane) -> None:
    plane.cache.update(WORKERS)
    client = plane.client()
    await client.send(["worker"])
    await client.receive()
    await client.send(["worker", "gateway"], version="1", nonce=client.last.nonce)
    response = await client.receive()
    assert response.version_info == "1"  # same endpoint set, new subscription
    assert decode(response) == {
        "gateway": [("127.0.0.1", 50050, "HEALTHY")],
        "worker": [("127.0.0.1", 50061, "HEALTHY"), ("127.0.0.1", 50062, "UNHEALTHY")],
    }
    await client.close()


async def test_a_change_is_pushed_to_every_stream_subscribed_to_it(plane: Plane) -> None:
    plane.cache.update(WORKERS)
    watchers = [plane.client("ads"), plane.client("ads"), plane.client("eds")]
    bystander = plane.client("ads")  # subscribed to gateway only: unaffected by the change
    for client in watchers:
        await client.send(["worker"])
        await client.receive()
        await client.ack(["worker"])
    await bystander.send(["gateway"])
    await bystander.receive()
    await bystander.ack(["gateway"])

    plane.cache.update({**WORKERS, "worker": [Endpoint("127.0.0.1", 50066)]})
    for client in watchers:
        pushed = await client.receive()
        assert pushed.version_info == "2"
        assert decode(pushed) == {"worker": [("127.0.0.1", 50066, "HEALTHY")]}
    await bystander.nothing_within(QUIET)
    assert plane.metric("tokenmesh_xds_pushes_total", reason="update") == 3
    assert plane.metric("tokenmesh_xds_connected_streams") == 4
    for client in [*watchers, bystander]:
        await client.close()


async def test_unchanged_endpoint_set_makes_no_new_version_and_no_push(plane: Plane) -> None:
    plane.cache.update(WORKERS)
    client = plane.client()
    await client.send(["worker"])
    await client.receive()
    await client.ack(["worker"])
    # The same set listed in another order is the same set.
    assert not plane.cache.update({name: list(reversed(eps)) for name, eps in WORKERS.items()})
    await client.nothing_within(QUIET)
    assert plane.cache.current is not None and plane.cache.current.version == "1"
    await client.close()


async def test_requests_before_the_first_snapshot_are_answered_when_it_loads(
    plane: Plane,
) -> None:
    client = plane.client()
    await client.send(["worker"])
    await client.nothing_within(QUIET)
    plane.cache.update(WORKERS)
    response = await client.receive()
    assert response.version_info == "1" and set(decode(response)) == {"worker"}
    await client.close()


def many_endpoints(first_port: int, count: int) -> list[Endpoint]:
    return [Endpoint("127.0.0.1", port) for port in range(first_port, first_port + count)]


async def test_a_slow_stream_blocks_nobody_and_skips_to_the_newest_version(plane: Plane) -> None:
    """A client that stops reading fills its HTTP/2 window; updates keep flowing to the
    others, and when it reads again it gets the newest version, not a backlog."""
    plane.cache.update({"worker": many_endpoints(1000, 2000)})
    # Its own connection with a fixed 64 KiB window (no BDP probing growing it).
    slow_channel = aio.insecure_channel(plane.address, options=[("grpc.http2.bdp_probe", 0)])
    slow, fast = plane.client(channel=slow_channel), plane.client()
    for client in (slow, fast):
        await client.send(["worker"])
        await client.receive()
        await client.ack(["worker"])
    slow.pause()  # stop reading: responses pile up in the HTTP/2 flow-control window
    updates = 40
    for step in range(updates):
        # ~2000 endpoints, ~70 KB a response: a few fill the stream's window.
        plane.cache.update({"worker": many_endpoints(2000 + step, 2000)})
        pushed = await fast.receive()
        assert pushed.version_info == str(step + 2)
        await fast.ack(["worker"], pushed)
    latest = str(updates + 1)

    slow.resume()
    seen = []
    while not seen or seen[-1] != latest:
        seen.append((await slow.receive()).version_info)
    # A few responses were already in flight (flow-control window, one blocked write); after
    # them comes the newest version directly, not the 40 in between.
    assert len(seen) < updates // 4, f"the slow stream got a backlog: {seen}"
    assert [int(v) for v in seen] == sorted(int(v) for v in seen)
    await slow.close()
    await fast.close()
    await slow_channel.close()


async def test_shutdown_ends_every_stream_cleanly(plane: Plane) -> None:
    plane.cache.update(WORKERS)
    client = plane.client()
    await client.send(["worker"])
    await client.receive()
    plane.cache.close()
    await asyncio.wait_for(client.ended.wait(), 10)
    assert await client.call.code() == grpc.StatusCode.OK
    assert plane.metric("tokenmesh_xds_connected_streams") == 0


async def test_fetch_endpoints_returns_the_current_snapshot(plane: Plane) -> None:
    stub = eds_pb2_grpc.EndpointDiscoveryServiceStub(plane.channel)
    with pytest.raises(aio.AioRpcError) as before:
        await stub.FetchEndpoints(discovery_pb2.DiscoveryRequest(resource_names=["worker"]))
    assert before.value.code() == grpc.StatusCode.UNAVAILABLE
    plane.cache.update(WORKERS)
    reply = await stub.FetchEndpoints(discovery_pb2.DiscoveryRequest(resource_names=[]))
    assert reply.version_info == "1" and set(decode(reply)) == {"worker", "gateway"}


async def test_delta_xds_is_refused_as_unimplemented(plane: Plane) -> None:
    call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(plane.channel).DeltaAggregatedResources()
    # The server may refuse the stream before the write lands; the status tells either way.
    with contextlib.suppress(grpc.aio.AioRpcError):
        await call.write(discovery_pb2.DeltaDiscoveryRequest(type_url=EDS))
    assert await call.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "state of the world" in (await call.details())


def versions(cache: SnapshotCache, sets: Iterable[dict[str, list[Endpoint]]]) -> list[str]:
    result = []
    for clusters in sets:
        cache.update(clusters)
        assert cache.current is not None
        result.append(cache.current.version)
    return result


def test_versions_increase_by_one_per_change_only() -> None:
    one = {"worker": [Endpoint("127.0.0.1", 1)]}
    two = {"worker": [Endpoint("127.0.0.1", 1), Endpoint("127.0.0.1", 2)]}
    unhealthy = {"worker": [Endpoint("127.0.0.1", 1, healthy=False)]}
    assert versions(SnapshotCache(), [one, one, two, two, one, unhealthy]) == [
        "1", "1", "2", "2", "3", "4",
    ]  # fmt: skip


def test_endpoint_gauges_follow_the_snapshot() -> None:
    registry = CollectorRegistry()
    metrics = ControlPlaneMetrics(registry)
    cache = SnapshotCache(on_update=metrics.observe_snapshot)
    cache.update(WORKERS)
    sample = registry.get_sample_value
    assert (
        sample("tokenmesh_controlplane_endpoints", {"cluster": "worker", "health": "healthy"}) == 1
    )
    assert (
        sample("tokenmesh_controlplane_endpoints", {"cluster": "worker", "health": "unhealthy"})
        == 1
    )
    cache.update({"worker": []})
    assert (
        sample("tokenmesh_controlplane_endpoints", {"cluster": "gateway", "health": "healthy"})
        is None
    )
    assert sample("tokenmesh_xds_snapshot_version", {}) == 2
