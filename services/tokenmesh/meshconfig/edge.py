"""The edge: the callers' listener, its routes (the ops feed and page, the direct token path,
OpenAI's API, the gateways), its filters, CORS, local replies, logs and TLS."""

from __future__ import annotations

from tokenmesh.meshconfig.access_logs import EDGE_FIELDS, access_log, direct_stream_log
from tokenmesh.meshconfig.config import MeshSettings
from tokenmesh.meshconfig.constants import OPENAI_PREFIX, TOKENIZER_PATHS, Config
from tokenmesh.meshconfig.direct_path import direct_routes, processor_off
from tokenmesh.meshconfig.filters import cors_policy, edge_filters
from tokenmesh.meshconfig.listeners import connection_manager, traffic_listener
from tokenmesh.meshconfig.local_replies import edge_local_replies
from tokenmesh.meshconfig.policy import Services
from tokenmesh.meshconfig.routes import not_served, ops_routes, service_route
from tokenmesh.meshconfig.tls import EDGE_CERTIFICATE, downstream_tls

EDGE = "edge"


def edge_routes(mesh: MeshSettings, services: Services) -> list[Config]:
    """The ops feed and page to the control plane; with openai_api, OpenAI's HTTP API (/v1/...)
    to the gateways' HTTP port; the rest to gateways."""
    return [
        *ops_routes(mesh),
        # Envoy's own interfaces on the gateways (external processor, access log) are for the
        # mesh's Envoys, not callers: UNIMPLEMENTED (HTTP 404).
        not_served("/envoy.service."),
        *direct_routes(mesh, services),
        *(openai_routes(mesh, services) if services.openai else []),
        service_route(services.gateway, mesh),
    ]


def openai_routes(mesh: MeshSettings, services: Services) -> list[Config]:
    """OpenAI's API (/v1/...) and vLLM's tokenizer routes to the gateways' HTTP port."""
    assert services.openai is not None
    routes = [service_route(services.openai, mesh, OPENAI_PREFIX)]
    for path in TOKENIZER_PATHS:
        route = service_route(services.openai, mesh)
        route["match"] = {"path": path}
        routes.append(route)
    return routes


def edge_listener(mesh: MeshSettings, services: Services) -> Config:
    """The callers' listener: HTTP/2 (gRPC) and HTTP/1.1 (REST, gRPC-Web, OpenAI's API)."""
    virtual_host: Config = {
        "name": services.gateway.name,
        "domains": ["*"],
        "routes": edge_routes(mesh, services),
        "typed_per_filter_config": {**cors_policy(mesh), **processor_off(mesh)},
    }
    manager = connection_manager(
        EDGE,
        mesh,
        codec="AUTO",
        virtual_host=virtual_host,
        http_filters=edge_filters(mesh),
        access_logs=access_log(EDGE, EDGE_FIELDS) + direct_stream_log(mesh),
        local_replies=edge_local_replies(mesh),
    )
    return traffic_listener(
        EDGE,
        mesh.edge_host,
        mesh.edge_port,
        mesh,
        manager,
        # HTTP/2 (gRPC) and HTTP/1.1 (REST, gRPC-Web) by ALPN.
        transport_socket=downstream_tls(EDGE_CERTIFICATE, mesh, ["h2", "http/1.1"])
        if mesh.edge_tls_cert_file
        else None,
        ignore_global_conn_limit=False,
    )
