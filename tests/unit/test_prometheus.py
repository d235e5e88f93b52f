"""Prometheus as the local mesh runs it: the generated scrape config covers every replica and
Envoy, and the alert rules are valid and behave as their promtool unit tests expect."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import grpc
import pytest
import yaml

from tests.support import ROOT
from tokenmesh.localmesh.mesh import ALERT_RULES, LocalMesh, LocalMeshSettings

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="no promtool on PATH: `make setup` installs the Debian prometheus package as root",
)
RULES = ROOT / ALERT_RULES
RULE_TESTS = RULES.with_name("alerts.test.yml")


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run(
        [PROMTOOL, *args], capture_output=True, text=True, timeout=120, check=False, cwd=ROOT
    )


def alert_rules() -> list[dict]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def local_mesh(tmp_path: Path) -> LocalMesh:
    settings = LocalMeshSettings(
        run_dir=tmp_path,
        gateways=3,
        workers=2,
        gateway_metrics_port=7001,
        envoy_admin_port=7901,
        adapter_pool=False,
    )
    return LocalMesh(settings, root=ROOT)


def at(port: int) -> dict[str, str]:
    """The `address` label: the replica's gRPC address (the ops feed matches workers by it)."""
    return {"address": f"127.0.0.1:{port}"}


def test_scrape_config_lists_every_replica_with_its_service_and_envoy(tmp_path: Path) -> None:
    config = local_mesh(tmp_path).prometheus_config()
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"controlplane", "worker", "reranker", "gateway", "envoy"}
    gateways = jobs["gateway"]["static_configs"]
    assert [(group["targets"], group["labels"]) for group in gateways] == [
        (["127.0.0.1:7001"], {"service": "gateway", "replica": "gateway-0", **at(50051)}),
        (["127.0.0.1:7002"], {"service": "gateway", "replica": "gateway-1", **at(50052)}),
        (["127.0.0.1:7003"], {"service": "gateway", "replica": "gateway-2", **at(50053)}),
    ]
    assert len(jobs["worker"]["static_configs"]) == 2
    assert jobs["worker"]["metric_relabel_configs"][0]["replacement"] == "vllm:$1"
    assert jobs["envoy"]["metrics_path"] == "/stats/prometheus"
    assert jobs["envoy"]["static_configs"][0]["targets"] == ["127.0.0.1:7901"]
    assert config["global"]["scrape_interval"] == "2s"
    assert config["rule_files"] == [str(RULES)]


def test_every_alert_has_a_severity_summary_and_description() -> None:
    rules = alert_rules()
    assert len(rules) >= 5
    for rule in rules:
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]


def test_status_codes_in_rules_and_dashboards_are_the_ones_the_services_export() -> None:
    """grpc_code label values are the status codes' names (common/outcome.py: "UNAVAILABLE",
    not go-grpc-prometheus' "Unavailable"): a selector naming another spelling matches
    nothing, and the alert or panel never fires or shows."""
    names = {code.name for code in grpc.StatusCode}
    selectors = re.compile(r'grpc_code\s*(?:=~|!~|=|!=)\s*\\?"([^"\\]+)')
    texts = [RULES.read_text(), RULE_TESTS.read_text()]
    texts += [path.read_text() for path in (ROOT / "dashboards").glob("*.json")]
    found = [
        value
        for text in texts
        for match in selectors.finditer(text)
        for value in match[1].split("|")
    ]
    assert found, "no grpc_code selector found"
    assert sorted(set(found) - names) == []


def test_every_alert_has_promtool_unit_tests() -> None:
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    cases = [case for test in tests for case in test["alert_rule_test"]]
    for alert in (rule["alert"] for rule in alert_rules()):
        mine = [case for case in cases if case["alertname"] == alert]
        assert any(case["exp_alerts"] for case in mine), f"{alert}: no test where it fires"
        assert any(not case["exp_alerts"] for case in mine), f"{alert}: no test where it is quiet"


@needs_promtool
def test_generated_config_passes_promtool(tmp_path: Path) -> None:
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(local_mesh(tmp_path).prometheus_config()))
    result = promtool("check", "config", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_alert_rules_pass_promtool_check() -> None:
    result = promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


@needs_promtool
def test_alert_rules_pass_their_promtool_unit_tests() -> None:
    result = promtool("test", "rules", str(RULE_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


@pytest.mark.skipif(
    shutil.which("prometheus") is None,
    reason="no prometheus on PATH: `make setup` installs the Debian prometheus package as root",
)
def test_local_mesh_runs_prometheus_on_its_port_with_storage_in_the_run_dir(tmp_path: Path) -> None:
    settings = LocalMeshSettings(run_dir=tmp_path, workers=1, prometheus_port=7090)
    mesh = LocalMesh(settings, root=ROOT)
    program = next(program for program in mesh.programs if program.name == "prometheus")
    assert f"--config.file={tmp_path / 'prometheus.yml'}" in program.command
    assert f"--storage.tsdb.path={tmp_path / 'prometheus'}" in program.command
    assert "--web.listen-address=127.0.0.1:7090" in program.command
    assert program.ready_url == "http://127.0.0.1:7090/-/ready"
    assert "[program:prometheus]" in mesh.supervisord_config()
