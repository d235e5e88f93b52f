"""Renders Envoy's bootstrap (static listeners and clusters, endpoints over ADS) from MeshSettings.

One function per concept (listener, route, cluster), each used for every service: the edge and
the internal hops share them, so a setting changes everywhere at once.
"""

from __future__ import annotations

import base64
import posixpath
from dataclasses import dataclass
from typing import Any

from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import FileDescriptor

from tokenmesh.common.errors import error_body
from tokenmesh.common.tokens import (
    AFFINITY_HEADER,
    CALLER_CONTENT_TYPE,
    EDGE_METADATA,
    LLM_GENERATE,
    OPENAI_CHAT_COMPLETIONS,
    OPENAI_COMPLETIONS,
    OPENAI_SERVICE,
    ROUTE_HEADER,
    UPSTREAM_HEADER,
    USAGE_TRAILER,
    WORKER_GENERATE,
    WORKER_GENERATE_OPENAI,
    WORKER_HEADER,
    WORKER_REFUSED,
)
from tokenmesh.meshconfig.config import MeshSettings
from tokenmesh.v1 import inference_pb2, llm_pb2, openai_pb2, ops_pb2, rerank_pb2, token_pb2

Config = dict[str, Any]

TYPE = "type.googleapis.com/"
HCM = TYPE + "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
ROUTER = TYPE + "envoy.extensions.filters.http.router.v3.Router"
HTTP_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
LOCAL_RATE_LIMIT = TYPE + "envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit"
EXT_PROC = "envoy.filters.http.ext_proc"
EXT_PROC_PER_ROUTE = TYPE + "envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute"
SECRET = TYPE + "envoy.extensions.transport_sockets.tls.v3.Secret"
# The secrets (certificates, the services' CA) Envoy's TLS contexts get over SDS.
EDGE_CERTIFICATE = "edge-certificate"
INTERNAL_CERTIFICATE = "internal-certificate"
UPSTREAM_CERTIFICATE = "upstream-certificate"
UPSTREAM_CA = "upstream-ca"
DOWNSTREAM_CONNECTIONS = (
    TYPE
    + "envoy.extensions.resource_monitors.downstream_connections.v3.DownstreamConnectionsConfig"
)

# The services behind each cluster, and the gRPC service each one's health check asks about.
HEALTH_SERVICES = {
    "gateway": "tokenmesh.v1.LLMService",
    "worker": "tokenmesh.v1.InferenceService",
    "reranker": "tokenmesh.v1.RerankService",
}
# The gateways' OpenAI HTTP API: its cluster (the gateways' openai_port), the edge's paths to
# it, and its HTTP health check.
OPENAI_CLUSTER = "openai"
OPENAI_PREFIX = "/v1/"
OPENAI_HEALTH_PATH = "/health"
# Envoy's own replies on OpenAI's paths, by status range (low, high), each answered as the
# gateway answers the status named (error_body(): OpenAI's error type for it); a client error
# the gateway never sends (408, 413, 431) is an invalid request.
OPENAI_REPLY_STATUSES = [
    (401, 401, 401),
    (403, 403, 403),
    (404, 404, 404),
    (429, 429, 429),
    (400, 499, 400),
    (500, 502, 500),
    (503, 599, 503),
]
# Why a request failed when no gateway could prepare it for the workers.
PREPARE_FAILED = "no gateway prepared the request"
# Where the edge serves the ops page (from the control plane's page port).
OPS_PAGE = "/ops/"
# With a stats listener: the admin interface as a cluster, and the only paths routed to it
# (Prometheus' scrape and the readiness probe; none of them changes Envoy's state).
ADMIN_CLUSTER = "envoy_admin"
STATS_PATHS = ("/stats/prometheus", "/ready")
RETRY_ON = "unavailable,reset,connect-failure,refused-stream"
# A worker at its admission bound refuses at once with RESOURCE_EXHAUSTED: another worker may
# have room (not retried at the edge: every gateway shares the same workers).
OVERLOADED = ",resource-exhausted"
# Retries go to another host: a host that just died still counts as healthy until its health
# checks fail (~1 s), and LEAST_REQUEST favours it (its streams are gone, so it looks idle), so
# without this every retry can land on the same dead host.
PREVIOUS_HOSTS = "envoy.retry_host_predicates.previous_hosts"
PREVIOUS_HOSTS_TYPE = TYPE + "envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"
# How often a retry may pick again when it lands on a previous host. LEAST_REQUEST draws two
# hosts with replacement and keeps the less busy, so with two workers the dead, idle one is
# drawn 3 times in 4: 5 picks still landed on it 1 time in 4 (0.75^5), 20 about 1 in 300.
HOST_SELECTION_ATTEMPTS = 20
ACCESS_LOG_FIELDS = {
    "time": "%START_TIME%",
    "path": "%REQ(:PATH)%",
    "protocol": "%PROTOCOL%",
    "response_code": "%RESPONSE_CODE%",
    "grpc_status": "%GRPC_STATUS%",
    "flags": "%RESPONSE_FLAGS%",
    # Why Envoy ended the stream as it did (e.g. max_duration_timeout,
    # upstream_reset_after_response_started{remote_reset}): the flags alone don't say.
    "details": "%RESPONSE_CODE_DETAILS%",
    "upstream_cluster": "%UPSTREAM_CLUSTER%",
    "upstream_host": "%UPSTREAM_HOST%",
    "duration_ms": "%DURATION%",
    # Where a stream's first response waited: until Envoy began sending the request upstream
    # (a free connection or stream), and had sent all of it, until the upstream's first byte
    # (its first message), until the first byte went downstream; and upstream attempts (1:
    # no retry).
    "upstream_sent_ms": "%COMMON_DURATION(DS_RX_BEG:US_TX_BEG:ms)%",
    "upstream_request_end_ms": "%COMMON_DURATION(DS_RX_BEG:US_TX_END:ms)%",
    "attempts": "%UPSTREAM_REQUEST_ATTEMPT_COUNT%",
    "first_byte_ms": "%RESPONSE_DURATION%",
    "first_sent_ms": "%COMMON_DURATION(DS_RX_BEG:DS_TX_BEG:ms)%",
    "bytes_sent": "%BYTES_SENT%",
    "request_id": "%REQ(X-REQUEST-ID)%",
}


