"""The shared mesh (tests/conftest.py) stops as soon as the last test using it is done, and a
failed test's report shows what it logged."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.support import MESH_KEY

LOG_OFFSETS = pytest.StashKey[tuple[Path, dict[Path, int]]]()
# What a failed test's report shows of each mesh log: its notable lines written during the test.
NOTABLE_LINES = 40
QUIET_LEVELS = {"DEBUG", "INFO", "info", "debug"}
# Info lines of the processes that do not log JSON: Envoy, vLLM, supervisord, Prometheus.
QUIET = re.compile(r"\]\[(info|debug)\]\[| (INFO|DEBUG) |level=(info|debug)")


def notable(line: str) -> bool:
    """An access log line of a stream that did not end OK, a service's warning or error, or
    anything else a process printed that is not an info line (Envoy's own warnings,
    tracebacks)."""
    try:
        record = json.loads(line)
    except ValueError:
        return bool(line.strip()) and not QUIET.search(line)
    if not isinstance(record, dict):
        return True
    if "grpc_status" in record:
        return record["grpc_status"] != "OK" or record.get("response_code") != 200
    return record.get("level") not in QUIET_LEVELS


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item: pytest.Item) -> None:
    local_mesh = item.config.stash.get(MESH_KEY, None)
    if local_mesh is not None and "mesh_started" in item.fixturenames:
        logs = local_mesh.log_dir
        item.stash[LOG_OFFSETS] = (logs, {log: log.stat().st_size for log in logs.glob("*.log")})


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> None:
    """A failed mesh test's report shows what the mesh logged while it ran (CI keeps nothing
    else): every stream Envoy ended other than OK (its details say why) and every warning."""
    logs, offsets = item.stash.get(LOG_OFFSETS, (None, {}))
    if call.when != "call" or call.excinfo is None or logs is None:
        return
    for log in sorted(logs.glob("*.log")):
        with log.open("rb") as raw:
            raw.seek(offsets.get(log, 0))
            text = raw.read().decode(errors="replace")
        lines = [line for line in text.splitlines() if notable(line)]
        if lines:
            item.add_report_section(
                "call", f"mesh log {log.name}", "\n".join(lines[-NOTABLE_LINES:])
            )
