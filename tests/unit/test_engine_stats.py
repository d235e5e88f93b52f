"""The engine's load as the worker reports it: the stat logger keeps vLLM's scheduler figures
and adds up its prefix-cache lookups and hits step by step (vLLM's own stats objects, as its
engine hands them over), and GetEngineStats serves them over a real gRPC server."""

from __future__ import annotations

from collections.abc import AsyncIterator
from types import SimpleNamespace

import pytest
from grpc import aio
from prometheus_client import CollectorRegistry
from vllm.v1.metrics.stats import PrefixCacheStats, SchedulerStats

from tokenmesh.common.metrics import StreamMetrics
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc
from tokenmesh.worker.adapters import Adapters
from tokenmesh.worker.app import aborted_counter, features_counter
from tokenmesh.worker.config import WorkerSettings
from tokenmesh.worker.engine import EngineLoad, EngineSlot, _LoadStatLogger
from tokenmesh.worker.servicer import InferenceServicer
from tokenmesh.worker.watchdog import EngineActivity


def step(running: int, lookups: list[tuple[int, int, bool]]) -> SchedulerStats:
    """One engine step's scheduler report; lookups: (prompt tokens, cached, preempted) per
    request admitted in the step, recorded as vLLM's scheduler records them."""
    prefix = PrefixCacheStats()
    for tokens, hits, preempted in lookups:
        prefix.record(num_tokens=tokens, num_hits=hits, preempted=preempted)
    return SchedulerStats(num_running_reqs=running, kv_cache_usage=0.25, prefix_cache_stats=prefix)


def test_prefix_cache_counts_add_up_over_steps_as_vllms_counters_do() -> None:
    load = EngineLoad()
    logger = _LoadStatLogger(load, EngineActivity())
    logger.record(step(1, [(300, 0, False)]), None)
    logger.record(step(3, [(300, 256, False), (140, 128, False)]), None)
    # A step that admitted nothing, and one with no scheduler figures at all.
    logger.record(step(3, []), None)
    logger.record(None, None)
    # A preempted request looked up again: vLLM's vllm:prefix_cache_* leave it out, and so do we.
    logger.record(step(2, [(500, 384, True)]), None)
    assert (load.prefix_cache_queries, load.prefix_cache_hits) == (740, 384)
    assert (load.running, load.kv_cache_usage) == (2, 0.25)


@pytest.fixture
async def inference() -> AsyncIterator[inference_pb2_grpc.InferenceServiceStub]:
    """The worker's servicer on a real port, over an engine that has reported some load."""
    load = EngineLoad(running=2, waiting=1, prefix_cache_queries=4096, prefix_cache_hits=3072)
    slot = EngineSlot()
    adapters = Adapters("tiny", {})

    async def held_adapters() -> tuple[str, ...]:
        return ("sql",)

    engine = SimpleNamespace(
        load=load,
        model_name="tiny",
        max_model_len=2048,
        adapters=adapters,
        held_adapters=held_adapters,
    )
    slot.set(engine)  # type: ignore[arg-type]
    registry = CollectorRegistry()
    servicer = InferenceServicer(
        slot,
        WorkerSettings(),
        StreamMetrics(registry),
        aborted_counter(registry),
        features_counter(registry),
    )
    server = aio.server()
    inference_pb2_grpc.add_InferenceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield inference_pb2_grpc.InferenceServiceStub(channel)
    await server.stop(0)


async def test_engine_stats_carry_the_prefix_cache_counts(
    inference: inference_pb2_grpc.InferenceServiceStub,
) -> None:
    stats = await inference.GetEngineStats(inference_pb2.EngineStatsRequest(), timeout=10)
    assert (stats.running_requests, stats.waiting_requests) == (2, 1)
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (4096, 3072)
    assert (stats.model, stats.max_model_len) == ("tiny", 2048)
    # The adapters the engine holds, as it reports them.
    assert list(stats.held_adapters) == ["sql"]
