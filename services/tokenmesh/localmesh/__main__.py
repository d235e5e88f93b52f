"""`python -m tokenmesh.localmesh up|down|status|logs` (what make up/down/status/logs run)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tokenmesh.localmesh.mesh import LocalMesh, LocalMeshSettings


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("command", choices=("up", "down", "status", "logs", "config"))
    command = parser.parse_args().command
    local_mesh = LocalMesh(LocalMeshSettings(), root=Path.cwd())
    if command in ("status", "down", "logs") and local_mesh.settings_path.exists():
        # The settings the mesh was started with (its ports, TLS), whatever this shell's
        # TOKENMESH_LOCALMESH_* variables say.
        saved = LocalMeshSettings.model_validate_json(local_mesh.settings_path.read_text())
        local_mesh = LocalMesh(saved, root=Path.cwd())
    if command == "config":
        print(local_mesh.supervisord_config())
        return 0
    return int(getattr(local_mesh, command)())


if __name__ == "__main__":
    sys.exit(main())
