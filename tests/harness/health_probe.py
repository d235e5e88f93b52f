"""Health checks beside logprob-heavy streams: while N streams of T tokens with 20 logprobs each
run through a mesh's edge, another process checks each worker's grpc.health.v1 straight every
0.25 s, and the idle reranker's as the machine's own floor; one row with those checks' latency
p50/p99/max, Envoy's own health-check attempts and failures and its membership changes for the
worker cluster, and every stream's end. Run by tests/integration/test_mesh.py and, on a mesh of
its own, by `python -m loadtests.worker_health_probe`. All traffic goes to 127.0.0.1; every
wait is bounded.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import time
import urllib.request
from collections import Counter
from collections.abc import Sequence
from typing import Any

from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tokenmesh.common.tokens import token_count
from tokenmesh.localmesh.mesh import LocalMesh
from tokenmesh.v1 import llm_pb2, llm_pb2_grpc

# A check that gets no answer in this long counts as this long.
CHECK_LIMIT_SECONDS = 20.0
CHECK_EVERY_SECONDS = 0.25
LOAD_LIMIT_SECONDS = 600.0
# Envoy's counters for the worker cluster: checks sent, and checks failed (any cause).
ENVOY_COUNTERS = ("health_check.attempt", "health_check.failure")
# How often Envoy's count of healthy workers is sampled.
SAMPLE_EVERY_SECONDS = 0.2


def envoy_counter(admin_port: int, cluster: str, name: str) -> int:
    url = f"http://127.0.0.1:{admin_port}/stats?filter=^cluster.{cluster}.{name}$"
    with urllib.request.urlopen(url, timeout=10) as reply:
        return int(reply.read().decode().split(":")[1])


async def _check_loop(
    addresses: Sequence[str], limit: float, ready: Any, stop: Any
) -> dict[str, list[float]]:
    """Seconds each check took, per address, until stop is set (or `limit` seconds); ready is
    set once every address has answered a first check (not counted)."""
    channels = [aio.insecure_channel(address) for address in addresses]
    stubs = [health_pb2_grpc.HealthStub(channel) for channel in channels]
    request = health_pb2.HealthCheckRequest()
    for stub in stubs:
        await stub.Check(request, timeout=CHECK_LIMIT_SECONDS)
    ready.set()
    took: dict[str, list[float]] = {address: [] for address in addresses}

    async def checks(address: str, stub: health_pb2_grpc.HealthStub) -> None:
        end = time.monotonic() + limit
        while time.monotonic() < end and not stop.is_set():
            begun = time.monotonic()
            try:
                await stub.Check(request, timeout=CHECK_LIMIT_SECONDS)
                took[address].append(time.monotonic() - begun)
            except aio.AioRpcError:
                took[address].append(CHECK_LIMIT_SECONDS)
            await asyncio.sleep(CHECK_EVERY_SECONDS)

    await asyncio.gather(*(checks(a, s) for a, s in zip(addresses, stubs, strict=True)))
    for channel in channels:
        await channel.close()
    return took


def _checker(
    addresses: Sequence[str], limit: float, realtime: bool, ready: Any, stop: Any, results: Any
) -> None:
    # A session of its own: under the kernel's autogroup scheduling (on here) a session's
    # processes share one slice of the CPU, and the checker must not wait behind the load
    # generator's, as a prober on another host would not.
    os.setsid()
    if realtime:
        # SCHED_FIFO: the checker runs the moment an answer arrives, so what it times is the
        # worker's answer, not this 2-core machine's run queue (a prober on another host).
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    results.send(asyncio.run(_check_loop(addresses, limit, ready, stop)))


def percentiles(values: Sequence[float]) -> dict[str, float | int]:
    ordered = sorted(values)
    if not ordered:
        return {"checks": 0}
    return {
        "checks": len(ordered),
        "p50_s": round(ordered[len(ordered) // 2], 4),
        "p99_s": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))], 4),
        "max_s": round(ordered[-1], 4),
    }


async def saturate(edge: str, streams: int, tokens: int) -> list[tuple[str, int]]:
    """`streams` concurrent Generate streams of `tokens` tokens with 20 logprobs each through
    the edge: each stream's status code and how many tokens it got."""

    async def stream(stub: llm_pb2_grpc.LLMServiceStub, i: int) -> tuple[str, int]:
        request = llm_pb2.GenerateRequest(
            prompt=f"health under load {i}",
            max_tokens=tokens,
            ignore_eos=True,
            logprobs=True,
            top_logprobs=20,
        )
        received = 0
        try:
            async for token in stub.Generate(request, timeout=600):
                received += token_count(token)
        except aio.AioRpcError as error:
            return error.code().name, received
        return "OK", received

    async with aio.insecure_channel(edge) as channel:
        stub = llm_pb2_grpc.LLMServiceStub(channel)
        return await asyncio.gather(*(stream(stub, i) for i in range(streams)))


