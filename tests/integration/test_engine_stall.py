"""A hung engine: vLLM's engine core SIGSTOPped mid-stream (alive, making no step) turns a real
worker NOT_SERVING after engine_stall_seconds, and SERVING again once it moves; the streams
then complete."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator

import pytest
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support import (
    ROOT,
    ServiceProcess,
    engine_cores,
    metric_value,
    positions,
    read_rest,
    scrape_metrics,
    worker_process,
)
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc, token_pb2
from tokenmesh.worker.app import SERVICE_NAMES

pytestmark = pytest.mark.integration

STALL_SECONDS = 3.0
CHECK_INTERVAL_SECONDS = 0.5
# What a loaded machine may add to a health change (a check, a scheduling delay).
SLACK_SECONDS = 10.0
# Streams long enough that none can finish between the first token and the stop: a warm tiny
# engine makes 2,000 tokens of one stream in about a second.
STREAMS = 4
TOKENS = 2000


@pytest.fixture(scope="module")
def stall_worker() -> Iterator[ServiceProcess]:
    """A worker of its own: the session's keeps the default engine_stall_seconds (60 s)."""
    worker = worker_process(
        ROOT / ".run" / "test-logs",
        name="worker-engine-stall",
        engine_stall_seconds=str(STALL_SECONDS),
        engine_check_interval_seconds=str(CHECK_INTERVAL_SECONDS),
    )
    worker.start()
    try:
        worker.wait_serving(300)
        yield worker
    finally:
        worker.stop()


async def statuses(channel: aio.Channel) -> set[str]:
    """The worker's health for the whole server and for each of its services."""
    stub = health_pb2_grpc.HealthStub(channel)
    seen = set()
    for service in ("", *SERVICE_NAMES):
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        seen.add(str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)))
    return seen


async def wait_for(channel: aio.Channel, status: str, within: float) -> float:
    """Seconds until every health answer is `status`; fails after `within`."""
    started = time.monotonic()
    while (seen := await statuses(channel)) != {status}:
        assert time.monotonic() - started < within, f"still {seen} after {within} s"
        await asyncio.sleep(0.1)
    return time.monotonic() - started


async def test_a_hung_engine_turns_the_worker_not_serving_until_it_moves_again(
    stall_worker: ServiceProcess,
) -> None:
    # Found before any stream starts, so the stop follows the first token at once.
    assert stall_worker.process is not None
    cores = engine_cores(stall_worker.process.pid)
    assert cores, "no EngineCore child process found"
    async with aio.insecure_channel(stall_worker.address) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        calls = [
            stub.Generate(
                inference_pb2.InferenceRequest(
                    prompt=f"hang on {i}",
                    sampling=inference_pb2.SamplingParams(max_tokens=TOKENS, ignore_eos=True),
                ),
                timeout=120,
            )
            for i in range(STREAMS)
        ]
        first = await calls[0].read()
        try:
            for core in cores:
                os.kill(core.pid, signal.SIGSTOP)
            stopped_at = time.monotonic()
            await wait_for(channel, "NOT_SERVING", STALL_SECONDS + SLACK_SECONDS)
            # Not before the limit: its last step came at most a moment before the stop.
            assert time.monotonic() - stopped_at >= STALL_SECONDS - CHECK_INTERVAL_SECONDS
            metrics = scrape_metrics(stall_worker.metrics_port)
            assert metric_value(metrics, "tokenmesh_worker_engine_stalled") == 1
            assert metric_value(metrics, "tokenmesh_worker_engine_step_age_seconds") >= (
                STALL_SECONDS
            )
            # It stays NOT_SERVING while the engine is hung.
            await asyncio.sleep(2 * CHECK_INTERVAL_SECONDS)
            assert await statuses(channel) == {"NOT_SERVING"}
        finally:
            for core in cores:
                os.kill(core.pid, signal.SIGCONT)
        await wait_for(channel, "SERVING", SLACK_SECONDS)
        streams = [[first, *await read_rest(calls[0])]]
        streams.extend([await read_rest(call) for call in calls[1:]])
        for tokens in streams:
            assert positions(tokens) == list(range(TOKENS))
            assert tokens[-1].finish_reason == token_pb2.FINISH_REASON_LENGTH
        metrics = scrape_metrics(stall_worker.metrics_port)
        assert metric_value(metrics, "tokenmesh_worker_engine_stalled") == 0
        # Idle for longer than the limit, the worker stays SERVING.
        await asyncio.sleep(STALL_SECONDS + 2 * CHECK_INTERVAL_SECONDS)
        assert await statuses(channel) == {"SERVING"}
    # Each change is logged once, not at every check: stalled, moving again, in turn. The
    # stop's stall comes first; a step the loaded machine delays past the 3 s limit after the
    # resume is a stall too, and is logged as one.
    log = stall_worker.log_path.read_text(errors="replace")
    changes = [
        "stalled" if "inference engine stalled" in line else "moving"
        for line in log.splitlines()
        if "inference engine stalled" in line or "inference engine moving again" in line
    ]
    assert changes and changes == ["stalled", "moving"] * (len(changes) // 2), (
        stall_worker.log_tail()
    )
