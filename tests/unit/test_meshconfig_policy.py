"""The services' policies: each cluster's special behaviour is data, decided once from
MeshSettings, and the builders follow the data, not the cluster's name."""

from __future__ import annotations

import dataclasses

import pytest

from tokenmesh.meshconfig.balancing import ROUTINGS, worker_balancing
from tokenmesh.meshconfig.clusters import service_cluster
from tokenmesh.meshconfig.config import MeshSettings
from tokenmesh.meshconfig.listeners import internal_listener
from tokenmesh.meshconfig.policy import (
    CHART_HEALTH_CHECKS,
    CHART_WORKER_BALANCING,
    LEAST_REQUEST,
    Ejection,
    HealthCheckTiming,
    Services,
    WorkerBalancing,
)
from tokenmesh.meshconfig.protocols import HTTP_OPTIONS, names_host
from tokenmesh.meshconfig.retries import NEVER_SENT, RETRY_ON
from tokenmesh.meshconfig.routes import service_route


def services_of(mesh: MeshSettings) -> Services:
    return Services.of(mesh, HealthCheckTiming.of(mesh), WorkerBalancing.of(mesh))


def test_only_the_workers_are_ejected_at_their_first_failed_connection() -> None:
    services = services_of(MeshSettings())
    assert services.worker.ejection == Ejection("connection_failures", after=1, base_seconds=10)
    # The reranker is ejected on its errors; the gateways and their HTTP port never are.
    assert services.reranker.ejection is not None
    assert services.reranker.ejection.on == "errors"
    assert services.gateway.ejection is None
    assert services.openai is not None and services.openai.ejection is None


def test_the_openai_cluster_is_http1_with_an_http_health_check_on_the_gateways() -> None:
    openai = services_of(MeshSettings(openai_api=True)).openai
    assert openai is not None
    assert openai.protocol == "http1"
    assert (openai.health_check.kind, openai.health_check.target) == ("http", "/health")
    assert openai.server_name == "gateway"  # its hosts are gateways, with their certificate
    assert openai.retry_on == NEVER_SENT  # a POST: retried only when it never reached one
    assert openai.listener_port is None
    assert services_of(MeshSettings(openai_api=False)).openai is None


def test_the_grpc_services_are_checked_on_grpcs_health_service_under_their_own_name() -> None:
    services = services_of(MeshSettings())
    checked = {
        service.name: (service.protocol, service.health_check.kind, service.health_check.target)
        for service in (services.gateway, services.worker, services.reranker)
    }
    assert checked == {
        "gateway": ("grpc", "grpc", "tokenmesh.v1.LLMService"),
        "worker": ("grpc", "grpc", "tokenmesh.v1.InferenceService"),
        "reranker": ("grpc", "grpc", "tokenmesh.v1.RerankService"),
    }
    for service in (services.gateway, services.worker, services.reranker):
        assert service.server_name == service.name


def test_only_the_workers_name_their_host_and_retry_an_overloaded_one() -> None:
    services = services_of(MeshSettings())
    worker = services.worker
    assert worker.names_upstream_host
    assert worker.retry_on == RETRY_ON + ",resource-exhausted"
    for other in (services.gateway, services.reranker):
        assert not other.names_upstream_host
        assert other.retry_on == RETRY_ON


@pytest.mark.parametrize("routing", ROUTINGS)
def test_worker_routing_chooses_the_workers_balancing_only(routing: str) -> None:
    mesh = MeshSettings(worker_routing=routing, prefix_balance_factor_percent=140)
    services = services_of(mesh)
    assert services.worker.load_balancing == worker_balancing(routing, 140)
    for other in (services.gateway, services.reranker, services.openai):
        assert other is not None
        assert (other.lb_policy, other.load_balancing) == (LEAST_REQUEST, None)


def test_each_routing_has_its_own_policy_and_an_unknown_one_is_refused() -> None:
    names = {
        worker_balancing(routing, 125)["policies"][0]["typed_extension_config"]["name"]
        for routing in ROUTINGS
    }
    assert len(names) == len(ROUTINGS)
    with pytest.raises(ValueError, match="round_robin"):
        worker_balancing("round_robin", 125)


def test_the_charts_placeholders_reach_the_policies() -> None:
    services = Services.of(MeshSettings(), CHART_HEALTH_CHECKS, CHART_WORKER_BALANCING)
    assert services.worker.load_balancing == CHART_WORKER_BALANCING.policy
    assert all(service.health_check.timing == CHART_HEALTH_CHECKS for service in services.clusters)


def test_circuit_breakers_bound_the_reranker_tighter_and_share_the_retry_budget() -> None:
    services = services_of(MeshSettings(retry_budget_percent=60, retry_min_concurrency=20))
    reranker = services.reranker.circuit_breaker
    assert (reranker.max_pending_requests, reranker.max_requests) == (64, 256)
    for service in services.clusters:
        breaker = service.circuit_breaker
        assert (breaker.retry_budget_percent, breaker.min_retry_concurrency) == (60, 20)
        if service is not services.reranker:
            assert (breaker.max_pending_requests, breaker.max_requests) == (1024, 4096)


def test_the_clusters_and_internal_listeners_follow_the_policies() -> None:
    mesh = MeshSettings(worker_listener_port=17001, reranker_listener_port=17002)
    services = services_of(mesh)
    assert [s.name for s in services.clusters] == ["gateway", "worker", "reranker", "openai"]
    internal = {service.name: service.listener_port for service in services.internal}
    assert internal == {"worker": 17001, "reranker": 17002}


def test_the_builders_read_the_policy_not_the_name() -> None:
    """A gateway policy given the workers' behaviour renders the workers' cluster, route and
    listener pieces under the gateway's name."""
    mesh = MeshSettings()
    services = services_of(mesh)
    worker = services.worker
    like_worker = dataclasses.replace(
        services.gateway,
        ejection=worker.ejection,
        load_balancing=worker.load_balancing,
        retry_on=worker.retry_on,
        names_upstream_host=True,
        listener_port=17003,
    )
    cluster = service_cluster(like_worker, mesh)
    assert cluster["name"] == "gateway"
    assert cluster["outlier_detection"] == service_cluster(worker, mesh)["outlier_detection"]
    assert cluster["load_balancing_policy"] == worker.load_balancing
    assert "lb_policy" not in cluster
    route = service_route(like_worker, mesh)["route"]
    assert "resource-exhausted" in route["retry_policy"]["retry_on"]
    options = cluster["typed_extension_protocol_options"][HTTP_OPTIONS]
    assert options["http_filters"] == names_host()
    assert internal_listener(like_worker, services, mesh)["name"] == "gateway"
    as_http = service_cluster(dataclasses.replace(worker, protocol="http1"), mesh)
    assert "typed_extension_protocol_options" not in as_http