async def count_out_of_rotation(admin_port: int, workers: int, stop: asyncio.Event) -> list[int]:
    """Envoy's healthy-worker count, sampled until stop is set: the samples below `workers`."""
    short: list[int] = []
    while not stop.is_set():
        healthy = await asyncio.to_thread(envoy_counter, admin_port, "worker", "membership_healthy")
        if healthy < workers:
            short.append(healthy)
        await asyncio.sleep(SAMPLE_EVERY_SECONDS)
    return short


async def probe(
    local_mesh: LocalMesh, streams: int, tokens: int, realtime: bool = False
) -> dict[str, Any]:
    """Run the load once with the checker beside it; one result row."""
    admin = local_mesh.settings.envoy_admin_port
    workers = [p.address for p in local_mesh.programs if p.service == "worker"]
    reranker = [p.address for p in local_mesh.programs if p.service == "reranker"]
    before = {name: envoy_counter(admin, "worker", name) for name in ENVOY_COUNTERS}
    # The checker is a process of its own, so the load's client does not slow its checks.
    spawn = multiprocessing.get_context("spawn")
    receiver, sender = spawn.Pipe(duplex=False)
    ready, stop = spawn.Event(), spawn.Event()
    checker = spawn.Process(
        target=_checker,
        args=(workers + reranker, LOAD_LIMIT_SECONDS, realtime, ready, stop, sender),
        daemon=True,
    )
    checker.start()
    if not await asyncio.to_thread(ready.wait, 60):
        checker.kill()
        raise RuntimeError("the health checker did not start within 60 s")
    began = time.monotonic()
    edge = f"127.0.0.1:{local_mesh.settings.edge_port}"
    load_done = asyncio.Event()
    sampler = asyncio.create_task(count_out_of_rotation(admin, len(workers), load_done))
    try:
        outcomes = await asyncio.wait_for(saturate(edge, streams, tokens), LOAD_LIMIT_SECONDS)
    finally:
        load_seconds = time.monotonic() - began
        load_done.set()
        out_of_rotation = await sampler
        stop.set()
        answered = await asyncio.to_thread(receiver.poll, CHECK_LIMIT_SECONDS + 10)
        took: dict[str, list[float]] = receiver.recv() if answered else {}
        checker.join(10)
        if checker.is_alive():
            checker.kill()
    after = {name: envoy_counter(admin, "worker", name) for name in ENVOY_COUNTERS}
    return {
        "streams": streams,
        "tokens_per_stream": tokens,
        "checker_scheduling": "SCHED_FIFO" if realtime else "SCHED_OTHER",
        "load_seconds": round(load_seconds, 1),
        "outcomes": dict(Counter(code for code, _ in outcomes)),
        "tokens_received": sum(n for _, n in outcomes),
        "envoy_worker_cluster": {name: after[name] - before[name] for name in ENVOY_COUNTERS},
        # Samples (every 0.2 s) in which Envoy had fewer healthy workers than the mesh runs.
        "samples_with_a_worker_out_of_rotation": len(out_of_rotation),
        "direct_checks": {address: percentiles(took.get(address, [])) for address in workers},
        "idle_reranker_checks": {
            address: percentiles(took.get(address, [])) for address in reranker
        },
    }
