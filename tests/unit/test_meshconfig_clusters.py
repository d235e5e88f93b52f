"""The service clusters as their policies say: health checks, balancing, ejection, breakers."""

from __future__ import annotations

import pytest
import yaml
from pydantic import ValidationError

from tests.unit.test_meshconfig import (
    clusters,
    listeners,
    with_health_checks,
    worker_balancing,
    worker_routes,
)
from tokenmesh.meshconfig.__main__ import render_profile
from tokenmesh.meshconfig.bootstrap import render
from tokenmesh.meshconfig.config import MeshSettings
from tokenmesh.meshconfig.policy import (
    CHART_HEALTH_CHECKS,
)


def test_service_clusters_are_health_checked_eds_clusters_named_after_services() -> None:
    config = render(MeshSettings(health_check_interval_seconds=0.5))
    found = clusters(config)
    assert set(found) == {
        "gateway",
        "worker",
        "reranker",
        "openai",
        "worker_relay",  # the edge's stream relay's internal listener (on by default)
        "xds_cluster",
        "ops",
        "ops_page",
    }
    for name in ("gateway", "worker", "reranker"):
        cluster = found[name]
        assert cluster["type"] == "EDS"
        assert cluster["eds_cluster_config"]["eds_config"]["ads"] == {}
        check = cluster["health_checks"][0]
        assert "grpc_health_check" in check
        assert check["no_traffic_interval"] == check["interval"] == "0.5s"
        assert cluster["common_lb_config"]["healthy_panic_threshold"]["value"] == 0
        assert cluster["ignore_health_on_host_removal"] is True
        # The mesh dashboard's per-replica panels read envoy_cluster_endpoint_* stats.
        assert cluster["track_cluster_stats"]["per_endpoint_stats"] is True
        options = cluster["typed_extension_protocol_options"]
        http2 = next(iter(options.values()))["explicit_http_config"]["http2_protocol_options"]
        assert http2["initial_stream_window_size"] == 64 * 1024
        # A stream window for each of 1,024 stalled streams sharing the connection.
        assert http2["initial_connection_window_size"] == 1024 * 64 * 1024
    assert worker_balancing(config)[0] == "envoy.load_balancing_policies.maglev"
    assert "outlier_detection" in found["reranker"]
    assert "retry_budget" in found["worker"]["circuit_breakers"]["thresholds"][0]


HEALTH_CHECKED = ("gateway", "worker", "reranker", "openai")


def test_health_check_timing_and_thresholds_come_from_the_settings() -> None:
    mesh = MeshSettings(
        health_check_interval_seconds=2,
        health_check_timeout_seconds=1.25,
        health_check_unhealthy_threshold=4,
        health_check_healthy_threshold=3,
        healthy_panic_threshold_percent=12.5,
    )
    found = clusters(render(mesh))
    for name in HEALTH_CHECKED:
        [check] = found[name]["health_checks"]
        assert check["interval"] == check["no_traffic_interval"] == "2s"
        assert check["timeout"] == "1.25s"
        assert (check["unhealthy_threshold"], check["healthy_threshold"]) == (4, 3)
        assert found[name]["common_lb_config"]["healthy_panic_threshold"] == {"value": 12.5}
    # The defaults: a hung host out after two missed checks, back after one, no panic routing.
    [check] = clusters(render(MeshSettings()))["worker"]["health_checks"]
    assert (check["timeout"], check["interval"]) == ("1s", "0.5s")
    assert (check["unhealthy_threshold"], check["healthy_threshold"]) == (2, 1)
    with pytest.raises(ValidationError):
        MeshSettings(healthy_panic_threshold_percent=101)
    with pytest.raises(ValidationError):
        MeshSettings(health_check_unhealthy_threshold=0)


@pytest.mark.parametrize("profile", ["kubernetes", "kubernetes-tls-mtls"])
def test_the_kubernetes_profiles_leave_the_health_check_numbers_to_the_chart(profile: str) -> None:
    """Placeholders the chart's envoy.healthChecks values replace; filled with the settings'
    defaults they are the local mesh's numbers."""
    text = render_profile(profile)
    found = clusters(yaml.safe_load(text))
    for name in HEALTH_CHECKED:
        [check] = found[name]["health_checks"]
        assert check["interval"] == check["no_traffic_interval"] == CHART_HEALTH_CHECKS.interval
        assert check["timeout"] == CHART_HEALTH_CHECKS.timeout
        assert check["unhealthy_threshold"] == CHART_HEALTH_CHECKS.unhealthy_threshold
        assert check["healthy_threshold"] == CHART_HEALTH_CHECKS.healthy_threshold
        panic = found[name]["common_lb_config"]["healthy_panic_threshold"]
        assert panic == {"value": CHART_HEALTH_CHECKS.panic_threshold_percent}
    filled = clusters(yaml.safe_load(with_health_checks(text, MeshSettings())))
    local = clusters(render(MeshSettings()))
    for name in HEALTH_CHECKED:
        assert filled[name]["health_checks"] == local[name]["health_checks"]
        assert filled[name]["common_lb_config"] == local[name]["common_lb_config"]


