"""Envoy's admin interface, and the stats listener that exposes only its scrape and readiness
paths (with stats_port) through a cluster of its own."""

from __future__ import annotations

from tokenmesh.meshconfig.clusters import static_cluster
from tokenmesh.meshconfig.config import MeshSettings
from tokenmesh.meshconfig.constants import HCM, Config, seconds
from tokenmesh.meshconfig.filters import router_filter
from tokenmesh.meshconfig.listeners import connection_manager_chain

# With a stats listener: the admin interface as a cluster, and the only paths routed to it
# (Prometheus' scrape and the readiness probe; none of them changes Envoy's state).
ADMIN_CLUSTER = "envoy_admin"
STATS_PATHS = ("/stats/prometheus", "/ready")


def admin(mesh: MeshSettings) -> Config:
    """The admin interface."""
    return {
        "address": {"socket_address": {"address": mesh.admin_host, "port_value": mesh.admin_port}},
        # Probes and metrics scrapes get through when the edge is at its connection limit.
        "ignore_global_conn_limit": True,
    }


def stats_listener(mesh: MeshSettings) -> list[Config]:
    """With stats_port: GET STATS_PATHS passed on to the admin interface, every other request
    answered 404 here, so the pod's network never reaches admin's other endpoints
    (/quitquitquit, /healthcheck/fail, /config_dump, ...). Exact paths: a query string is
    allowed (the admin reads its filters), nothing else."""
    if mesh.stats_port is None:
        return []
    get = [{"name": ":method", "string_match": {"exact": "GET"}}]
    routes: list[Config] = [
        {
            "match": {"path": path, "headers": get},
            "route": {"cluster": ADMIN_CLUSTER, "timeout": "10s"},
        }
        for path in STATS_PATHS
    ]
    routes.append(
        {
            "match": {"prefix": "/"},
            "direct_response": {
                "status": 404,
                "body": {"inline_string": f"only GET {' and '.join(STATS_PATHS)} here\n"},
            },
        }
    )
    manager: Config = {
        "@type": HCM,
        "stat_prefix": "stats",
        "codec_type": "AUTO",
        "stream_idle_timeout": seconds(mesh.stream_idle_timeout_seconds),
        "request_headers_timeout": seconds(mesh.request_headers_timeout_seconds),
        "route_config": {
            "name": "stats",
            "virtual_hosts": [{"name": "stats", "domains": ["*"], "routes": routes}],
        },
        "http_filters": [router_filter()],
    }
    return [
        {
            "name": "stats",
            "address": {
                "socket_address": {"address": mesh.stats_host, "port_value": mesh.stats_port}
            },
            # Probes and scrapes get through when the edge is at its connection limit.
            "ignore_global_conn_limit": True,
            "filter_chains": [connection_manager_chain(manager)],
        }
    ]


def admin_cluster(mesh: MeshSettings) -> list[Config]:
    """With stats_port: the admin interface (on 127.0.0.1 when it listens everywhere), for
    the stats listener's routes (the pattern of Envoy's own examples that expose
    /stats/prometheus)."""
    if mesh.stats_port is None:
        return []
    host = "127.0.0.1" if mesh.admin_host in ("0.0.0.0", "::") else mesh.admin_host
    return [
        static_cluster(ADMIN_CLUSTER, host, mesh.admin_port, mesh, grpc=False, discovery="STATIC")
    ]
