"""Entrypoint: `python -m tokenmesh.gateway` (settings from TOKENMESH_GATEWAY_* variables)."""

from __future__ import annotations

import sys

from tokenmesh.common.logs import configure_logging
from tokenmesh.common.server import run
from tokenmesh.gateway.app import serve
from tokenmesh.gateway.config import GatewaySettings


def main() -> int:
    settings = GatewaySettings()
    configure_logging(settings.log_level, settings.log_format)
    return run(serve(settings))


if __name__ == "__main__":
    sys.exit(main())
