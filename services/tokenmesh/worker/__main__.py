"""Entrypoint: `python -m tokenmesh.worker` (settings from TOKENMESH_WORKER_* variables)."""

from __future__ import annotations

import logging
import sys

from tokenmesh.common.logs import configure_logging
from tokenmesh.common.server import run
from tokenmesh.worker.app import serve
from tokenmesh.worker.config import WorkerSettings
from tokenmesh.worker.engine_args import EngineArgsError, engine_args
from tokenmesh.worker.frontends import serve_frontends
from tokenmesh.worker.lifetime import adopt_children

log = logging.getLogger(__name__)


def main() -> int:
    settings = WorkerSettings()
    configure_logging(settings.log_level, settings.log_format)
    try:
        # Checked before anything starts: a wrong argument stops the worker at once.
        arguments = engine_args(settings)
    except EngineArgsError as error:
        log.error("%s", error)
        return 2
    # The engine's processes end with this one, however it ends (lifetime.py).
    adopt_children()
    if settings.frontends > 1:
        return serve_frontends(settings, arguments)
    return run(serve(settings, arguments))


# vLLM starts its engine in spawned processes, which may import the main module again: the
# guard keeps them from starting a second worker.
if __name__ == "__main__":
    sys.exit(main())
