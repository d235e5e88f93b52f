"""Access logs: every listener's JSON lines on stdout, and the direct token path's log of the
streams the edge sent straight from a worker, to the gateways."""

from __future__ import annotations

from tokenmesh.common.tokens import (
    AFFINITY_HEADER,
    EDGE_METADATA,
    EDGE_WORKER,
    ROUTE_HEADER,
    USAGE_TRAILER,
    WORKER_GENERATE,
    WORKER_GENERATE_OPENAI,
)
from tokenmesh.meshconfig.config import MeshSettings
from tokenmesh.meshconfig.constants import GATEWAY, TYPE, WORKER, Config, seconds
from tokenmesh.meshconfig.direct_path import EXT_PROC

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
    # The stream's start and the first response's waits again in µs (a first token's stages
    # take a few ms or less): loadtests/first_token_stages.py places them between the
    # client's clock and the worker's (Token.emitted_unix_nanos), all the wall clock.
    "start_unix_us": "%START_TIME(%s%6f)%",
    "upstream_sent_us": "%COMMON_DURATION(DS_RX_BEG:US_TX_BEG:us)%",
    "first_byte_us": "%COMMON_DURATION(DS_RX_BEG:US_RX_BEG:us)%",
    "first_sent_us": "%COMMON_DURATION(DS_RX_BEG:DS_TX_BEG:us)%",
}
# How often each Envoy thread sends the direct streams' access-log entries it holds.
DIRECT_LOG_FLUSH_SECONDS = 0.5


# The edge's line also names the worker a direct stream ended on (its answer's UPSTREAM_HEADER,
# which the edge keeps in its metadata: direct_path.caller_content_type), relayed or not.
# With the direct token path, how long the edge waited on the gateway's answers to the
# request's headers and to its body (the external processor's logging info): the request's
# preparation, the gRPC hop to the gateway included.
EDGE_FIELDS = {
    "worker": f"%DYNAMIC_METADATA({EDGE_METADATA}:{EDGE_WORKER})%",
    "prepare_headers_us": f"%FILTER_STATE({EXT_PROC}:FIELD:request_header_latency_us)%",
    "prepare_body_us": f"%FILTER_STATE({EXT_PROC}:FIELD:request_body_total_latency_us)%",
}
# The edge's stream relay's dynamic metadata (envoy/relay): the worker a stream ended on, and
# how often it moved to another worker and was parked while its caller did not read.
RELAY_METADATA = "tokenmesh.relay"
RELAY_FIELDS = {
    "upstream_host": f"%DYNAMIC_METADATA({RELAY_METADATA}:worker)%",
    "moves": f"%DYNAMIC_METADATA({RELAY_METADATA}:moves)%",
    "parks": f"%DYNAMIC_METADATA({RELAY_METADATA}:parks)%",
}


def access_log(listener: str, fields: Config | None = None) -> list[Config]:
    """A listener's log: one JSON line per stream on stdout; fields replace or add to the
    common ones."""
    return [
        {
            "name": "envoy.access_loggers.stdout",
            "typed_config": {
                "@type": TYPE + "envoy.extensions.access_loggers.stream.v3.StdoutAccessLog",
                "log_format": {
                    "json_format": {"listener": listener, **ACCESS_LOG_FIELDS, **(fields or {})}
                },
            },
        }
    ]


def relay_access_log(listener: str) -> list[Config]:
    """The relay's listener's log: the edge's line says the stream went to the relay; this one
    names the worker it ended on (the relay is no router: Envoy's upstream fields stay empty)
    and its moves and parks."""
    return access_log(listener, {"upstream_cluster": WORKER, **RELAY_FIELDS})


def direct_stream_log(mesh: MeshSettings) -> list[Config]:
    """With direct_token_path: each stream the edge sent straight from a worker is logged to the
    gateways (gateway/frontends/direct_log.py), which record it in their metrics as if they had
    served it: its timings, the caller's deadline, its status and the worker's usage trailer.
    Batched, off the token path; no stream waits for it."""
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
                    "grpc_service": {"envoy_grpc": {"cluster_name": GATEWAY}},
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
