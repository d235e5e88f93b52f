"""Routes: to a service as its policy says (retries, the caller's deadline), and the
edge's routes to the control plane's ops feed and page and its adapter admin API."""

from __future__ import annotations

from tokenmesh.common.pools import POOL_HEADER
from tokenmesh.meshconfig.config import MeshSettings
from tokenmesh.meshconfig.constants import OPS_CLUSTER, OPS_PAGE_CLUSTER, Config
from tokenmesh.meshconfig.policy import ServicePolicy, Services
from tokenmesh.meshconfig.retries import RETRY_ON, retry_policy
from tokenmesh.v1 import admin_pb2, ops_pb2

# Where the edge serves the ops page (from the control plane's page port).
OPS_PAGE = "/ops/"


def route_to(
    cluster: str,
    mesh: MeshSettings,
    prefix: str = "/",
    *,
    retry_on: str = RETRY_ON,
    grpc: bool = True,
) -> Config:
    """A route to cluster (by default catch-all), safe for long streams; a gRPC one honours the
    caller's grpc-timeout. Hashing is the cluster's (balancing.py)."""
    route: Config = {
        "cluster": cluster,
        # The 15 s default route timeout would cut long generations: no overall timeout,
        # the caller's grpc-timeout is honoured instead (0s: no cap on it).
        "timeout": "0s",
    }
    if grpc:
        route["max_stream_duration"] = {"grpc_timeout_header_max": "0s"}
    route["retry_policy"] = retry_policy(retry_on, mesh)
    return {"match": {"prefix": prefix}, "route": route}


def service_route(service: ServicePolicy, mesh: MeshSettings, prefix: str = "/") -> Config:
    """A route to a service's cluster, retried as its policy says."""
    return route_to(
        service.name,
        mesh,
        prefix,
        retry_on=service.retry_on,
        grpc=service.protocol == "grpc",
    )


def pool_routes(to_workers: Config, services: Services) -> list[Config]:
    """A route to the workers, once for each further pool (the same match, and the pool's
    header naming it, to the pool's cluster), then as it was: to the default pool, whatever
    else the header says (the gateway, which sets it, names only pools it knows)."""
    routes = []
    for pool, policy in services.pools:
        match = {
            **to_workers["match"],
            "headers": [{"name": POOL_HEADER, "string_match": {"exact": pool}}],
        }
        routes.append(
            {**to_workers, "match": match, "route": {**to_workers["route"], "cluster": policy.name}}
        )
    return [*routes, to_workers]


def not_served(prefix: str) -> Config:
    """A prefix refused at the listener: HTTP 404, which a gRPC caller sees as UNIMPLEMENTED."""
    return {
        "match": {"prefix": prefix},
        "direct_response": {"status": 404, "body": {"inline_string": "not served here"}},
    }


# The workers' admin interface (adapters at run time): only the control plane, which dials the
# workers directly, calls it; no listener of Envoy's routes it (decision 0034).
WORKER_ADMIN_PREFIX = "/" + admin_pb2.DESCRIPTOR.services_by_name["WorkerAdmin"].full_name + "/"


def ops_routes(mesh: MeshSettings) -> list[Config]:
    """The ops feed (gRPC and gRPC-Web), the adapter admin API (keyed by the control plane
    itself, decision 0034) and the ops page to the control plane."""
    return [
        route_to(
            OPS_CLUSTER,
            mesh,
            prefix="/" + ops_pb2.DESCRIPTOR.services_by_name["OpsService"].full_name + "/",
        ),
        route_to(
            OPS_CLUSTER,
            mesh,
            prefix="/" + admin_pb2.DESCRIPTOR.services_by_name["AdapterAdmin"].full_name + "/",
        ),
        {"match": {"path": OPS_PAGE.rstrip("/")}, "redirect": {"path_redirect": OPS_PAGE}},
        {"match": {"prefix": OPS_PAGE}, "route": {"cluster": OPS_PAGE_CLUSTER, "timeout": "10s"}},
    ]
