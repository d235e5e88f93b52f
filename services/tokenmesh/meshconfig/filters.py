"""The edge's HTTP filters: gRPC-Web, CORS, the edge rate limit, REST/JSON transcoding, the
direct token path's processor, then the router; and the CORS policy they apply."""

from __future__ import annotations

import base64

from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import FileDescriptor

from tokenmesh.common.tokens import OPENAI_SERVICE
from tokenmesh.meshconfig.config import MeshSettings
from tokenmesh.meshconfig.constants import ROUTER, TYPE, Config
from tokenmesh.meshconfig.direct_path import caller_content_type, external_processor
from tokenmesh.v1 import inference_pb2, llm_pb2, openai_pb2, ops_pb2, rerank_pb2, token_pb2

LOCAL_RATE_LIMIT = TYPE + "envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit"


def router_filter() -> Config:
    """The router, last in every listener's filters."""
    return {"name": "envoy.filters.http.router", "typed_config": {"@type": ROUTER}}


def descriptor_set() -> bytes:
    """The public API's FileDescriptorSet, for the gRPC-JSON transcoder (dependencies first)."""
    files: list[FileDescriptor] = []

    def add(file: FileDescriptor) -> None:
        for dependency in file.dependencies:
            add(dependency)
        if file not in files:
            files.append(file)

    for module in (token_pb2, llm_pb2, inference_pb2, rerank_pb2, ops_pb2, openai_pb2):
        add(module.DESCRIPTOR)
    descriptors = descriptor_pb2.FileDescriptorSet()
    for file in files:
        file.CopyToProto(descriptors.file.add())
    return bytes(descriptors.SerializeToString())


def always() -> Config:
    return {"default_value": {"numerator": 100, "denominator": "HUNDRED"}}


def edge_rate_limit(mesh: MeshSettings) -> list[Config]:
    """One token bucket for every request at the edge (none when the rate is 0). Placed after
    gRPC-Web (so its refusals reach browsers as gRPC-Web) and CORS (preflights are free)."""
    if not mesh.edge_rate_limit_per_second:
        return []
    return [
        {
            "name": "envoy.filters.http.local_ratelimit",
            "typed_config": {
                "@type": LOCAL_RATE_LIMIT,
                "stat_prefix": "edge_rate_limit",
                "token_bucket": {
                    "max_tokens": mesh.edge_rate_burst,
                    "tokens_per_fill": mesh.edge_rate_limit_per_second,
                    "fill_interval": "1s",
                },
                # Without these two the filter does nothing (both default to 0 %).
                "filter_enabled": {"runtime_key": "edge_rate_limit_enabled", **always()},
                "filter_enforced": {"runtime_key": "edge_rate_limit_enforced", **always()},
                # HTTP 429 maps to UNAVAILABLE for gRPC, which clients retry at once;
                # RESOURCE_EXHAUSTED says "back off", like the gateways' own limits.
                "rate_limited_as_resource_exhausted": True,
                "response_headers_to_add": [
                    {
                        "header": {"key": "retry-after-ms", "value": "1000"},
                        "append_action": ("OVERWRITE_IF_EXISTS_OR_ADD"),
                    }
                ],
            },
        }
    ]


def transcoded_services(mesh: MeshSettings) -> list[str]:
    """LLMService's REST; with the direct token path and the OpenAI API, OpenAI's completions
    too (openai.proto): as calls the external processor prepares for a worker, whose answer
    (HttpBody) the transcoder writes to the caller as it comes."""
    services = [llm_pb2.DESCRIPTOR.services_by_name["LLMService"].full_name]
    if mesh.direct_token_path and mesh.openai_api:
        services.append(OPENAI_SERVICE)
    return services


def edge_filters(mesh: MeshSettings) -> list[Config]:
    """gRPC-Web and CORS for browsers, the edge rate limit, REST/JSON transcoding, then
    routing."""
    return [
        *caller_content_type(mesh),
        {
            "name": "envoy.filters.http.grpc_web",
            "typed_config": {"@type": TYPE + "envoy.extensions.filters.http.grpc_web.v3.GrpcWeb"},
        },
        {
            "name": "envoy.filters.http.cors",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.cors.v3.Cors"
            },
        },
        *edge_rate_limit(mesh),
        {
            "name": "envoy.filters.http.grpc_json_transcoder",
            "typed_config": {
                "@type": TYPE
                + "envoy.extensions.filters.http.grpc_json_transcoder.v3.GrpcJsonTranscoder",
                "proto_descriptor_bin": base64.b64encode(descriptor_set()).decode(),
                "services": transcoded_services(mesh),
                # POST /tokenmesh.v1.LLMService/Generate with a JSON body.
                "auto_mapping": True,
                "convert_grpc_status": True,
                "print_options": {
                    "always_print_primitive_fields": True,
                    "preserve_proto_field_names": True,
                    # A server stream arrives as one JSON object per line, as it is generated.
                    "stream_newline_delimited": True,
                },
            },
        },
        *external_processor(mesh),
        router_filter(),
    ]


def cors_policy(mesh: MeshSettings) -> Config:
    """The edge's CORS policy (per virtual host): the allowed origins, and what browsers may
    send and read."""
    return {
        "envoy.filters.http.cors": {
            "@type": TYPE + "envoy.extensions.filters.http.cors.v3.CorsPolicy",
            "allow_origin_string_match": [
                {"safe_regex": {"regex": origin}} for origin in mesh.cors_allowed_origins
            ],
            "allow_methods": "POST, GET, OPTIONS",
            "allow_headers": (
                "content-type,x-grpc-web,x-user-agent,grpc-timeout,authorization,x-api-key"
            ),
            # retry-after-ms: refusals are trailers-only (HTTP headers); browsers must see it.
            "expose_headers": "grpc-status,grpc-message,x-tokenmesh-degraded,retry-after-ms",
            "max_age": "86400",
        }
    }
