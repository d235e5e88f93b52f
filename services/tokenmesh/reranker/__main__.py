"""Entrypoint: `python -m tokenmesh.reranker` (settings from TOKENMESH_RERANKER_* variables)."""

from __future__ import annotations

import sys

from tokenmesh.common.logs import configure_logging
from tokenmesh.common.server import run
from tokenmesh.reranker.app import serve
from tokenmesh.reranker.config import RerankerSettings


def main() -> int:
    settings = RerankerSettings()
    configure_logging(settings.log_level, settings.log_format)
    return run(serve(settings))


if __name__ == "__main__":
    sys.exit(main())
