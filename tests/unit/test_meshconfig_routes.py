"""Routes: the edge's to the control plane, the gateways and OpenAI's API; the workers'."""

from __future__ import annotations

import pytest

from tests.unit.test_meshconfig import clusters, listeners, worker_balancing, worker_routes
from tokenmesh.meshconfig.bootstrap import render
from tokenmesh.meshconfig.config import MeshSettings


@pytest.mark.parametrize("direct", [True, False], ids=["direct token path", "gateway path"])
def test_prefix_routing_hashes_the_affinity_key_onto_workers_under_bounded_load(
    direct: bool,
) -> None:
    config = render(
        MeshSettings(
            worker_routing="prefix",
            prefix_balance_factor_percent=150,
            direct_token_path=direct,
            stream_relay=False,  # the router's routes (the relay's: test_meshconfig_stream_relay)
        )
    )
    worker = clusters(config)["worker"]
    assert "lb_policy" not in worker
    name, maglev = worker_balancing(config)
    assert name == "envoy.load_balancing_policies.maglev"
    # The hash is the cluster's, so whatever starts a worker stream (a route, the relay) is
    # placed by the same key.
    assert maglev["consistent_hashing_lb_config"] == {
        "hash_balance_factor": 150,
        "hash_policy": [{"header": {"header_name": "x-tokenmesh-affinity"}}],
    }
    routes = worker_routes(config)
    # The internal listener's (the gateways' calls), and with the direct token path the edge's
    # Generate and OpenAI routes.
    assert len(routes) == (3 if direct else 1)
    for route in routes:
        assert "hash_policy" not in route
        # A retry (a refused or dead worker) hashes again onto another host.
        assert route["retry_policy"]["retry_host_predicate"][0]["name"].endswith("previous_hosts")
    # The other services keep least-request balancing, and no key.
    for name in ("gateway", "reranker"):
        assert clusters(config)[name]["lb_policy"] == "LEAST_REQUEST"
        assert "consistent_hashing_lb_config" not in clusters(config)[name]["common_lb_config"]


def test_edge_routes_the_ops_feed_admin_api_and_page_to_the_control_plane() -> None:
    mesh = MeshSettings(controlplane_port=18111, ops_page_port=19222, direct_token_path=False)
    config = render(mesh)
    routes = listeners(config)["edge"]["route_config"]["virtual_hosts"][0]["routes"]
    ops_feed, admin, redirect, page, envoys_own, openai, tokenize, detokenize, rest = routes
    # Envoy's interfaces on the gateways (external processor, access log) are not the callers'.
    assert envoys_own["match"] == {"prefix": "/envoy.service."}
    assert envoys_own["direct_response"]["status"] == 404
    assert ops_feed["match"] == {"prefix": "/tokenmesh.v1.OpsService/"}
    assert ops_feed["route"]["cluster"] == "ops"
    assert ops_feed["route"]["timeout"] == "0s"  # a subscription lasts as long as the page
    # The adapter admin API (keyed by the control plane itself), the caller's deadline honoured.
    assert admin["match"] == {"prefix": "/tokenmesh.v1.AdapterAdmin/"}
    assert admin["route"]["cluster"] == "ops"
    assert admin["route"]["max_stream_duration"] == {"grpc_timeout_header_max": "0s"}
    assert redirect == {"match": {"path": "/ops"}, "redirect": {"path_redirect": "/ops/"}}
    assert page["match"] == {"prefix": "/ops/"} and page["route"]["cluster"] == "ops_page"
    assert rest["match"] == {"prefix": "/"} and rest["route"]["cluster"] == "gateway"
    assert openai["match"] == {"prefix": "/v1/"} and openai["route"]["cluster"] == "openai"
    assert openai["route"]["timeout"] == "0s"  # a stream lasts as long as it generates
    # vLLM's tokenizer routes, outside /v1/ as its server has them, to the same gateways.
    for route, path in ((tokenize, "/tokenize"), (detokenize, "/detokenize")):
        assert route["match"] == {"path": path}
        assert route["route"] == {**openai["route"]}
    # A POST is retried only when it never reached a gateway.
    assert openai["route"]["retry_policy"]["retry_on"] == "connect-failure,reset-before-request"
    found = clusters(config)
    assert found["openai"]["health_checks"][0]["http_health_check"] == {"path": "/health"}
    assert "typed_extension_protocol_options" not in found["openai"]  # HTTP/1.1 to uvicorn
    assert "openai" not in clusters(render(MeshSettings(openai_api=False)))

    def port_of(name: str) -> int:
        endpoint = found[name]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
        return int(endpoint["address"]["socket_address"]["port_value"])

    assert (port_of("ops"), port_of("xds_cluster"), port_of("ops_page")) == (18111, 18111, 19222)
    assert "typed_extension_protocol_options" in found["ops"]  # gRPC: HTTP/2 upstream
    assert "typed_extension_protocol_options" not in found["ops_page"]  # plain HTTP/1.1


def test_no_listener_routes_the_workers_admin_interface() -> None:
    """Only the control plane calls WorkerAdmin, on the workers' own ports: the gateways'
    internal listeners refuse it (UNIMPLEMENTED) and the edge sends it to the gateways, which
    do not serve it."""
    config = render(MeshSettings())
    found = listeners(config)
    for name in ("worker", "reranker"):
        routes = found[name]["route_config"]["virtual_hosts"][0]["routes"]
        assert routes[0]["match"] == {"prefix": "/tokenmesh.v1.WorkerAdmin/"}
        assert routes[0]["direct_response"]["status"] == 404
    edge = found["edge"]["route_config"]["virtual_hosts"][0]["routes"]
    assert not any("WorkerAdmin" in str(route["match"]) for route in edge)