def seconds(value: float) -> str:
    return f"{value:g}s"


@dataclass(frozen=True)
class HealthCheckTiming:
    """The numbers of the service clusters' active health checks as the config carries them:
    Envoy's values, or (CHART_HEALTH_CHECKS) placeholders for the chart's values."""

    timeout: str
    interval: str
    unhealthy_threshold: int | str
    healthy_threshold: int | str
    panic_threshold_percent: float | str

    @classmethod
    def of(cls, mesh: MeshSettings) -> HealthCheckTiming:
        panic = mesh.healthy_panic_threshold_percent
        return cls(
            timeout=seconds(mesh.health_check_timeout_seconds),
            interval=seconds(mesh.health_check_interval_seconds),
            unhealthy_threshold=mesh.health_check_unhealthy_threshold,
            healthy_threshold=mesh.health_check_healthy_threshold,
            panic_threshold_percent=int(panic) if panic.is_integer() else panic,
        )


# The kubernetes profiles' health-check numbers: the chart's ConfigMap puts its
# envoy.healthChecks values in their place (tokenmesh.envoyConfig in _helpers.tpl).
CHART_HEALTH_CHECKS = HealthCheckTiming(
    timeout="${TOKENMESH_HEALTH_CHECK_TIMEOUT}",
    interval="${TOKENMESH_HEALTH_CHECK_INTERVAL}",
    unhealthy_threshold="${TOKENMESH_HEALTH_CHECK_UNHEALTHY_THRESHOLD}",
    healthy_threshold="${TOKENMESH_HEALTH_CHECK_HEALTHY_THRESHOLD}",
    panic_threshold_percent="${TOKENMESH_HEALTHY_PANIC_THRESHOLD_PERCENT}",
)


# Envoy's policy for each worker_routing setting. Maglev rather than a ring hash: one table
# look-up per pick, and an even spread of keys over a few hosts (a ring of a few hosts needs
# many points per host to be even); both move only a departed host's keys elsewhere.
# picker is no enum value: the override-host policy is a typed extension (picker_policy).
PICKER = "PICKER"
WORKER_LB_POLICIES = {"least_request": "LEAST_REQUEST", "prefix": "MAGLEV", "picker": PICKER}


def picker_policy() -> Config:
    """The workers' load_balancing_policy for worker_routing picker: each attempt goes to the
    next worker the gateway's endpoint picker named (WORKER_HEADER); with none named, or all
    tried, least request."""
    return {
        "policies": [
            {
                "typed_extension_config": {
                    "name": "envoy.load_balancing_policies.override_host",
                    "typed_config": {
                        "@type": TYPE
                        + "envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
                        "override_host_sources": [{"header": WORKER_HEADER}],
                        "fallback_policy": {
                            "policies": [
                                {
                                    "typed_extension_config": {
                                        "name": "envoy.load_balancing_policies.least_request",
                                        "typed_config": {
                                            "@type": TYPE
                                            + "envoy.extensions.load_balancing_policies."
                                            "least_request.v3.LeastRequest"
                                        },
                                    }
                                }
                            ]
                        },
                    },
                }
            }
        ]
    }


@dataclass(frozen=True)
class WorkerBalancing:
    """How the workers' cluster picks a host: Envoy's policy and the bounded load's factor, or
    (CHART_WORKER_BALANCING) placeholders for the chart's values."""

    lb_policy: str
    hash_balance_factor: int | str

    @classmethod
    def of(cls, mesh: MeshSettings) -> WorkerBalancing:
        return cls(WORKER_LB_POLICIES[mesh.worker_routing], mesh.prefix_balance_factor_percent)


# The kubernetes profiles' worker balancing: the chart's ConfigMap puts its envoy.workerRouting
# values in their place (tokenmesh.envoyConfig in _helpers.tpl).
CHART_WORKER_BALANCING = WorkerBalancing(
    lb_policy="${TOKENMESH_WORKER_LB_POLICY}",
    hash_balance_factor="${TOKENMESH_PREFIX_BALANCE_FACTOR}",
)


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


