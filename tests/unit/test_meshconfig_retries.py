"""Retries: on another host, within a budget, and for workers on an overloaded one too."""

from __future__ import annotations

from tests.unit.test_meshconfig import listeners
from tokenmesh.meshconfig.bootstrap import render
from tokenmesh.meshconfig.config import MeshSettings
from tokenmesh.meshconfig.stream_relay import RELAY


def test_retries_go_to_another_host() -> None:
    """Regression (chaos worker_kill): a SIGKILLed worker stays in Envoy's healthy set for ~1 s
    and LEAST_REQUEST favours it (it looks idle), so every retry of a request sent then could
    land on it again and fail UNAVAILABLE; retries must skip hosts already tried."""
    for manager in listeners(render(MeshSettings())).values():
        for route in manager["route_config"]["virtual_hosts"][0]["routes"]:
            policy = route.get("route", {}).get("retry_policy")
            if policy is None:
                continue
            predicates = [p["name"] for p in policy["retry_host_predicate"]]
            assert predicates == ["envoy.retry_host_predicates.previous_hosts"]
            assert policy["host_selection_retry_max_attempts"] >= 2


def test_only_the_worker_route_retries_an_overloaded_worker_elsewhere() -> None:
    found = listeners(render(MeshSettings()))
    for name, manager in found.items():
        if name == RELAY:
            continue  # the edge's stream relay retries a worker stream itself
        route = manager["route_config"]["virtual_hosts"][0]["routes"][-1]["route"]
        assert ("resource-exhausted" in route["retry_policy"]["retry_on"]) == (name == "worker")


def test_retry_budget_covers_losing_one_of_two_replicas() -> None:
    """Regression (chaos worker_kill): with a 20 % budget and a minimum of 3, 7 of 8 retries of
    the requests a killed worker had not answered overflowed the budget and failed UNAVAILABLE;
    with 50 % and 16, 2 of 19 did (Envoy takes the share of the requests still active, the
    other worker's 26, not of the 56 open before the kill)."""
    for cluster in render(MeshSettings())["static_resources"]["clusters"]:
        for threshold in cluster.get("circuit_breakers", {}).get("thresholds", []):
            budget = threshold["retry_budget"]
            assert budget["budget_percent"]["value"] >= 100
            assert budget["min_retry_concurrency"] >= 16
