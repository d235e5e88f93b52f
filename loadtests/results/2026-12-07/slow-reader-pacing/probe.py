"""The slow-reader runs of this folder (a frozen record): N runs of test_backpressure.py's slow
reader, each on a mesh of its own, sampling Envoy's allocation and all its stats every 0.5 s
and keeping the stats at the peak, Envoy's log (the relay's trace, in a build that wrote one)
and the probe's result under OUT/run-<time>-hold<ms>.

    PYTHONPATH=.:services python loadtests/results/2026-12-07/slow-reader-pacing/probe.py N OUT

TOKENMESH_WORKER_STREAM_HOLD_MAX_MS (the worker's pacing) is taken from the environment.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import threading
import time
import urllib.request
from pathlib import Path

from tests.harness.meshes import own_mesh
from tests.harness.slow_consumer import SlowConsumerProbe


def get(port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as reply:
        return str(reply.read().decode())


def sample(port: int, peak: dict[str, object], stop: threading.Event) -> None:
    """Envoy's stats at its allocation's peak, sampled every 0.5 s until stop."""
    while not stop.is_set():
        stats = get(port, "/stats")
        allocated = int(json.loads(get(port, "/memory"))["allocated"])
        if allocated > int(str(peak["allocated"])):
            peak.update(allocated=allocated, stats=stats)
        time.sleep(0.5)


def main() -> None:
    runs, out = int(sys.argv[1]), Path(sys.argv[2])
    hold = os.environ.get("TOKENMESH_WORKER_STREAM_HOLD_MAX_MS", "default")
    for _ in range(runs):
        with own_mesh(2, 2) as mesh:
            assert mesh is not None
            port = mesh.settings.envoy_admin_port
            peak: dict[str, object] = {"allocated": -1, "stats": ""}
            stop = threading.Event()
            sampler = threading.Thread(target=sample, args=(port, peak, stop))
            sampler.start()
            try:
                result = asyncio.run(SlowConsumerProbe(mesh).run(16, 1900, limit=300))
            finally:
                stop.set()
                sampler.join()
            time.sleep(3)  # Envoy's access log is written after each stream ends
            run = out / f"run-{int(time.time())}-hold{hold}"
            run.mkdir(parents=True)
            shutil.copy(mesh.log_dir / "envoy.log", run / "envoy.log")
            (run / "peak-stats.txt").write_text(str(peak["stats"]))
            (run / "result.txt").write_text(repr(result))
            print(
                run.name,
                f"Envoy grew {result.envoy_growth_bytes / 1e6:.2f} MB,",
                f"the workers sent {result.worker_sent_fraction}",
                flush=True,
            )


if __name__ == "__main__":
    main()
