"""The control plane's metrics: xDS streams, pushes, ACKs/NACKs, endpoints, source errors."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from tokenmesh.controlplane.snapshots import VersionedSnapshot


class ControlPlaneMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.streams = Gauge(
            "tokenmesh_xds_connected_streams",
            "xDS streams (ADS and EDS) open now, one per connected Envoy.",
            registry=registry,
        )
        self.pushes = Counter(
            "tokenmesh_xds_pushes",
            "DiscoveryResponses sent; reason=request (a new or changed subscription) or "
            "update (the endpoint set changed).",
            ["reason"],
            registry=registry,
        )
        self.acks = Counter(
            "tokenmesh_xds_acks",
            "Responses Envoy accepted.",
            registry=registry,
        )
        self.nacks = Counter(
            "tokenmesh_xds_nacks",
            "Responses Envoy rejected (error_detail set); it keeps its last good config.",
            registry=registry,
        )
        self.stale = Counter(
            "tokenmesh_xds_stale_requests",
            "Requests ignored because their nonce was not the last one sent on their stream.",
            registry=registry,
        )
        self.version = Gauge(
            "tokenmesh_xds_snapshot_version",
            "Version of the endpoint snapshot being served (increases on every change).",
            registry=registry,
        )
        self.endpoints = Gauge(
            "tokenmesh_controlplane_endpoints",
            "Endpoints per cluster in the served snapshot, by reported health.",
            ["cluster", "health"],
            registry=registry,
        )
        self.source_errors = Counter(
            "tokenmesh_controlplane_source_errors",
            "Failed reads of the endpoint source (Consul query, static file); the last good "
            "endpoints keep being served.",
            ["source"],
            registry=registry,
        )

    def observe_snapshot(self, snapshot: VersionedSnapshot) -> None:
        self.version.set(int(snapshot.version))
        self.endpoints.clear()  # clusters that disappeared must not keep their last value
        for cluster, endpoints in snapshot.clusters.items():
            healthy = sum(endpoint.healthy for endpoint in endpoints)
            self.endpoints.labels(cluster, "healthy").set(healthy)
            self.endpoints.labels(cluster, "unhealthy").set(len(endpoints) - healthy)
