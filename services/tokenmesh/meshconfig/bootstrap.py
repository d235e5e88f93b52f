"""Renders Envoy's bootstrap (static listeners and clusters, endpoints over ADS) from
MeshSettings: the composition of the parts each module builds (policy, clusters, listeners,
edge, routes, tls, admin). Every service's special behaviour is a field of its policy.

Whoever writes Envoy's config (the CLI, the local mesh) needs two things from here: render(),
the bootstrap, and secret_files(), the SDS files it names."""

from __future__ import annotations

from tokenmesh.meshconfig.admin import admin, admin_cluster, stats_listener
from tokenmesh.meshconfig.clusters import service_cluster, static_cluster
from tokenmesh.meshconfig.config import MeshSettings
from tokenmesh.meshconfig.constants import (
    OPS_CLUSTER,
    OPS_PAGE_CLUSTER,
    TYPE,
    XDS_CLUSTER,
    Config,
)
from tokenmesh.meshconfig.edge import edge_listener
from tokenmesh.meshconfig.listeners import internal_listener, relay_listener
from tokenmesh.meshconfig.policy import HealthCheckTiming, Services, WorkerBalancing
from tokenmesh.meshconfig.stream_relay import bootstrap_extensions, relay_cluster
from tokenmesh.meshconfig.tls import secret_files

__all__ = ["render", "secret_files"]

DOWNSTREAM_CONNECTIONS = (
    TYPE
    + "envoy.extensions.resource_monitors.downstream_connections.v3.DownstreamConnectionsConfig"
)


def render(
    mesh: MeshSettings,
    checks: HealthCheckTiming | None = None,
    balancing: WorkerBalancing | None = None,
) -> Config:
    """Envoy's bootstrap: the edge and internal listeners, one cluster per service; checks
    and balancing replace the mesh's health-check numbers and worker balancing (the chart's
    placeholders)."""
    services = Services.of(
        mesh, checks or HealthCheckTiming.of(mesh), balancing or WorkerBalancing.of(mesh)
    )
    controlplane = mesh.controlplane_host
    extensions = bootstrap_extensions(mesh)
    return {
        "node": {"id": mesh.node_id, "cluster": "tokenmesh"},
        "admin": admin(mesh),
        **({"bootstrap_extensions": extensions} if extensions else {}),
        "overload_manager": {
            "resource_monitors": [
                {
                    "name": "envoy.resource_monitors.global_downstream_max_connections",
                    "typed_config": {
                        "@type": DOWNSTREAM_CONNECTIONS,
                        "max_active_downstream_connections": mesh.max_edge_connections,
                    },
                }
            ]
        },
        "dynamic_resources": {
            "ads_config": {
                "api_type": "GRPC",
                "transport_api_version": "V3",
                "grpc_services": [{"envoy_grpc": {"cluster_name": XDS_CLUSTER}}],
            }
        },
        "static_resources": {
            "listeners": [
                edge_listener(mesh, services),
                *(internal_listener(service, services, mesh) for service in services.internal),
                *stats_listener(mesh),
                *relay_listener(mesh),
            ],
            "clusters": [
                *(service_cluster(service, mesh) for service in services.clusters),
                # The control plane: xDS for Envoy itself, the ops feed and page for the edge.
                static_cluster(XDS_CLUSTER, controlplane, mesh.controlplane_port, mesh, grpc=True),
                static_cluster(OPS_CLUSTER, controlplane, mesh.controlplane_port, mesh, grpc=True),
                static_cluster(
                    OPS_PAGE_CLUSTER, controlplane, mesh.ops_page_port, mesh, grpc=False
                ),
                *admin_cluster(mesh),
                *relay_cluster(mesh, services),
            ],
        },
    }
