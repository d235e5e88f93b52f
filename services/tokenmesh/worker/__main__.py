"""Entrypoint: `python -m tokenmesh.worker` (settings from TOKENMESH_WORKER_* variables)."""

from __future__ import annotations

import sys

from tokenmesh.common.logs import configure_logging
from tokenmesh.common.server import run
from tokenmesh.worker.app import serve
from tokenmesh.worker.config import WorkerSettings
from tokenmesh.worker.lifetime import adopt_children


def main() -> int:
    settings = WorkerSettings()
    configure_logging(settings.log_level, settings.log_format)
    # The engine's processes end with this one, however it ends (lifetime.py).
    adopt_children()
    return run(serve(settings))


# vLLM starts its engine in spawned processes, which may import the main module again: the
# guard keeps them from starting a second worker.
if __name__ == "__main__":
    sys.exit(main())
