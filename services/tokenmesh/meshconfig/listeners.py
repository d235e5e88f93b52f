"""Listeners: an HTTP connection manager with the mesh's stream and header bounds, on a listener
the chart's preStop drains; the gateways' internal listener for each service they call; and
the stream relay's Envoy internal listener."""

from __future__ import annotations

from tokenmesh.meshconfig.access_logs import access_log, relay_access_log
from tokenmesh.meshconfig.config import MeshSettings
from tokenmesh.meshconfig.constants import HCM, WORKER, Config, seconds
from tokenmesh.meshconfig.filters import router_filter
from tokenmesh.meshconfig.policy import ServicePolicy, Services
from tokenmesh.meshconfig.protocols import http2_options
from tokenmesh.meshconfig.routes import (
    WORKER_ADMIN_PREFIX,
    not_served,
    pool_routes,
    service_route,
)
from tokenmesh.meshconfig.stream_relay import RELAY, relay_filter
from tokenmesh.meshconfig.tls import INTERNAL_CERTIFICATE, downstream_tls


def connection_manager_chain(manager: Config) -> Config:
    """A filter chain of one HTTP connection manager."""
    return {
        "filters": [
            {
                "name": "envoy.filters.network.http_connection_manager",
                "typed_config": manager,
            }
        ]
    }


def connection_manager(
    name: str,
    mesh: MeshSettings,
    *,
    codec: str,
    virtual_host: Config,
    http_filters: list[Config],
    access_logs: list[Config],
    local_replies: Config | None = None,
) -> Config:
    """A traffic listener's HTTP connection manager: its one virtual host, filters and logs,
    with the mesh's HTTP/2 windows, stream idle timeout and bounds on request headers."""
    return {
        "@type": HCM,
        "stat_prefix": name,
        "codec_type": codec,
        "http2_protocol_options": http2_options(mesh),
        "stream_idle_timeout": seconds(mesh.stream_idle_timeout_seconds),
        # Bounds on what a request's headers may cost (docs/security.md, "Edge protections").
        "max_request_headers_kb": mesh.max_request_headers_kib,
        "common_http_protocol_options": {"max_headers_count": mesh.max_headers_count},
        "request_headers_timeout": seconds(mesh.request_headers_timeout_seconds),
        **(local_replies or {}),
        "access_log": access_logs,
        "route_config": {"name": name, "virtual_hosts": [virtual_host]},
        "http_filters": http_filters,
    }


def traffic_listener(
    name: str,
    host: str,
    port: int,
    mesh: MeshSettings,
    manager: Config,
    *,
    transport_socket: Config | None,
    ignore_global_conn_limit: bool,
) -> Config:
    """A listener for traffic (not probes): drained by the chart's preStop."""
    chain = connection_manager_chain(manager)
    if transport_socket is not None:
        chain["transport_socket"] = transport_socket
    return {
        "name": name,
        "address": {"socket_address": {"address": host, "port_value": port}},
        # What /drain_listeners?inboundonly drains (the chart's preStop); the stats listener
        # is not marked, so probes and scrapes go on while the others drain.
        "traffic_direction": "INBOUND",
        "per_connection_buffer_limit_bytes": mesh.buffer_limit_bytes,
        "ignore_global_conn_limit": ignore_global_conn_limit,
        "filter_chains": [chain],
    }


def internal_listener(service: ServicePolicy, services: Services, mesh: MeshSettings) -> Config:
    """The gateways' listener for a service: gRPC only, everything to its cluster (the workers'
    to the pool a call's header names) but the workers' admin interface."""
    assert service.listener_port is not None
    route = service_route(service, mesh)
    virtual_host: Config = {
        "name": service.name,
        "domains": ["*"],
        "routes": [
            not_served(WORKER_ADMIN_PREFIX),
            *(pool_routes(route, services) if service is services.worker else [route]),
        ],
    }
    manager = connection_manager(
        service.name,
        mesh,
        codec="HTTP2",
        virtual_host=virtual_host,
        http_filters=[router_filter()],
        access_logs=access_log(service.name),
    )
    return traffic_listener(
        service.name,
        mesh.internal_host,
        service.listener_port,
        mesh,
        manager,
        transport_socket=downstream_tls(INTERNAL_CERTIFICATE, mesh, ["h2"])
        if mesh.internal_tls_cert_file
        else None,
        # Only client connections count towards max_edge_connections: gateways keep reaching
        # workers and the reranker when the edge is full.
        ignore_global_conn_limit=True,
    )


def relay_listener(mesh: MeshSettings) -> list[Config]:
    """With stream_relay: the relay's Envoy internal listener (meshconfig/stream_relay.py),
    every stream to the relay."""
    if not mesh.relays:
        return []
    manager = connection_manager(
        RELAY,
        mesh,
        codec="HTTP2",
        # The route only matches: the relay, not a router, sends the stream on.
        virtual_host={
            "name": RELAY,
            "domains": ["*"],
            "routes": [{"match": {"prefix": "/"}, "route": {"cluster": WORKER}}],
        },
        http_filters=[relay_filter(mesh)],
        access_logs=relay_access_log(RELAY),
    )
    return [
        {
            "name": RELAY,
            "internal_listener": {},
            # What Envoy queues towards the edge for one stream before it tells the relay its
            # caller is behind: a stream window, as the router holds towards a slow caller,
            # not the listeners' buffer limit (the relay reads request bodies itself).
            "per_connection_buffer_limit_bytes": mesh.stream_window_bytes,
            # Only callers' connections count towards max_edge_connections: the edge's own
            # connections to the relay are not refused when the edge is full.
            "ignore_global_conn_limit": True,
            "filter_chains": [connection_manager_chain(manager)],
        }
    ]
