"""Listeners: safe for long streams, bounded headers, connection limits, draining."""

from __future__ import annotations

from tests.unit.test_meshconfig import clusters, listeners
from tokenmesh.common.tokens import EDGE_WORKER, UPSTREAM_HEADER
from tokenmesh.meshconfig.bootstrap import render
from tokenmesh.meshconfig.config import MeshSettings, kubernetes_profile
from tokenmesh.meshconfig.protocols import HTTP_OPTIONS
from tokenmesh.meshconfig.stream_relay import RELAY


def test_listeners_are_safe_for_long_streams_and_push_back() -> None:
    found = listeners(render(MeshSettings(stream_idle_timeout_seconds=30, direct_token_path=False)))
    assert set(found) == {"edge", "worker", "reranker"}
    for manager in found.values():
        assert manager["stream_idle_timeout"] == "30s"
        assert manager["http2_protocol_options"]["initial_stream_window_size"] == 64 * 1024
        route = manager["route_config"]["virtual_hosts"][0]["routes"][-1]["route"]  # the catch-all
        assert route["timeout"] == "0s"
        assert route["max_stream_duration"]["grpc_timeout_header_max"] == "0s"
        assert "refused-stream" in route["retry_policy"]["retry_on"]
        assert manager["access_log"]
    edge_filters = [f["name"] for f in found["edge"]["http_filters"]]
    assert edge_filters == [
        "envoy.filters.http.grpc_web",
        "envoy.filters.http.cors",
        "envoy.filters.http.local_ratelimit",
        "envoy.filters.http.grpc_json_transcoder",
        "envoy.filters.http.router",
    ]


def test_the_workers_cluster_names_the_worker_that_answered_and_the_edge_hides_it() -> None:
    """Whatever starts a worker stream (a route, the edge's stream relay), the workers'
    cluster names the worker in its answer; the gateways read it through their listener, and
    callers at the edge never learn the workers' addresses."""
    config = render(MeshSettings(stream_relay=True))
    found = clusters(config)
    options = found["worker"]["typed_extension_protocol_options"][HTTP_OPTIONS]
    naming, codec = options["http_filters"]
    (added,) = naming["typed_config"]["mutations"]["response_mutations"]
    assert added["append"]["header"] == {
        "key": UPSTREAM_HEADER,
        "value": "%UPSTREAM_REMOTE_ADDRESS%",
    }
    # A worker cannot name another.
    assert added["append"]["append_action"] == "OVERWRITE_IF_EXISTS_OR_ADD"
    assert codec["name"] == "envoy.filters.http.upstream_codec"
    for name in ("gateway", "reranker"):
        assert "http_filters" not in found[name]["typed_extension_protocol_options"][HTTP_OPTIONS]
    # The edge keeps it in its metadata for its access logs, and removes it.
    (kept,) = [
        f for f in listeners(config)["edge"]["http_filters"] if f["name"].endswith("to_metadata")
    ]
    (rule,) = kept["typed_config"]["response_rules"]
    assert (rule["header"], rule["remove"]) == (UPSTREAM_HEADER, True)
    assert rule["on_header_present"]["key"] == EDGE_WORKER


def test_every_listener_bounds_request_headers() -> None:
    found = listeners(render(MeshSettings(max_request_headers_kib=16, max_headers_count=50)))
    for manager in found.values():
        assert manager["max_request_headers_kb"] == 16
        assert manager["common_http_protocol_options"]["max_headers_count"] == 50
        assert manager["request_headers_timeout"] == "10s"
        # The edge's per-connection stream bound (one client channel multiplexes streams).
        assert manager["http2_protocol_options"]["max_concurrent_streams"] == 2048


def test_edge_connections_are_limited_but_internal_listeners_and_admin_are_not() -> None:
    config = render(MeshSettings(max_edge_connections=500))
    monitor = config["overload_manager"]["resource_monitors"][0]
    assert monitor["name"] == "envoy.resource_monitors.global_downstream_max_connections"
    assert monitor["typed_config"]["max_active_downstream_connections"] == 500
    ignored = {
        listener["name"]: listener["ignore_global_conn_limit"]
        for listener in config["static_resources"]["listeners"]
    }
    assert ignored == {"edge": False, "worker": True, "reranker": True, RELAY: True}
    assert config["admin"]["ignore_global_conn_limit"] is True


def test_only_the_traffic_listeners_drain_on_an_inbound_only_drain() -> None:
    """The chart's preStop drains with /drain_listeners?inboundonly: the edge and internal
    listeners are INBOUND, the stats listener is not (probes and scrapes go on meanwhile)."""
    config = render(kubernetes_profile())
    directions = {
        item["name"]: item.get("traffic_direction")
        for item in config["static_resources"]["listeners"]
    }
    assert directions == {
        "edge": "INBOUND",
        "worker": "INBOUND",
        "reranker": "INBOUND",
        "stats": None,
    }
