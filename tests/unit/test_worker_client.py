"""The gateway's worker client: how a worker stream that breaks reaches the caller."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from grpc import aio

from tokenmesh.common.channels import Dependency
from tokenmesh.common.errors import DependencyError
from tokenmesh.gateway.core.workers import WorkerClient
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc, token_pb2

# Generous bound on connecting to the in-process server.
CONNECT_WITHIN = 10.0


class BreakingWorker(inference_pb2_grpc.InferenceServiceServicer):
    """Sends two tokens, then fails as Envoy's reset looks to gRPC, `fail_before_deadline`
    seconds before the caller's deadline."""

    def __init__(self, fail_before_deadline: float) -> None:
        self.fail_before_deadline = fail_before_deadline

    async def Generate(
        self, request: inference_pb2.InferenceRequest, context: aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[token_pb2.Token]:
        for index in range(2):
            yield token_pb2.Token(index=index, token_id=index)
        remaining = context.time_remaining() or 0.0
        await asyncio.sleep(max(remaining - self.fail_before_deadline, 0.0))
        await context.abort(
            grpc.StatusCode.INTERNAL, "Stream removed (Received RST_STREAM with error code 2)"
        )


async def stream_until_broken(fail_before_deadline: float, time_limit: float) -> DependencyError:
    server = aio.server()
    inference_pb2_grpc.add_InferenceServiceServicer_to_server(
        BreakingWorker(fail_before_deadline), server
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    worker = Dependency("worker", f"127.0.0.1:{port}", 1024 * 1024)
    try:
        # Connected first, so a loaded machine's slow connect takes nothing from time_limit.
        await worker.ensure_connected(CONNECT_WITHIN)
        client = WorkerClient(worker, connect_timeout=5)
        tokens = []
        with pytest.raises(DependencyError) as raised:
            async for token in client.stream(inference_pb2.InferenceRequest(), time_limit):
                tokens.append(token.index)
        assert tokens == [0, 1]
        return raised.value
    finally:
        await worker.close()
        await server.stop(None)


async def test_a_reset_at_the_deadline_is_deadline_exceeded() -> None:
    """Regression (chaos deadline_storm): Envoy enforces the caller's deadline too and resets
    the worker stream when it passes, which could reach the gateway before its own timer fired;
    19 of 100 callers whose deadlines passed saw UNAVAILABLE (INTERNAL before that fix)."""
    error = await stream_until_broken(fail_before_deadline=0.01, time_limit=1.0)
    assert error.code is grpc.StatusCode.DEADLINE_EXCEEDED
    assert error.message == "worker: deadline exceeded after 2 tokens"


async def test_a_reset_well_before_the_deadline_is_unavailable() -> None:
    error = await stream_until_broken(fail_before_deadline=5.0, time_limit=6.0)
    assert error.code is grpc.StatusCode.UNAVAILABLE
    assert error.message.startswith("worker: the stream was cut after 2 tokens")
