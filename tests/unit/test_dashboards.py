"""The Grafana dashboards: generated from scripts/gen_dashboards.py, and well-formed for Grafana
(every panel titled, on the chosen Prometheus data source, with queries; ids unique)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT

DASHBOARDS = sorted((ROOT / "dashboards").glob("*.json"))
# Grafana's own variables the queries may use.
BUILT_IN = {"__rate_interval", "__interval", "__range"}


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
