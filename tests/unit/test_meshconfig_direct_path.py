"""The direct token path at the edge: the external processor and the routes to the workers."""

from __future__ import annotations

from tests.unit.test_meshconfig import listeners
from tokenmesh.meshconfig.bootstrap import render
from tokenmesh.meshconfig.config import MeshSettings
from tokenmesh.meshconfig.stream_relay import RELAY


def test_the_direct_token_path_processes_generate_only_and_routes_it_to_workers() -> None:
    plain = listeners(render(MeshSettings(direct_token_path=False)))["edge"]
    assert all(f["name"] != "envoy.filters.http.ext_proc" for f in plain["http_filters"])
    assert all(f["name"] != "envoy.filters.http.header_to_metadata" for f in plain["http_filters"])
    assert [log["name"] for log in plain["access_log"]] == ["envoy.access_loggers.stdout"]
    routes = plain["route_config"]["virtual_hosts"][0]["routes"]
    assert all("/Generate" not in r["match"].get("path", "") for r in routes)
    edge = listeners(render(MeshSettings(direct_token_path=True, prepare_timeout_seconds=7)))[
        "edge"
    ]
    names = [f["name"] for f in edge["http_filters"]]
    # After gRPC-Web and REST become gRPC, before routing.
    assert (
        names.index("envoy.filters.http.grpc_json_transcoder")
        < names.index("envoy.filters.http.ext_proc")
        < names.index("envoy.filters.http.router")
    )
    processor = edge["http_filters"][names.index("envoy.filters.http.ext_proc")]["typed_config"]
    assert processor["grpc_service"]["envoy_grpc"]["cluster_name"] == "gateway"
    # The caller's content-type reaches the processor as it came, before gRPC-Web rewrites it.
    kept = edge["http_filters"][names.index("envoy.filters.http.header_to_metadata")]
    assert names.index("envoy.filters.http.header_to_metadata") < names.index(
        "envoy.filters.http.grpc_web"
    )
    (rule,) = kept["typed_config"]["request_rules"]
    assert rule["header"] == "content-type"
    namespace = rule["on_header_present"]["metadata_namespace"]
    assert processor["metadata_options"]["forwarding_namespaces"]["untyped"] == [namespace]
    assert processor["message_timeout"] == "7s" and not processor["failure_mode_allow"]
    # A preparation whose gateway failed before answering goes to another gateway.
    retry = processor["grpc_service"]["retry_policy"]
    assert set(retry["retry_on"].split(",")) >= {"connect-failure", "refused-stream", "reset"}
    assert retry["num_retries"] >= 1 and retry["retry_host_predicate"]
    assert processor["processing_mode"]["response_body_mode"] == "NONE"  # tokens bypass it
    host = edge["route_config"]["virtual_hosts"][0]
    assert host["typed_per_filter_config"]["envoy.filters.http.ext_proc"]["disabled"]
    by_path = {r["match"].get("path"): r for r in host["routes"] if "path" in r["match"]}
    generate = by_path["/tokenmesh.v1.LLMService/Generate"]
    worker = by_path["/tokenmesh.v1.InferenceService/Generate"]
    # The workers' method through the edge's stream relay (on by default), which sends it on.
    assert generate["route"]["cluster"] == "gateway" and worker["route"]["cluster"] == RELAY
    for route in (generate, worker):
        assert "disabled" not in route["typed_per_filter_config"]["envoy.filters.http.ext_proc"]
    # The caller's own deadline ends a direct stream (DEADLINE_EXCEEDED), not Envoy's reset.
    assert "max_stream_duration" not in worker["route"]
    assert "max_stream_duration" in generate["route"]
    assert host["routes"][-1]["match"] == {"prefix": "/"}
