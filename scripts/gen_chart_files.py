"""Copy what the Helm chart ships from the repository's sources of truth into
helm/tokenmesh/files/ (a chart cannot read files outside its directory), or check the copies.

- files/envoy.yaml, files/envoy-tls.yaml, files/envoy-mtls.yaml, files/envoy-tls-mtls.yaml:
  `python -m tokenmesh.meshconfig --profile kubernetes[-tls][-mtls]`, i.e. the same renderer
  as envoy/envoy.yaml and the local mesh.
- files/dashboards/*.json: dashboards/ (scripts/gen_dashboards.py).
- files/alerts.yml: prometheus/alerts.yml.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tokenmesh.meshconfig.__main__ import render_profile

ROOT = Path(__file__).resolve().parent.parent
FILES = ROOT / "helm" / "tokenmesh" / "files"


def expected_files() -> dict[str, str]:
    """Path under files/ -> content."""
    files = {
        "envoy.yaml": render_profile("kubernetes"),
        "envoy-tls.yaml": render_profile("kubernetes-tls"),
        "envoy-mtls.yaml": render_profile("kubernetes-mtls"),
        "envoy-tls-mtls.yaml": render_profile("kubernetes-tls-mtls"),
        "alerts.yml": (ROOT / "prometheus" / "alerts.yml").read_text(),
    }
    for dashboard in sorted((ROOT / "dashboards").glob("*.json")):
        files[f"dashboards/{dashboard.name}"] = dashboard.read_text()
    return files


def stale_files() -> list[str]:
    """Files under files/ that are missing, extra or different from their source."""
    expected = expected_files()
    present = {str(path.relative_to(FILES)) for path in FILES.rglob("*") if path.is_file()}
    return sorted(
        name
        for name in expected.keys() | present
        if name not in present
        or name not in expected
        or (FILES / name).read_text() != expected[name]
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail when a copy is stale")
    args = parser.parse_args()
    if args.check:
        stale = stale_files()
        if stale:
            print(f"stale chart files {stale}: run `make chart`", file=sys.stderr)
            return 1
        return 0
    expected = expected_files()
    for name in stale_files():
        path = FILES / name
        if name not in expected:
            path.unlink()
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(expected[name])
    print(f"{len(expected)} chart files up to date in {FILES.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
