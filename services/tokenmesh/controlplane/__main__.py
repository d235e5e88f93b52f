"""Entrypoint: `python -m tokenmesh.controlplane` (settings from TOKENMESH_CONTROLPLANE_*)."""

from __future__ import annotations

import sys

from tokenmesh.common.logs import configure_logging
from tokenmesh.common.server import run
from tokenmesh.controlplane.app import serve
from tokenmesh.controlplane.config import ControlPlaneSettings


def main() -> int:
    settings = ControlPlaneSettings()
    configure_logging(settings.log_level, settings.log_format)
    return run(serve(settings))


if __name__ == "__main__":
    sys.exit(main())