def http2_options(mesh: MeshSettings, upstream: bool = False) -> Config:
    """A listener's options, or (upstream) a cluster's: an upstream connection carries every
    stream of a gateway or worker, so its connection window must hold a stream window for each
    stream that may stall at once (connection_window / stream_window stalled readers would
    stop every other stream on it); each stream's own window still bounds what it buffers."""
    connection_window = (
        mesh.upstream_connection_window_bytes if upstream else mesh.connection_window_bytes
    )
    options: Config = {
        "initial_stream_window_size": mesh.stream_window_bytes,
        "initial_connection_window_size": connection_window,
        "max_concurrent_streams": mesh.max_concurrent_streams,
    }
    if not upstream:
        options["max_outbound_frames"] = mesh.max_outbound_frames
    return options


def route_to(cluster: str, mesh: MeshSettings, prefix: str = "/") -> Config:
    """A route to cluster (by default catch-all), safe for long streams."""
    return {
        "match": {"prefix": prefix},
        "route": {
            "cluster": cluster,
            # The 15 s default route timeout would cut long generations: no overall timeout,
            # the caller's grpc-timeout is honoured instead (0s: no cap on it).
            "timeout": "0s",
            "max_stream_duration": {"grpc_timeout_header_max": "0s"},
            "retry_policy": retry_policy(
                RETRY_ON + (OVERLOADED if cluster == "worker" else ""), mesh
            ),
            # What a hashing policy (worker_routing prefix) places a worker stream by: the
            # gateway's prefix-affinity key. LEAST_REQUEST ignores it; a retry hashes again.
            **(
                {"hash_policy": [{"header": {"header_name": AFFINITY_HEADER}}]}
                if cluster == "worker"
                else {}
            ),
        },
    }


def retry_policy(retry_on: str, mesh: MeshSettings) -> Config:
    """Retries on another host, with a short back-off (a route's, or a gRPC service's)."""
    return {
        "retry_on": retry_on,
        "num_retries": mesh.retry_attempts,
        "retry_back_off": {"base_interval": "0.025s", "max_interval": "0.25s"},
        "retry_host_predicate": [
            {"name": PREVIOUS_HOSTS, "typed_config": {"@type": PREVIOUS_HOSTS_TYPE}}
        ],
        "host_selection_retry_max_attempts": HOST_SELECTION_ATTEMPTS,
    }


def access_log(listener: str) -> list[Config]:
    return [
        {
            "name": "envoy.access_loggers.stdout",
            "typed_config": {
                "@type": TYPE + "envoy.extensions.access_loggers.stream.v3.StdoutAccessLog",
                "log_format": {"json_format": {"listener": listener, **ACCESS_LOG_FIELDS}},
            },
        }
    ]


# How often each Envoy thread sends the direct streams' access-log entries it holds.
DIRECT_LOG_FLUSH_SECONDS = 0.5


def direct_stream_log(mesh: MeshSettings) -> list[Config]:
    """With direct_token_path: each stream the edge sent straight from a worker is logged to the
    gateways (gateway/accesslog.py), which record it in their metrics as if they had served it:
    its timings, the caller's deadline, its status and the worker's usage trailer. Batched, off
    the token path; no stream waits for it."""
    if not mesh.direct_token_path:
        return []
    return [
        {
            "name": "envoy.access_loggers.http_grpc",
            "filter": {
                "or_filter": {
                    "filters": [
                        {
                            "header_filter": {
                                "header": {"name": ":path", "string_match": {"exact": path}}
                            }
                        }
                        for path in (WORKER_GENERATE, WORKER_GENERATE_OPENAI)
                    ]
                }
            },
            "typed_config": {
                "@type": TYPE + "envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig",
                "common_config": {
                    "log_name": "direct_streams",
                    "transport_api_version": "V3",
                    "grpc_service": {"envoy_grpc": {"cluster_name": "gateway"}},
                    "buffer_flush_interval": seconds(DIRECT_LOG_FLUSH_SECONDS),
                },
                # The caller's deadline, and its trace for the gateway's span of the stream
                # (with the prefix-affinity key the worker was chosen by).
                "additional_request_headers_to_log": [
                    "grpc-timeout",
                    "traceparent",
                    "tracestate",
                    ROUTE_HEADER,
                    AFFINITY_HEADER,
                ],
                "additional_response_headers_to_log": ["grpc-status"],
                "additional_response_trailers_to_log": ["grpc-status", USAGE_TRAILER],
            },
        }
    ]


def code_details(expression: str) -> Config:
    """A local reply mapper's filter on why Envoy answered itself (%RESPONSE_CODE_DETAILS%,
    `response.code_details` in CEL: no other filter reads it)."""
    return {
        "extension_filter": {
            "name": "envoy.access_loggers.extension_filters.cel",
            "typed_config": {
                "@type": TYPE + "envoy.extensions.access_loggers.filters.cel.v3.ExpressionFilter",
                "expression": expression,
            },
        }
    }


