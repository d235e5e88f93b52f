"""Slow-consumer benchmark: a client that stops reading N token streams, against Envoy flow-control
windows of different sizes, each on a fresh local mesh (1 gateway, 1 worker) in the same run.

For each window it reports how much Envoy (its allocator's own count) and the gateway (RSS)
grew while nothing was read, what share of the tokens the gateway and the worker managed to
send before HTTP/2 flow control stopped them, and that every stream still arrived whole once
the client read it (the probe: tests/harness/slow_consumer.py). The streams ask for 20
logprobs per token so each carries ~650 KB.

    python -m loadtests.slow_consumer_bench [--streams 16 --windows 65536,1048576,268435456]

All traffic goes to 127.0.0.1; every wait is bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from tests.harness.slow_consumer import SlowConsumerProbe, SlowConsumerResult, slow_consumer_env
from tokenmesh.localmesh.mesh import LocalMesh, LocalMeshSettings

MIB = 1024 * 1024
ROOT = Path(__file__).resolve().parent.parent
# Envoy's own default HTTP/2 windows (256 MiB), the baseline the mesh's windows are set against.
ENVOY_DEFAULT_WINDOW = 256 * MIB


def measure(
    stream_window: int, connection_window: int, streams: int, max_tokens: int
) -> SlowConsumerResult:
    with (
        tempfile.TemporaryDirectory(prefix="slow-consumer-") as run_dir,
        slow_consumer_env(stream_window, connection_window),
    ):
        local_mesh = LocalMesh(
            LocalMeshSettings.on_free_ports(Path(run_dir), gateways=1, workers=1), root=ROOT
        )
        try:
            if local_mesh.up() != 0:
                raise SystemExit("the mesh did not come up")
            return asyncio.run(SlowConsumerProbe(local_mesh).run(streams, max_tokens))
        finally:
            local_mesh.down()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=1900)
    # The mesh's defaults, 1 MiB / 4 MiB, and Envoy's own defaults.
    windows = f"{64 * 1024}:{MIB},{MIB}:{4 * MIB},{ENVOY_DEFAULT_WINDOW}:{ENVOY_DEFAULT_WINDOW}"
    parser.add_argument("--windows", default=windows, help="stream:connection windows, bytes")
    args = parser.parse_args()
    report = {}
    for pair in args.windows.split(","):
        stream_window, connection_window = (int(value) for value in pair.split(":"))
        result = measure(stream_window, connection_window, args.streams, args.max_tokens)
        report[pair] = asdict(result)
        print(json.dumps({"windows": pair, **asdict(result)}), file=sys.stderr)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
