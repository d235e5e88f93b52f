"""How a worker saturated by logprob-heavy streams answers health checks: while the slow-consumer
probe runs on a fresh 1-gateway/1-worker mesh, checks the worker's grpc.health.v1 straight (every
0.25 s) and counts Envoy's own health-check failures and moments with no healthy worker.

    python -m loadtests.worker_health_probe [--health-check-timeout 10] [--out FILE]

All traffic goes to 127.0.0.1; every wait is bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import urllib.request
from pathlib import Path

from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from loadtests.chaos import environment, own_stack
from loadtests.slow_consumer_bench import SlowConsumerProbe
from tokenmesh.localstack.stack import Stack
from tokenmesh.meshconfig.config import MeshSettings

STREAMS, MAX_TOKENS = 16, 1900
# A check that gets no answer in this long counts as this long.
CHECK_LIMIT_SECONDS = 20.0


def envoy_worker_stat(stack: Stack, name: str) -> int:
    url = f"http://127.0.0.1:{stack.settings.envoy_admin_port}/stats?filter=^cluster.worker.{name}$"
    with urllib.request.urlopen(url, timeout=10) as reply:
        return int(reply.read().decode().split(":")[1])


async def watch(stack: Stack, address: str, stop: asyncio.Event) -> tuple[list[float], int]:
    """Seconds each direct check took, and how many samples saw no healthy worker in Envoy."""
    took, unhealthy = [], 0
    async with aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while not stop.is_set():
            begun = time.monotonic()
            try:
                await stub.Check(health_pb2.HealthCheckRequest(), timeout=CHECK_LIMIT_SECONDS)
                took.append(time.monotonic() - begun)
            except aio.AioRpcError:
                took.append(CHECK_LIMIT_SECONDS)
            unhealthy += envoy_worker_stat(stack, "membership_healthy") == 0
            await asyncio.sleep(0.25)
    return took, unhealthy


async def probe(stack: Stack) -> dict[str, object]:
    slow = SlowConsumerProbe(stack)
    counters = ("health_check.attempt", "health_check.failure")
    before = {name: envoy_worker_stat(stack, name) for name in counters}
    stop = asyncio.Event()
    watcher = asyncio.create_task(watch(stack, slow.worker_address, stop))
    failure = None
    try:
        result = await slow.run(STREAMS, MAX_TOKENS, limit=300.0)
    except aio.AioRpcError as error:
        # The bystander is refused when Envoy has no healthy worker: part of what is measured.
        result, failure = None, f"{error.code().name}: {error.details()}"
    finally:
        stop.set()
        took, unhealthy = await watcher
    took.sort()
    return {
        "direct_checks": len(took),
        "direct_p50_s": round(took[len(took) // 2], 3),
        "direct_p90_s": round(took[int(len(took) * 0.9)], 3),
        "direct_max_s": round(took[-1], 3),
        "envoy_attempts": envoy_worker_stat(stack, counters[0]) - before[counters[0]],
        "envoy_failures": envoy_worker_stat(stack, counters[1]) - before[counters[1]],
        "samples_with_no_healthy_worker": unhealthy,
        "bystander_tokens": None if result is None else result.bystander_tokens,
        "failure": failure,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--health-check-timeout", type=float, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    settings = (
        {}
        if args.health_check_timeout is None
        else {"TOKENMESH_MESH_HEALTH_CHECK_TIMEOUT_SECONDS": str(args.health_check_timeout)}
    )
    with environment(settings), own_stack(gateways=1, workers=1) as stack:
        if stack is None:
            raise SystemExit("the mesh did not come up")
        row: dict[str, object] = {
            "health_check_timeout_s": MeshSettings().health_check_timeout_seconds
        }
        row.update(asyncio.run(probe(stack)))
    print(json.dumps(row))
    if args.out is not None:
        with args.out.open("a") as out:
            out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