def edge_local_replies(mesh: MeshSettings) -> Config:
    """Envoy's own answers, in the shape each caller reads: OpenAI's error object on OpenAI's
    paths (first: their 413 is not gRPC's), then the direct token path's messages."""
    mappers = openai_local_replies(mesh) + direct_local_replies(mesh)
    return {"local_reply_config": {"mappers": mappers}} if mappers else {}


def status_filter(op: str, status: int) -> Config:
    return {
        "status_code_filter": {
            "comparison": {
                "op": op,
                "value": {"default_value": status, "runtime_key": f"edge_{op.lower()}_{status}"},
            }
        }
    }


def openai_local_replies(mesh: MeshSettings) -> list[Config]:
    """With openai_api: what Envoy answers itself on OpenAI's paths (no healthy gateway, the
    edge's rate limit, an overflowing circuit breaker, a timeout, a body too large) becomes
    the gateway's own error_body(), with Envoy's reason as the message and application/json,
    so SDKs raise their usual errors. Local reply mappers never touch an upstream's answer:
    a gateway's own errors pass as they are."""
    if not mesh.openai_api:
        return []
    paths = [{"prefix": OPENAI_PREFIX}]
    if mesh.direct_token_path:
        # The paths OpenAI's requests have once transcoded, and once prepared for a worker.
        paths += [{"prefix": f"/{OPENAI_SERVICE}/"}, {"exact": WORKER_GENERATE_OPENAI}]
    filters = [
        {"header_filter": {"header": {"name": ":path", "string_match": match}}} for match in paths
    ]
    on_openai_paths = filters[0] if len(filters) == 1 else {"or_filter": {"filters": filters}}
    # A worker's refusal, which the external processor has already answered in OpenAI's
    # shape (gateway/extproc.py), is kept as it is.
    mappers: list[Config] = [
        {"filter": code_details(f"response.code_details == '{WORKER_REFUSED}'")}
    ]
    if mesh.direct_token_path:
        # No gateway to prepare a completion: why, as the gRPC path says it.
        prepare_failed = code_details("response.code_details.startsWith('ext_proc_error')")
        mappers.append(
            {
                "filter": {"and_filter": {"filters": [on_openai_paths, prepare_failed]}},
                "body_format_override": {
                    "json_format": error_body(
                        f"{PREPARE_FAILED} (%RESPONSE_CODE_DETAILS%); retry", 503
                    )
                },
            }
        )
    for low, high, status in OPENAI_REPLY_STATUSES:
        statuses = (
            [status_filter("EQ", low)]
            if low == high
            else [status_filter("GE", low), status_filter("LE", high)]
        )
        mappers.append(
            {
                "filter": {"and_filter": {"filters": [on_openai_paths, *statuses]}},
                "body_format_override": {"json_format": error_body("%LOCAL_REPLY_BODY%", status)},
            }
        )
    return mappers


def direct_local_replies(mesh: MeshSettings) -> list[Config]:
    """With the direct token path, Envoy's own answers get the message a caller needs. A
    request body over the edge's buffer (only the external processor buffers a gRPC body
    whole; every valid request fits with the default limits) is refused with HTTP 413, which
    gRPC would read as UNKNOWN: RESOURCE_EXHAUSTED with a message, as the gateways refuse a
    message over their cap. A request no gateway prepared fails UNAVAILABLE (HTTP 503/504:
    retry), which Envoy sends without a message: it says why, and names the limit."""
    if not mesh.direct_token_path:
        return []
    prepare_failed = PREPARE_FAILED
    return [
        {
            "filter": code_details(
                "response.code_details == 'ext_proc_error_per-message_timeout_exceeded'"
            ),
            "body": {
                "inline_string": (
                    f"{prepare_failed} within the edge's prepare_timeout_seconds "
                    f"({mesh.prepare_timeout_seconds:g} s); retry"
                )
            },
        },
        {
            "filter": code_details("response.code_details.startsWith('ext_proc_error')"),
            "body_format_override": {
                "text_format_source": {
                    "inline_string": f"{prepare_failed} (%RESPONSE_CODE_DETAILS%); retry"
                }
            },
        },
        {
            "filter": status_filter("EQ", 413),
            "headers_to_add": [
                {
                    "header": {"key": "grpc-status", "value": "8"},
                    "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
                }
            ],
            "body": {
                "inline_string": (
                    f"request: the body is over the edge's limit of {mesh.buffer_limit_bytes} bytes"
                )
            },
        },
    ]


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
        {"name": "envoy.filters.http.router", "typed_config": {"@type": ROUTER}},
    ]


def transcoded_services(mesh: MeshSettings) -> list[str]:
    """LLMService's REST; with the direct token path and the OpenAI API, OpenAI's completions
    too (openai.proto): as calls the external processor prepares for a worker, whose answer
    (HttpBody) the transcoder writes to the caller as it comes."""
    services = [llm_pb2.DESCRIPTOR.services_by_name["LLMService"].full_name]
    if mesh.direct_token_path and mesh.openai_api:
        services.append(OPENAI_SERVICE)
    return services


def caller_content_type(mesh: MeshSettings) -> list[Config]:
    """With direct_token_path: the caller's content-type, kept in the stream's metadata for the
    external processor before the gRPC-Web filter rewrites it to gRPC. That filter moves a
    stream's trailers into its body, so Envoy's access log would get neither its status nor its
    usage: gRPC-Web streams take the gateway's path."""
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
            },
        }
    ]