def test_picker_routing_sends_each_attempt_to_the_next_named_worker_then_least_request() -> None:
    config = render(MeshSettings(worker_routing="picker"))
    worker = clusters(config)["worker"]
    assert "lb_policy" not in worker
    (policy,) = worker["load_balancing_policy"]["policies"]
    override = policy["typed_extension_config"]["typed_config"]
    assert override["override_host_sources"] == [{"header": "x-tokenmesh-worker"}]
    (fallback,) = override["fallback_policy"]["policies"]
    assert fallback["typed_extension_config"]["name"].endswith("least_request")
    # Retries still pass over the hosts already tried.
    for route in worker_routes(config):
        assert route["retry_policy"]["retry_host_predicate"][0]["name"].endswith("previous_hosts")
    for name in ("gateway", "reranker"):
        assert clusters(config)[name]["lb_policy"] == "LEAST_REQUEST"


def test_prefix_is_the_default_and_refuses_a_balance_factor_below_100() -> None:
    name, maglev = worker_balancing(render(MeshSettings()))
    assert name == "envoy.load_balancing_policies.maglev"
    assert maglev["consistent_hashing_lb_config"]["hash_balance_factor"] == 125
    with pytest.raises(ValidationError, match="prefix_balance_factor_percent"):
        MeshSettings(prefix_balance_factor_percent=99)
    with pytest.raises(ValidationError, match="worker_routing"):
        MeshSettings(worker_routing="round_robin")


def test_envoy_opens_a_connection_to_a_worker_per_its_bound_of_streams() -> None:
    """A worker's front ends share its port and the kernel spreads connections over them: the
    worker cluster bounds one connection's streams itself; the others keep the mesh's bound."""
    found = clusters(render(MeshSettings(worker_streams_per_connection=48)))

    def streams(name: str) -> int:
        options = found[name]["typed_extension_protocol_options"]
        http = options["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
        return int(http["explicit_http_config"]["http2_protocol_options"]["max_concurrent_streams"])

    assert streams("worker") == 48
    assert streams("gateway") == streams("reranker") == MeshSettings().max_concurrent_streams


@pytest.mark.parametrize("relay", [True, False], ids=["relayed", "routed"])
def test_each_worker_pool_is_a_cluster_of_workers_reached_by_its_header(relay: bool) -> None:
    config = render(MeshSettings(worker_pools=("code", "chat-2"), stream_relay=relay))
    found = clusters(config)
    worker = found["worker"]
    for pool in ("code", "chat-2"):
        # The workers' cluster in all but its name: checks, balancing, ejection, breakers.
        assert {**found[f"worker-{pool}"], "name": "worker"} == worker
    routes = {
        name: manager["route_config"]["virtual_hosts"][0]["routes"]
        for name, manager in listeners(config).items()
    }

    def pools_of(route_list: list[dict], path: str) -> list[tuple[str | None, str]]:
        """(the pool header a route matches, its cluster) for the routes of a path."""
        return [
            (
                next((h["string_match"]["exact"] for h in r["match"].get("headers", [])), None),
                r["route"]["cluster"],
            )
            for r in route_list
            if r["match"].get("path", r["match"].get("prefix")) == path
        ]

    by_pool = [("code", "worker-code"), ("chat-2", "worker-chat-2"), (None, "worker")]
    # The gateways' calls: to the pool their header names, else the default pool.
    assert pools_of(routes["worker"], "/") == by_pool
    generate = "/tokenmesh.v1.InferenceService/Generate"
    if relay:
        # The relay picks the pool's cluster by the same header.
        assert pools_of(routes["edge"], generate) == [(None, "worker_relay")]
        assert "pool_header=x-tokenmesh-pool" in str(config)
    else:
        assert pools_of(routes["edge"], generate) == by_pool
        assert pools_of(routes["edge"], "/tokenmesh.v1.InferenceService/GenerateOpenAI") == by_pool


def test_a_pool_name_must_be_a_short_dns_label_named_once() -> None:
    for bad in (("Code",), ("-code",), ("code", "code"), ("a" * 33,), ("",)):
        with pytest.raises(ValidationError, match="pool name"):
            MeshSettings(worker_pools=bad)
