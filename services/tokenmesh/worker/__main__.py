"""Entrypoint: `python -m tokenmesh.worker` (settings from TOKENMESH_WORKER_* variables)."""

from __future__ import annotations

import sys

from tokenmesh.common.logs import configure_logging
from tokenmesh.common.server import run
from tokenmesh.worker.app import serve
from tokenmesh.worker.config import WorkerSettings


def main() -> int:
    settings = WorkerSettings()
    configure_logging(settings.log_level, settings.log_format)
    return run(serve(settings))


# vLLM starts its engine in spawned processes, which re-import the main module: the guard keeps
# them from starting a second worker.
if __name__ == "__main__":
    sys.exit(main())
