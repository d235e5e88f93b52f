"""Health checks beside logprob-heavy streams, as JSON rows (tests/harness/health_probe.py).

While N streams of T tokens with 20 logprobs each run through the edge (32 x 1,800 by default,
on a fresh 2-gateway/2-worker mesh), another process checks each worker's grpc.health.v1
straight every 0.25 s, and the idle reranker's as the machine's own floor; reports those
checks' latency p50/p99/max, Envoy's own health-check attempts and failures and its membership
changes for the worker cluster, and every stream's end.

    python -m loadtests.worker_health_probe [--streams 32 --tokens 1800] [--attach RUN_DIR]
        [--out FILE] [--realtime-checker]

All traffic goes to 127.0.0.1; every wait is bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import time
from pathlib import Path

from tests.harness.health_probe import probe
from tests.harness.meshes import attached, own_mesh
from tokenmesh.localmesh.mesh import LocalMesh


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=1800)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--attach", type=Path, help="a running mesh's run directory (.run)")
    parser.add_argument("--out", type=Path, help="append each round's JSON row to this file")
    parser.add_argument(
        "--realtime-checker",
        action="store_true",
        help="run the direct checker under SCHED_FIFO (needs CAP_SYS_NICE)",
    )
    args = parser.parse_args()

    def rounds(local_mesh: LocalMesh) -> None:
        for index in range(args.rounds):
            row = {"round": index, "machine": platform.node(), "date": time.strftime("%F %T")}
            row.update(
                asyncio.run(probe(local_mesh, args.streams, args.tokens, args.realtime_checker))
            )
            print(json.dumps(row))
            if args.out is not None:
                with args.out.open("a") as out:
                    out.write(json.dumps(row) + "\n")

    if args.attach is not None:
        rounds(attached(args.attach))
        return
    with own_mesh(gateways=2, workers=2) as local_mesh:
        if local_mesh is None:
            raise SystemExit("the mesh did not come up")
        rounds(local_mesh)


if __name__ == "__main__":
    main()
