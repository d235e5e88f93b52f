"""Access logs: stdout on every listener, the direct streams' log to the gateways."""

from __future__ import annotations

from tests.unit.test_meshconfig import listeners
from tokenmesh.common.tokens import ROUTE_HEADER, USAGE_TRAILER
from tokenmesh.meshconfig.bootstrap import render
from tokenmesh.meshconfig.config import MeshSettings


def test_the_direct_token_path_logs_each_worker_stream_to_the_gateways() -> None:
    """The gateways' metrics count the streams they never see (gateway/frontends/direct_log.py)
    from Envoy's gRPC access log: only the workers' Generate, with what the gateway reads."""
    found = listeners(render(MeshSettings(direct_token_path=True)))
    logs = {log["name"]: log for log in found["edge"]["access_log"]}
    direct = logs["envoy.access_loggers.http_grpc"]
    paths = [f["header_filter"]["header"] for f in direct["filter"]["or_filter"]["filters"]]
    assert paths == [
        {"name": ":path", "string_match": {"exact": "/tokenmesh.v1.InferenceService/Generate"}},
        {
            "name": ":path",
            "string_match": {"exact": "/tokenmesh.v1.InferenceService/GenerateOpenAI"},
        },
    ]
    config = direct["typed_config"]
    assert config["common_config"]["grpc_service"]["envoy_grpc"]["cluster_name"] == "gateway"
    assert config["common_config"]["transport_api_version"] == "V3"
    assert config["additional_request_headers_to_log"] == [
        "grpc-timeout",
        "traceparent",
        "tracestate",
        ROUTE_HEADER,
        "x-tokenmesh-affinity",
    ]
    assert config["additional_response_trailers_to_log"] == ["grpc-status", USAGE_TRAILER]
    # Internal listeners log to stdout only.
    for name in ("worker", "reranker"):
        assert [log["name"] for log in found[name]["access_log"]] == ["envoy.access_loggers.stdout"]