def external_processor(mesh: MeshSettings) -> list[Config]:
    """With direct_token_path: a gateway prepares each Generate request (its headers and whole
    body, after gRPC-Web and REST are turned into gRPC) and Envoy routes the rewritten request
    to the workers. The responses (the tokens) are not sent to it. Enabled on the Generate
    routes only (edge_routes)."""
    if not mesh.direct_token_path:
        return []
    return [
        {
            "name": EXT_PROC,
            "typed_config": {
                "@type": TYPE + "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
                "grpc_service": {
                    "envoy_grpc": {"cluster_name": "gateway"},
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


def cors_policy(mesh: MeshSettings) -> Config:
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


def edge_routes(mesh: MeshSettings) -> list[Config]:
    """The ops feed (gRPC and gRPC-Web) and page to the control plane, the rest to gateways."""
    return [
        route_to(
            "ops",
            mesh,
            prefix="/" + ops_pb2.DESCRIPTOR.services_by_name["OpsService"].full_name + "/",
        ),
        {"match": {"path": OPS_PAGE.rstrip("/")}, "redirect": {"path_redirect": OPS_PAGE}},
        {"match": {"prefix": OPS_PAGE}, "route": {"cluster": "ops_page", "timeout": "10s"}},
        # Envoy's own interfaces on the gateways (external processor, access log) are for the
        # mesh's Envoys, not callers: UNIMPLEMENTED (HTTP 404).
        {
            "match": {"prefix": "/envoy.service."},
            "direct_response": {"status": 404, "body": {"inline_string": "not served here"}},
        },
        *direct_routes(mesh),
        *openai_routes(mesh),
        route_to("gateway", mesh),
    ]


def openai_routes(mesh: MeshSettings) -> list[Config]:
    """With openai_api: OpenAI's HTTP API (/v1/...) to the gateways' HTTP port, per request
    (least outstanding requests), no overall timeout (a stream lasts as long as it
    generates). Retried only when it never reached a gateway: a POST is not idempotent."""
    if not mesh.openai_api:
        return []
    return [
        {
            "match": {"prefix": OPENAI_PREFIX},
            "route": {
                "cluster": OPENAI_CLUSTER,
                "timeout": "0s",
                "retry_policy": retry_policy("connect-failure,reset-before-request", mesh),
            },
        }
    ]


def direct_routes(mesh: MeshSettings) -> list[Config]:
    """With direct_token_path: Generate goes through the external processor (which passes it
    on to the gateways, or rewrites it for the workers), and the rewritten request to the
    workers. A caller asking for the workers' method itself meets the processor too, which
    refuses it: only what a gateway prepared reaches a worker from the edge."""
    if not mesh.direct_token_path:
        return []
    to_workers = route_to("worker", mesh)
    # The caller's deadline is its own timer's and the worker's (grpc-timeout goes on to it):
    # Envoy cutting the stream at the same instant would reset it (INTERNAL) where the caller
    # would have seen DEADLINE_EXCEEDED; there is no gateway here to answer first.
    del to_workers["route"]["max_stream_duration"]
    routes = [
        {**route_to("gateway", mesh), "match": {"path": LLM_GENERATE}, **processed()},
        {**to_workers, "match": {"path": WORKER_GENERATE}, **processed()},
    ]
    if mesh.openai_api:
        # OpenAI's completions, as the transcoder made them calls: the processor rewrites each
        # for the workers, or hands it back to the gateways' HTTP API (the /v1/ route), and
        # sees the workers' answer's headers (to answer a refusal in OpenAI's shape).
        routes += [
            {**route_to("gateway", mesh), "match": {"path": path}, **processed(answers=True)}
            for path in (OPENAI_COMPLETIONS, OPENAI_CHAT_COMPLETIONS)
        ]
        openai_to_workers = {
            **to_workers,
            "match": {"path": WORKER_GENERATE_OPENAI},
            # The answer's HTTP headers are the worker's gRPC ones, less its gRPC encodings.
            "response_headers_to_remove": ["grpc-accept-encoding"],
        }
        routes.append({**openai_to_workers, **processed()})
    return routes


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


def listener(name: str, host: str, port: int, cluster: str, mesh: MeshSettings) -> Config:
    edge = name == "edge"
    routes = edge_routes(mesh) if edge else [route_to(cluster, mesh)]
    virtual_host: Config = {"name": cluster, "domains": ["*"], "routes": routes}
    if cluster == "worker":
        # Which worker took a gateway's call, for the gateway's span. Internal listener only:
        # the edge never tells callers the workers' addresses.
        virtual_host["response_headers_to_add"] = [
            {
                "header": {"key": UPSTREAM_HEADER, "value": "%UPSTREAM_REMOTE_ADDRESS%"},
                "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
            }
        ]
    if edge:
        virtual_host["typed_per_filter_config"] = cors_policy(mesh)
        if mesh.direct_token_path:
            # Off everywhere but the routes that enable it again (direct_routes).
            virtual_host["typed_per_filter_config"][EXT_PROC] = {
                "@type": EXT_PROC_PER_ROUTE,
                "disabled": True,
            }
    manager: Config = {
        "@type": HCM,
        "stat_prefix": name,
        # The edge speaks HTTP/1.1 too (REST, gRPC-Web); internal hops are gRPC only.
        "codec_type": "AUTO" if edge else "HTTP2",
        "http2_protocol_options": http2_options(mesh),
        "stream_idle_timeout": seconds(mesh.stream_idle_timeout_seconds),
        # Bounds on what a request's headers may cost (docs/security.md, "Edge protections").
        "max_request_headers_kb": mesh.max_request_headers_kib,
        "common_http_protocol_options": {"max_headers_count": mesh.max_headers_count},
        "request_headers_timeout": seconds(mesh.request_headers_timeout_seconds),
        **(edge_local_replies(mesh) if edge else {}),
        "access_log": access_log(name) + (direct_stream_log(mesh) if edge else []),
        "route_config": {"name": name, "virtual_hosts": [virtual_host]},
        "http_filters": edge_filters(mesh)
        if edge
        else [{"name": "envoy.filters.http.router", "typed_config": {"@type": ROUTER}}],
    }
    chain: Config = {
        "filters": [
            {
                "name": "envoy.filters.network.http_connection_manager",
                "typed_config": manager,
            }
        ]
    }
    if edge and mesh.edge_tls_cert_file:
        # HTTP/2 (gRPC) and HTTP/1.1 (REST, gRPC-Web) by ALPN.
        chain["transport_socket"] = downstream_tls(EDGE_CERTIFICATE, mesh, ["h2", "http/1.1"])
    if not edge and mesh.internal_tls_cert_file:
        chain["transport_socket"] = downstream_tls(INTERNAL_CERTIFICATE, mesh, ["h2"])
    return {
        "name": name,
        "address": {"socket_address": {"address": host, "port_value": port}},
        # What /drain_listeners?inboundonly drains (the chart's preStop); the stats listener
        # is not marked, so probes and scrapes go on while the others drain.
        "traffic_direction": "INBOUND",
        "per_connection_buffer_limit_bytes": mesh.buffer_limit_bytes,
        # Only client connections count towards max_edge_connections: gateways keep reaching
        # workers and the reranker when the edge is full.
        "ignore_global_conn_limit": not edge,
        "filter_chains": [chain],
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
        "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {"@type": ROUTER}}],
    }
    return [
        {
            "name": "stats",
            "address": {
                "socket_address": {"address": mesh.stats_host, "port_value": mesh.stats_port}
            },
            # Probes and scrapes get through when the edge is at its connection limit.
            "ignore_global_conn_limit": True,
            "filter_chains": [
                {
                    "filters": [
                        {
                            "name": "envoy.filters.network.http_connection_manager",
                            "typed_config": manager,
                        }
                    ]
                }
            ],
        }
    ]


def admin_cluster(mesh: MeshSettings) -> list[Config]:
    """With stats_port: the admin interface (on 127.0.0.1 when it listens everywhere), for
    the stats listener's routes (the pattern of Envoy's own examples that expose
    /stats/prometheus)."""
    if mesh.stats_port is None:
        return []
    host = "127.0.0.1" if mesh.admin_host in ("0.0.0.0", "::") else mesh.admin_host
    address = {"socket_address": {"address": host, "port_value": mesh.admin_port}}
    return [
        {
            "name": ADMIN_CLUSTER,
            "type": "STATIC",
            "connect_timeout": "1s",
            "load_assignment": {
                "cluster_name": ADMIN_CLUSTER,
                "endpoints": [{"lb_endpoints": [{"endpoint": {"address": address}}]}],
            },
        }
    ]


def certificate(cert_file: str, key_file: str) -> Config:
    """A certificate and key from files, read again together when their directory changes."""
    return {
        "certificate_chain": {"filename": cert_file},
        "private_key": {"filename": key_file},
        "watched_directory": {"path": posixpath.dirname(cert_file)},
    }


def secrets(mesh: MeshSettings) -> dict[str, Config]:
    """The secrets Envoy's TLS contexts name, by name: each certificate and the services' CA.
    SDS delivers them, so Envoy reads their files again when a renewed Secret swaps their
    directory; set in the bootstrap, a certificate would be read once, at start-up."""
    found: dict[str, Config] = {}
    if mesh.edge_tls_cert_file and mesh.edge_tls_key_file:
        found[EDGE_CERTIFICATE] = {
            "tls_certificate": certificate(mesh.edge_tls_cert_file, mesh.edge_tls_key_file)
        }
    if mesh.internal_tls_cert_file and mesh.internal_tls_key_file:
        found[INTERNAL_CERTIFICATE] = {
            "tls_certificate": certificate(mesh.internal_tls_cert_file, mesh.internal_tls_key_file)
        }
    if mesh.upstream_tls_cert_file and mesh.upstream_tls_key_file and mesh.upstream_tls_ca_file:
        found[UPSTREAM_CERTIFICATE] = {
            "tls_certificate": certificate(mesh.upstream_tls_cert_file, mesh.upstream_tls_key_file)
        }
        found[UPSTREAM_CA] = {
            "validation_context": {
                "trusted_ca": {"filename": mesh.upstream_tls_ca_file},
                "watched_directory": {"path": posixpath.dirname(mesh.upstream_tls_ca_file)},
            }
        }
    return found


def sds_path(name: str, mesh: MeshSettings) -> str:
    """The SDS file of the secret name."""
    assert mesh.sds_dir is not None
    return posixpath.join(mesh.sds_dir, f"sds-{name}.yaml")


def secret_files(mesh: MeshSettings) -> dict[str, Config]:
    """The SDS files the bootstrap names, by path: one secret each (a DiscoveryResponse's
    shape), for whoever writes Envoy's config (the local mesh, the chart's ConfigMap)."""
    return {
        sds_path(name, mesh): {"resources": [{"@type": SECRET, "name": name, **secret}]}
        for name, secret in secrets(mesh).items()
    }


def sds(name: str, mesh: MeshSettings) -> Config:
    """A secret from its SDS file, read again when sds_dir changes (a ConfigMap's update swaps
    it as a Secret's does)."""
    assert mesh.sds_dir is not None
    return {
        "name": name,
        "sds_config": {
            "path_config_source": {
                "path": sds_path(name, mesh),
                "watched_directory": {"path": mesh.sds_dir},
            },
            "resource_api_version": "V3",
        },
    }


def downstream_tls(secret: str, mesh: MeshSettings, alpn: list[str]) -> Config:
    """TLS on a listener with the certificate secret, offering the alpn protocols."""
    return {
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            "@type": TYPE + "envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext",
            "common_tls_context": {
                "alpn_protocols": alpn,
                "tls_certificate_sds_secret_configs": [sds(secret, mesh)],
            },
        },
    }


def upstream_tls(name: str, mesh: MeshSettings) -> Config:
    """mTLS towards a service cluster: Envoy's client certificate, the CA, and the service's
    certificate must name the cluster (DNS SAN; also sent as SNI). HTTP/2 only, by ALPN. The
    cluster's health checks use this transport socket too. The openai cluster's hosts are the
    gateways' HTTP ports: their certificate names the gateway, over HTTP/1.1."""
    assert mesh.upstream_mtls
    openai = name == OPENAI_CLUSTER
    service = "gateway" if openai else name
    return {
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            "@type": TYPE + "envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
            "sni": service,
            "common_tls_context": {
                "alpn_protocols": ["http/1.1"] if openai else ["h2"],
                "tls_certificate_sds_secret_configs": [sds(UPSTREAM_CERTIFICATE, mesh)],
                # The CA from SDS, the name this cluster's hosts must carry from here.
                "combined_validation_context": {
                    "default_validation_context": {
                        "match_typed_subject_alt_names": [
                            {"san_type": "DNS", "matcher": {"exact": service}}
                        ],
                    },
                    "validation_context_sds_secret_config": sds(UPSTREAM_CA, mesh),
                },
            },
        },
    }


def grpc_upstream(mesh: MeshSettings) -> Config:
    return {
        HTTP_OPTIONS: {
            "@type": TYPE + HTTP_OPTIONS,
            "explicit_http_config": {"http2_protocol_options": http2_options(mesh, upstream=True)},
        }
    }


def service_cluster(
    name: str,
    mesh: MeshSettings,
    checks: HealthCheckTiming,
    balancing: WorkerBalancing | None = None,
) -> Config:
    """A cluster named after its service, endpoints over ADS, actively health-checked; the
    workers' balanced as `balancing` says."""
    cluster: Config = {
        "name": name,
        "type": "EDS",
        "eds_cluster_config": {"eds_config": {"ads": {}, "resource_api_version": "V3"}},
        "connect_timeout": "1s",
        "per_connection_buffer_limit_bytes": mesh.buffer_limit_bytes,
        # Least outstanding requests, per stream: long and short generations even out.
        "lb_policy": "LEAST_REQUEST",
        "typed_extension_protocol_options": grpc_upstream(mesh),
        "health_checks": [
            {
                "timeout": checks.timeout,
                "interval": checks.interval,
                "no_traffic_interval": checks.interval,
                "unhealthy_threshold": checks.unhealthy_threshold,
                "healthy_threshold": checks.healthy_threshold,
                **(
                    {"http_health_check": {"path": OPENAI_HEALTH_PATH}}
                    if name == OPENAI_CLUSTER
                    else {"grpc_health_check": {"service_name": HEALTH_SERVICES[name]}}
                ),
            }
        ],
        "common_lb_config": {
            # With the default 50 %, Envoy sends to unhealthy hosts when most are down.
            "healthy_panic_threshold": {"value": checks.panic_threshold_percent},
            # Health changes reach the load balancers at once. By default Envoy merges them for
            # up to 1 s (a window meant for clusters of thousands of hosts), so a worker that
            # had just passed its first check got no stream for a second while another died.
            "update_merge_window": "0s",
        },
        # A host removed by discovery stops getting streams even while it still passes checks.
        "ignore_health_on_host_removal": True,
        # Per-host request, error and active-request stats (envoy_cluster_endpoint_* at
        # /stats/prometheus, labelled envoy_endpoint_address): how streams spread over replicas.
        "track_cluster_stats": {"per_endpoint_stats": True},
        "circuit_breakers": {
            "thresholds": [
                {
                    "max_connections": 1024,
                    "max_pending_requests": 1024,
                    "max_requests": 4096,
                    "retry_budget": {
                        "budget_percent": {"value": mesh.retry_budget_percent},
                        "min_retry_concurrency": mesh.retry_min_concurrency,
                    },
                }
            ]
        },
    }
    if balancing is not None and balancing.lb_policy == PICKER:
        del cluster["lb_policy"]
        cluster["load_balancing_policy"] = picker_policy()
    elif balancing is not None:
        cluster["lb_policy"] = balancing.lb_policy
        # Bounded load, for the hashing policy (LEAST_REQUEST ignores it): a host with more than
        # this percentage of the mean streams in flight is passed over for the next one.
        cluster["common_lb_config"]["consistent_hashing_lb_config"] = {
            "hash_balance_factor": balancing.hash_balance_factor
        }
    if name == OPENAI_CLUSTER:
        # HTTP/1.1 (uvicorn), a connection per stream in flight.
        del cluster["typed_extension_protocol_options"]
    if mesh.upstream_mtls:
        cluster["transport_socket"] = upstream_tls(name, mesh)
    if name == "worker":
        # A worker whose connections fail (killed, its port closed) leaves the table at the
        # first failure, not at its next failed health check; a passing check brings it back.
        # Hashing under bounded load (worker_routing prefix) needs it: a dead worker has no
        # streams, so it is the least loaded, and every pick and retry would go to it until
        # then. Only connection failures count: a worker's gRPC answers never eject it (the
        # ejections Envoy enforces by default besides, 5xx and success rate, are off).
        cluster["outlier_detection"] = {
            "split_external_local_origin_errors": True,
            "consecutive_local_origin_failure": 1,
            "enforcing_consecutive_5xx": 0,
            "enforcing_success_rate": 0,
            "enforcing_local_origin_success_rate": 0,
            "base_ejection_time": "10s",
            "max_ejection_percent": 100,
        }
    if name == "reranker":
        # Eject a failing reranker host quickly, before the gateway's own breaker opens, and
        # bound what may pile up in front of a slow one.
        cluster["outlier_detection"] = {
            "consecutive_5xx": 3,
            "consecutive_gateway_failure": 3,
            "interval": "1s",
            "base_ejection_time": "5s",
            "max_ejection_percent": 100,
        }
        cluster["circuit_breakers"]["thresholds"][0].update(
            {"max_pending_requests": 64, "max_requests": 256}
        )
    return cluster


def static_cluster(name: str, host: str, port: int, mesh: MeshSettings, grpc: bool) -> Config:
    """A cluster of one fixed address (the control plane's): gRPC over HTTP/2, or HTTP/1.1."""
    cluster: Config = {
        "name": name,
        "type": mesh.controlplane_discovery,
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


def render(
    mesh: MeshSettings,
    checks: HealthCheckTiming | None = None,
    balancing: WorkerBalancing | None = None,
) -> Config:
    """Envoy's bootstrap: the edge and internal listeners, one cluster per service; checks
    and balancing replace the mesh's health-check numbers and worker balancing (the chart's
    placeholders)."""
    checks = checks or HealthCheckTiming.of(mesh)
    balancing = balancing or WorkerBalancing.of(mesh)
    return {
        "node": {"id": mesh.node_id, "cluster": "tokenmesh"},
        "admin": {
            "address": {
                "socket_address": {"address": mesh.admin_host, "port_value": mesh.admin_port}
            },
            # Probes and metrics scrapes get through when the edge is at its connection limit.
            "ignore_global_conn_limit": True,
        },
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
                "grpc_services": [{"envoy_grpc": {"cluster_name": "xds_cluster"}}],
            }
        },
        "static_resources": {
            "listeners": [
                listener("edge", mesh.edge_host, mesh.edge_port, "gateway", mesh),
                listener("worker", mesh.internal_host, mesh.worker_listener_port, "worker", mesh),
                listener(
                    "reranker", mesh.internal_host, mesh.reranker_listener_port, "reranker", mesh
                ),
                *stats_listener(mesh),
            ],
            "clusters": [
                service_cluster("gateway", mesh, checks),
                service_cluster("worker", mesh, checks, balancing),
                service_cluster("reranker", mesh, checks),
                *([service_cluster(OPENAI_CLUSTER, mesh, checks)] if mesh.openai_api else []),
                # The control plane: xDS for Envoy itself, the ops feed and page for the edge.
                static_cluster(
                    "xds_cluster", mesh.controlplane_host, mesh.controlplane_port, mesh, grpc=True
                ),
                static_cluster(
                    "ops", mesh.controlplane_host, mesh.controlplane_port, mesh, grpc=True
                ),
                static_cluster(
                    "ops_page", mesh.controlplane_host, mesh.ops_page_port, mesh, grpc=False
                ),
                *admin_cluster(mesh),
            ],
        },
    }
