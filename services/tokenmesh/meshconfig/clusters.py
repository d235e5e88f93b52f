"""Clusters: one per service (endpoints over ADS, health-checked, balanced and guarded as its
policy says), and the control plane's fixed addresses."""

from __future__ import annotations

from tokenmesh.meshconfig.config import MeshSettings
from tokenmesh.meshconfig.constants import Config, seconds
from tokenmesh.meshconfig.policy import (
    CircuitBreaker,
    Ejection,
    HealthCheck,
    ServicePolicy,
)
from tokenmesh.meshconfig.protocols import grpc_upstream
from tokenmesh.meshconfig.tls import upstream_tls


def health_check(check: HealthCheck) -> Config:
    """An active health check, on gRPC's health service or an HTTP path."""
    timing = check.timing
    kind = (
        {"grpc_health_check": {"service_name": check.target}}
        if check.kind == "grpc"
        else {"http_health_check": {"path": check.target}}
    )
    return {
        "timeout": timing.timeout,
        "interval": timing.interval,
        "no_traffic_interval": timing.interval,
        "unhealthy_threshold": timing.unhealthy_threshold,
        "healthy_threshold": timing.healthy_threshold,
        **kind,
    }


def outlier_detection(ejection: Ejection) -> Config:
    """Envoy's outlier detection for an ejection policy. On connection failures alone, the
    ejections Envoy enforces by default besides (5xx and success rate) are off."""
    if ejection.on == "connection_failures":
        counted: Config = {
            "split_external_local_origin_errors": True,
            "consecutive_local_origin_failure": ejection.after,
            "enforcing_consecutive_5xx": 0,
            "enforcing_success_rate": 0,
            "enforcing_local_origin_success_rate": 0,
        }
    else:
        assert ejection.interval_seconds is not None
        counted = {
            "consecutive_5xx": ejection.after,
            "consecutive_gateway_failure": ejection.after,
            "interval": seconds(ejection.interval_seconds),
        }
    return {
        **counted,
        "base_ejection_time": seconds(ejection.base_seconds),
        "max_ejection_percent": 100,
    }


def circuit_breakers(breaker: CircuitBreaker) -> Config:
    return {
        "thresholds": [
            {
                "max_connections": breaker.max_connections,
                "max_pending_requests": breaker.max_pending_requests,
                "max_requests": breaker.max_requests,
                "retry_budget": {
                    "budget_percent": {"value": breaker.retry_budget_percent},
                    "min_retry_concurrency": breaker.min_retry_concurrency,
                },
            }
        ]
    }


def service_cluster(service: ServicePolicy, mesh: MeshSettings) -> Config:
    """A cluster named after its service, endpoints over ADS, actively health-checked, as its
    policy says."""
    lb_config: Config = {
        # With the default 50 %, Envoy sends to unhealthy hosts when most are down.
        "healthy_panic_threshold": {"value": service.health_check.timing.panic_threshold_percent},
        # Health changes reach the load balancers at once. By default Envoy merges them for
        # up to 1 s (a window meant for clusters of thousands of hosts), so a worker that
        # had just passed its first check got no stream for a second while another died.
        "update_merge_window": "0s",
    }
    cluster: Config = {
        "name": service.name,
        "type": "EDS",
        "eds_cluster_config": {"eds_config": {"ads": {}, "resource_api_version": "V3"}},
        "connect_timeout": "1s",
        "per_connection_buffer_limit_bytes": mesh.buffer_limit_bytes,
        **(
            {"load_balancing_policy": service.load_balancing}
            if service.load_balancing is not None
            else {"lb_policy": service.lb_policy}
        ),
        **(
            {
                "typed_extension_protocol_options": grpc_upstream(
                    mesh, service.streams_per_connection, service.names_upstream_host
                )
            }
            if service.protocol == "grpc"
            else {}
        ),
        "health_checks": [health_check(service.health_check)],
        "common_lb_config": lb_config,
        # A host removed by discovery stops getting streams even while it still passes checks.
        "ignore_health_on_host_removal": True,
        # Per-host request, error and active-request stats (envoy_cluster_endpoint_* at
        # /stats/prometheus, labelled envoy_endpoint_address): how streams spread over replicas.
        "track_cluster_stats": {"per_endpoint_stats": True},
        "circuit_breakers": circuit_breakers(service.circuit_breaker),
    }
    if mesh.upstream_mtls:
        cluster["transport_socket"] = upstream_tls(service, mesh)
    if service.ejection is not None:
        cluster["outlier_detection"] = outlier_detection(service.ejection)
    return cluster


def static_cluster(
    name: str,
    host: str,
    port: int,
    mesh: MeshSettings,
    *,
    grpc: bool,
    discovery: str | None = None,
) -> Config:
    """A cluster of one fixed address (by default the control plane's, found as its
    controlplane_discovery says): gRPC over HTTP/2, or HTTP/1.1."""
    cluster: Config = {
        "name": name,
        "type": discovery or mesh.controlplane_discovery,
        "connect_timeout": "1s",
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [
                {
                    "lb_endpoints": [
                        {
                            "endpoint": {
                                "address": {"socket_address": {"address": host, "port_value": port}}
                            }
                        }
                    ]
                }
            ],
        },
    }
    if grpc:
        cluster["typed_extension_protocol_options"] = grpc_upstream(mesh)
    return cluster
