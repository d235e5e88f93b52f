"""The admin interface and the stats listener that exposes only its scrape and readiness."""

from __future__ import annotations

import json

from tests.unit.test_meshconfig import clusters, listeners
from tokenmesh.meshconfig.bootstrap import render
from tokenmesh.meshconfig.config import MeshSettings, kubernetes_profile


def routed(routes: list[dict], method: str, path: str) -> str:
    """Where a route table sends a request: a cluster's name, or the direct response's status.
    Only the match kinds the stats listener uses (path, prefix, :method)."""
    bare = path.partition("?")[0]
    for route in routes:
        match = route["match"]
        if "path" in match and match["path"] != bare:
            continue
        if "prefix" in match and not bare.startswith(match["prefix"]):
            continue
        headers = {h["name"]: h["string_match"]["exact"] for h in match.get("headers", [])}
        if headers.get(":method", method) != method:
            continue
        if "route" in route:
            return str(route["route"]["cluster"])
        return str(route["direct_response"]["status"])
    return "no route"


def test_kubernetes_profile_keeps_admin_on_loopback_and_exposes_only_stats_and_ready() -> None:
    config = render(kubernetes_profile())
    admin = config["admin"]["address"]["socket_address"]
    assert admin == {"address": "127.0.0.1", "port_value": 9901}
    stats = next(i for i in config["static_resources"]["listeners"] if i["name"] == "stats")
    assert stats["address"]["socket_address"] == {"address": "0.0.0.0", "port_value": 9902}
    assert stats["ignore_global_conn_limit"] is True
    manager = stats["filter_chains"][0]["filters"][0]["typed_config"]
    routes = manager["route_config"]["virtual_hosts"][0]["routes"]
    admin_cluster = clusters(config)["envoy_admin"]
    assert admin_cluster["type"] == "STATIC"
    endpoint = admin_cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    assert endpoint["address"]["socket_address"] == admin
    allowed = {
        ("GET", "/stats/prometheus"),
        ("GET", "/stats/prometheus?usedonly"),
        ("GET", "/ready"),
    }
    refused = {
        ("POST", "/quitquitquit"),
        ("POST", "/healthcheck/fail"),
        ("POST", "/drain_listeners?graceful"),
        ("GET", "/config_dump"),
        ("GET", "/clusters"),
        ("GET", "/stats"),
        ("GET", "/"),
        ("POST", "/ready"),
        ("GET", "/stats/prometheus/../../quitquitquit"),
        ("GET", "/ready/"),
    }
    for method, path in allowed:
        assert routed(routes, method, path) == "envoy_admin", (method, path)
    for method, path in refused:
        assert routed(routes, method, path) == "404", (method, path)
    # Nothing else reaches admin: no other route, listener or cluster points at it.
    assert (
        sum("envoy_admin" in json.dumps(item) for item in config["static_resources"]["listeners"])
        == 1
    )
    # The local mesh reads admin itself (127.0.0.1): no stats listener, no admin cluster.
    local = render(MeshSettings())
    assert "stats" not in listeners(local) and "envoy_admin" not in clusters(local)
    assert local["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"
