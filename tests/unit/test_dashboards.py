"""The Grafana dashboards: generated from scripts/gen_dashboards.py, and well-formed for Grafana
(every panel titled, on the chosen Prometheus data source, with queries; ids unique)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support import ROOT

DASHBOARDS = sorted((ROOT / "dashboards").glob("*.json"))
# Grafana's own variables the queries may use.
BUILT_IN = {"__rate_interval", "__interval", "__range"}
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="no promtool on PATH: `make setup` installs the Debian prometheus package as root",
)
# The rate window the promtool tests put in place of Grafana's: five of their 1-minute samples.
RATE_WINDOW = "5m"


def substitute(expr: str) -> str:
    """expr as Grafana sends it with every variable at All."""
    return re.sub(r"\$\{?\w+\}?", ".*", expr.replace("$__rate_interval", RATE_WINDOW))


def panel(dashboard: str, title: str) -> dict[str, Any]:
    panels = json.loads((ROOT / "dashboards" / dashboard).read_text())["panels"]
    return next(panel for panel in panels if panel["title"] == title)


def promtool_test(tmp_path: Path, test: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    """`promtool test rules` on one test of PromQL expressions (no rules of its own)."""
    assert PROMTOOL is not None
    (tmp_path / "none.yml").write_text("groups: []\n")
    path = tmp_path / "test.yml"
    path.write_text(yaml.safe_dump({"rule_files": ["none.yml"], "tests": [test]}))
    return subprocess.run(
        [PROMTOOL, "test", "rules", str(path)], capture_output=True, text=True, check=False
    )


def test_committed_dashboards_are_the_generated_ones() -> None:
    result = subprocess.run(
        [sys.executable, "scripts/gen_dashboards.py", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr


def test_the_check_fails_on_a_stale_dashboard(tmp_path: Path) -> None:
    """The check above can fail: a hand edit to a copy of the repository's dashboards is seen."""
    scripts, dashboards = tmp_path / "scripts", tmp_path / "dashboards"
    scripts.mkdir()
    dashboards.mkdir()
    (scripts / "gen_dashboards.py").write_text((ROOT / "scripts/gen_dashboards.py").read_text())
    for path in DASHBOARDS:
        (dashboards / path.name).write_text(path.read_text().replace('"min": 0', '"min": 1', 1))
    result = subprocess.run(
        [sys.executable, "scripts/gen_dashboards.py", "--check"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 1
    assert "stale dashboards" in result.stderr


@pytest.mark.parametrize("path", DASHBOARDS, ids=[path.stem for path in DASHBOARDS])
def test_dashboard_is_well_formed_for_grafana(path: Path) -> None:
    dashboard = json.loads(path.read_text())
    assert dashboard["uid"] and dashboard["title"].startswith("tokenmesh / ")
    variables = {variable["name"]: variable for variable in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    datasource = {"type": "prometheus", "uid": "${datasource}"}
    for variable in variables.values():
        if variable["type"] == "query":
            assert variable["datasource"] == datasource, variable["name"]
    panels = dashboard["panels"]
    assert len(panels) >= 5
    assert len({panel["id"] for panel in panels}) == len(panels), "panel ids must be unique"
    for panel in panels:
        assert panel["title"], panel["id"]
        assert panel["datasource"] == datasource, panel["title"]
        assert panel["targets"], f"{panel['title']}: no query"
        ref_ids = [target["refId"] for target in panel["targets"]]
        assert len(set(ref_ids)) == len(ref_ids), panel["title"]
        for target in panel["targets"]:
            assert target["expr"].strip(), panel["title"]
            used = set(re.findall(r"\$\{?(\w+)\}?", target["expr"]))
            assert used <= set(variables) | BUILT_IN, f"{panel['title']}: undefined {used}"


def test_panels_do_not_overlap() -> None:
    for path in DASHBOARDS:
        cells = set()
        for panel in json.loads(path.read_text())["panels"]:
            grid = panel["gridPos"]
            mine = {
                (x, y)
                for x in range(grid["x"], grid["x"] + grid["w"])
                for y in range(grid["y"], grid["y"] + grid["h"])
            }
            assert not cells & mine, f"{path.name} / {panel['title']} overlaps another panel"
            assert grid["x"] + grid["w"] <= 24, f"{path.name} / {panel['title']} too wide"
            cells |= mine


@needs_promtool
def test_every_panel_query_is_valid_promql(tmp_path: Path) -> None:
    """Every target, with Grafana's variables filled in, as a recording rule promtool accepts
    (the integration test then runs them against the live mesh)."""
    rules = [
        {"record": f"panel:{path.stem}_{panel['id']}:{target['refId']}", "expr": substitute(expr)}
        for path in DASHBOARDS
        for panel in json.loads(path.read_text())["panels"]
        for target in panel["targets"]
        if (expr := target["expr"])
    ]
    path = tmp_path / "panels.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "panels", "rules": rules}]}))
    assert PROMTOOL is not None
    result = subprocess.run(
        [PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(rules)} rules found" in result.stdout


@needs_promtool
def test_prefix_cache_hit_rate_per_worker_and_overall_leaves_idle_workers_out(
    tmp_path: Path,
) -> None:
    """Hits over lookups per worker and over all of them; a worker that looked nothing up in
    the window has no point (not NaN), and an idle fleet none at all."""
    per_worker, overall = (
        substitute(target["expr"])
        for target in panel("serving.json", "Prefix-cache hit rate by worker")["targets"]
    )

    def counter(name: str, replica: str, values: str) -> dict[str, str]:
        labels = f'engine="0",model_name="tiny",service="worker",replica="{replica}"'
        return {"series": f"vllm:prefix_cache_{name}_total{{{labels}}}", "values": values}

    result = promtool_test(
        tmp_path,
        {
            "interval": "1m",
            "input_series": [
                # worker-0: 60 prompt tokens looked up a minute, 30 of them cached, then idle.
                counter("queries", "worker-0", "0+60x10 600x10"),
                counter("hits", "worker-0", "0+30x10 300x10"),
                # worker-1: lookups, every one a miss.
                counter("queries", "worker-1", "0+60x10 600x10"),
                counter("hits", "worker-1", "0x20"),
                # worker-2: idle throughout.
                counter("queries", "worker-2", "100x20"),
                counter("hits", "worker-2", "40x20"),
            ],
            "promql_expr_test": [
                {
                    "expr": per_worker,
                    "eval_time": "8m",
                    "exp_samples": [
                        {"labels": '{replica="worker-0"}', "value": 0.5},
                        {"labels": '{replica="worker-1"}', "value": 0},
                    ],
                },
                {"expr": overall, "eval_time": "8m", "exp_samples": [{"value": 0.25}]},
                {"expr": per_worker, "eval_time": "19m", "exp_samples": []},
                {"expr": overall, "eval_time": "19m", "exp_samples": []},
            ],
        },
    )
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_stream_share_counts_only_workers_token_streams(tmp_path: Path) -> None:
    """Each worker's share of the streams the workers started (Generate and GenerateOpenAI);
    a worker given none shows 0; the gateways' streams and health checks do not count."""
    (target,) = panel("serving.json", "Stream share by worker")["targets"]

    def started(service: str, replica: str, method: str, values: str) -> dict[str, str]:
        grpc_service = (
            "grpc.health.v1.Health" if method == "Check" else "tokenmesh.v1.InferenceService"
        )
        labels = (
            f'service="{service}",replica="{replica}",grpc_service="{grpc_service}",'
            f'grpc_method="{method}",grpc_type="server_stream"'
        )
        return {"series": f"grpc_server_started_total{{{labels}}}", "values": values}

    result = promtool_test(
        tmp_path,
        {
            "interval": "1m",
            "input_series": [
                started("worker", "worker-0", "Generate", "0+30x10 300x10"),
                started("worker", "worker-0", "GenerateOpenAI", "0+15x10 150x10"),
                started("worker", "worker-1", "Generate", "0+15x10 150x10"),
                started("worker", "worker-2", "Generate", "7x20"),
                started("worker", "worker-2", "Check", "0+600x20"),
                started("gateway", "gateway-0", "Generate", "0+900x20"),
            ],
            "promql_expr_test": [
                {
                    "expr": substitute(target["expr"]),
                    "eval_time": "8m",
                    "exp_samples": [
                        {"labels": '{replica="worker-0"}', "value": 0.75},
                        {"labels": '{replica="worker-1"}', "value": 0.25},
                        {"labels": '{replica="worker-2"}', "value": 0},
                    ],
                },
                # No stream anywhere in the window: no points rather than NaN.
                {"expr": substitute(target["expr"]), "eval_time": "19m", "exp_samples": []},
            ],
        },
    )
    assert result.returncode == 0, result.stdout + result.stderr
