"""`make chaos`: the chaos scenarios of tests/harness/chaos.py against a local mesh, as a table.

Real faults (signals to real processes, a stopped control plane) under bounded traffic through
the edge, one result row per scenario.

    python -m loadtests.chaos [--short] [--scenarios worker_kill,reranker_hang] [--attach RUN_DIR]

Without --attach it starts its own mesh on free ports (2 gateways, 2 workers) and stops it at the
end; --attach RUN_DIR uses a running one (`make up`'s is .run). Prints a table and its JSON; exits
1 when a guarantee did not hold or a request hung. Every scenario leaves the mesh as it found it
(killed programs restarted and healthy in Envoy). All traffic goes to 127.0.0.1; every request
has a deadline and a hard bound, every wait and loop is bounded in count and time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from tests.harness.chaos import (
    ALL_SCENARIOS,
    FULL_ONLY_SCENARIOS,
    MESH_AUTOGROUP_NICE,
    SCENARIOS,
    SMALL_MESH_ENV,
    Row,
    ScenarioMesh,
    clients_first,
)
from tests.harness.meshes import attached, environment, own_mesh
from tokenmesh.localmesh.mesh import LocalMesh


async def run_scenarios(local_mesh: LocalMesh, names: Sequence[str], short: bool) -> list[Row]:
    mesh = ScenarioMesh(local_mesh)
    rows = []
    # The clients ahead of the mesh on the machine's cores (clients_first).
    with clients_first(local_mesh) as previous:
        placement = (
            "unchanged: no autogroup, or not permitted"
            if previous is None
            else f"at nice {MESH_AUTOGROUP_NICE}, {previous} before"
        )
        print(f"the mesh's autogroup behind the clients: {placement}", file=sys.stderr)
        for name in names:
            begun = time.monotonic()
            try:
                row = await ALL_SCENARIOS[name](mesh, short)
            except Exception as exc:  # a broken scenario is a failed row, the rest still run
                row = Row(name, violations=[f"the scenario raised {exc!r}"])
            row.seconds = round(time.monotonic() - begun, 1)
            rows.append(row)
            verdict = "passed" if row.passed else "FAILED"
            print(f"{name}: {verdict} in {row.seconds}s", file=sys.stderr)
    return rows


def table(rows: Sequence[Row]) -> str:
    header = (
        "scenario",
        "sent",
        "ok",
        "moved",
        "degraded",
        "failed by code",
        "hung",
        "recovery s",
        "",
    )
    lines = [header]
    for row in rows:
        failed = ", ".join(f"{code} {n}" for code, n in sorted(row.failed.items())) or "-"
        verdict = "pass" if row.passed else "FAIL: " + "; ".join(row.violations)
        lines.append(
            (
                row.scenario,
                str(row.sent),
                str(row.ok),
                str(row.moved),
                str(row.degraded),
                failed,
                str(row.hung),
                f"{row.max_recovery_seconds:.2f}",
                verdict,
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in lines
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--short", action="store_true", help="the short versions (make test's)")
    parser.add_argument("--scenarios", default=",".join(ALL_SCENARIOS), help="comma-separated")
    parser.add_argument(
        "--attach",
        type=Path,
        help="run directory of a running mesh (for overload and stalled_client, one started "
        "with the small mesh's settings)",
    )
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    names = [name for name in args.scenarios.split(",") if name]
    unknown = set(names) - set(ALL_SCENARIOS)
    if unknown:
        parser.error(f"unknown scenarios {sorted(unknown)}; known: {', '.join(ALL_SCENARIOS)}")
    rows: list[Row] = []
    if args.attach:
        rows = asyncio.run(run_scenarios(attached(args.attach), names, args.short))
    else:
        # The 2-gateway, 2-worker mesh first, then the small one: one at a time on a small box.
        on_main = (
            set(SCENARIOS)
            | set(FULL_ONLY_SCENARIOS)
            | (set() if args.short else {"stalled_client"})
        )
        main_names = [name for name in names if name in on_main]
        small_names = [name for name in names if name not in on_main]
        if main_names:
            with own_mesh(gateways=2, workers=2) as local_mesh:
                if local_mesh is None:
                    return 1
                rows += asyncio.run(run_scenarios(local_mesh, main_names, args.short))
        if small_names:
            with environment(SMALL_MESH_ENV), own_mesh(gateways=1, workers=1) as local_mesh:
                if local_mesh is None:
                    return 1
                rows += asyncio.run(run_scenarios(local_mesh, small_names, args.short))
    report = [asdict(row) for row in rows]
    print(json.dumps(report, indent=2))
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0 if all(row.passed for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
