"""The direct token path's pieces at the edge: a gateway (the external processor) prepares each
Generate request, and Envoy sends it to the workers, whose tokens go straight to the caller."""

from __future__ import annotations

from tokenmesh.common.tokens import (
    CALLER_CONTENT_TYPE,
    EDGE_METADATA,
    EDGE_WORKER,
    LLM_GENERATE,
    OPENAI_CHAT_COMPLETIONS,
    OPENAI_COMPLETIONS,
    UPSTREAM_HEADER,
    WORKER_GENERATE,
    WORKER_GENERATE_OPENAI,
)
from tokenmesh.meshconfig.config import MeshSettings
from tokenmesh.meshconfig.constants import GATEWAY, TYPE, Config, seconds
from tokenmesh.meshconfig.policy import Services
from tokenmesh.meshconfig.retries import RETRY_ON, retry_policy
from tokenmesh.meshconfig.routes import pool_routes, service_route
from tokenmesh.meshconfig.stream_relay import relayed

EXT_PROC = "envoy.filters.http.ext_proc"
EXT_PROC_PER_ROUTE = TYPE + "envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute"


def caller_content_type(mesh: MeshSettings) -> list[Config]:
    """With direct_token_path: the caller's content-type, kept in the stream's metadata for the
    external processor before the gRPC-Web filter rewrites it to gRPC. That filter moves a
    stream's trailers into its body, so Envoy's access log would get neither its status nor its
    usage: gRPC-Web streams take the gateway's path. And the worker a direct stream ended on
    (UPSTREAM_HEADER, from the workers' cluster, through the stream relay or not), kept there
    for the access logs (the gateways' span of the stream) and removed: callers never learn
    the workers' addresses."""
    if not mesh.direct_token_path:
        return []
    return [
        {
            "name": "envoy.filters.http.header_to_metadata",
            "typed_config": {
                "@type": TYPE + "envoy.extensions.filters.http.header_to_metadata.v3.Config",
                "request_rules": [
                    {
                        "header": "content-type",
                        "on_header_present": {
                            "metadata_namespace": EDGE_METADATA,
                            "key": CALLER_CONTENT_TYPE,
                            "type": "STRING",
                        },
                    }
                ],
                "response_rules": [
                    {
                        "header": UPSTREAM_HEADER,
                        "on_header_present": {
                            "metadata_namespace": EDGE_METADATA,
                            "key": EDGE_WORKER,
                            "type": "STRING",
                        },
                        "remove": True,
                    }
                ],
            },
        }
    ]


def external_processor(mesh: MeshSettings) -> list[Config]:
    """With direct_token_path: a gateway prepares each Generate request (its headers and whole
    body, after gRPC-Web and REST are turned into gRPC) and Envoy routes the rewritten request
    to the workers. The responses (the tokens) are not sent to it. Enabled on the Generate
    routes only (direct_routes)."""
    if not mesh.direct_token_path:
        return []
    return [
        {
            "name": EXT_PROC,
            "typed_config": {
                "@type": TYPE + "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
                "grpc_service": {
                    "envoy_grpc": {"cluster_name": GATEWAY},
                    "timeout": seconds(mesh.prepare_timeout_seconds),
                    # A gateway that is gone, or closing the connection the stream was opened
                    # on (GOAWAY: idle or aged connections), fails the stream before it has
                    # answered: another gateway prepares it, as the router retries on the
                    # other path (Envoy keeps what it sent for a retry).
                    "retry_policy": retry_policy(RETRY_ON, mesh),
                },
                "message_timeout": seconds(mesh.prepare_timeout_seconds),
                # The headers, then the whole body (two round trips: full-duplex mode makes it
                # one, but then a stream's first token reached the caller late at 1 stream).
                "processing_mode": {
                    "request_header_mode": "SEND",
                    # Whole (BUFFERED_PARTIAL lets the headers go on before the body's
                    # answer, to the gateways, when the body comes in a later read). A body
                    # over the edge's buffer is refused (edge_local_replies).
                    "request_body_mode": "BUFFERED",
                    "response_header_mode": "SKIP",
                    "response_body_mode": "NONE",
                    "response_trailer_mode": "SKIP",
                },
                # No gateway to prepare it: the request fails rather than skip the gateway,
                # UNAVAILABLE (HTTP 503), as when no gateway can take it on the other path.
                "failure_mode_allow": False,
                "status_on_error": {"code": "ServiceUnavailable"},
                "metadata_options": {"forwarding_namespaces": {"untyped": [EDGE_METADATA]}},
            },
        }
    ]


def processor_off(mesh: MeshSettings) -> Config:
    """With direct_token_path, the edge's virtual host's external processor: off everywhere
    but the routes that enable it again (direct_routes)."""
    if not mesh.direct_token_path:
        return {}
    return {EXT_PROC: {"@type": EXT_PROC_PER_ROUTE, "disabled": True}}


def processed(answers: bool = False) -> Config:
    """The external processor on a route; with answers, the response's headers go to it too."""
    overrides: Config = {}
    if answers:
        overrides["processing_mode"] = {
            "request_header_mode": "SEND",
            "request_body_mode": "BUFFERED",
            "response_header_mode": "SEND",
            "response_body_mode": "NONE",
            "response_trailer_mode": "SKIP",
        }
    return {
        "typed_per_filter_config": {EXT_PROC: {"@type": EXT_PROC_PER_ROUTE, "overrides": overrides}}
    }


def direct_routes(mesh: MeshSettings, services: Services) -> list[Config]:
    """With direct_token_path: Generate goes through the external processor (which passes it
    on to the gateways, or rewrites it for the workers), and the rewritten request to the
    workers. A caller asking for the workers' method itself meets the processor too, which
    refuses it: only what a gateway prepared reaches a worker from the edge."""
    if not mesh.direct_token_path:
        return []
    to_workers = service_route(services.worker, mesh)
    # The caller's deadline is its own timer's and the worker's (grpc-timeout goes on to it):
    # Envoy cutting the stream at the same instant would reset it (INTERNAL) where the caller
    # would have seen DEADLINE_EXCEEDED; there is no gateway here to answer first.
    del to_workers["route"]["max_stream_duration"]
    to_workers = relayed(to_workers, mesh)

    def to_pools(route: Config) -> list[Config]:
        # The relay picks the pool's cluster itself (by the same header); the router by route.
        return [route] if mesh.relays else pool_routes(route, services)

    routes = [
        {**service_route(services.gateway, mesh), "match": {"path": LLM_GENERATE}, **processed()},
        *to_pools({**to_workers, "match": {"path": WORKER_GENERATE}, **processed()}),
    ]
    if mesh.openai_api:
        # OpenAI's completions, as the transcoder made them calls: the processor rewrites each
        # for the workers, or hands it back to the gateways' HTTP API (the /v1/ route), and
        # sees the workers' answer's headers (to answer a refusal in OpenAI's shape).
        routes += [
            {
                **service_route(services.gateway, mesh),
                "match": {"path": path},
                **processed(answers=True),
            }
            for path in (OPENAI_COMPLETIONS, OPENAI_CHAT_COMPLETIONS)
        ]
        openai_to_workers = {
            **to_workers,
            "match": {"path": WORKER_GENERATE_OPENAI},
            # The answer's HTTP headers are the worker's gRPC ones, less its gRPC encodings.
            "response_headers_to_remove": ["grpc-accept-encoding"],
        }
        routes += to_pools({**openai_to_workers, **processed()})
    return routes
