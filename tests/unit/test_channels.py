"""How a failed call to a dependency reaches the caller."""

from __future__ import annotations

import grpc
from grpc import aio

from tokenmesh.common.channels import Dependency, transport_reset


def rpc_error(code: grpc.StatusCode, details: str) -> aio.AioRpcError:
    return aio.AioRpcError(code, aio.Metadata(), aio.Metadata(), details=details)


async def test_a_stream_cut_by_a_killed_worker_is_unavailable_and_says_how_far_it_got() -> None:
    """Regression (chaos worker_kill): a worker SIGKILLed mid-stream made Envoy reset the
    stream, which gRPC reports as INTERNAL; callers saw INTERNAL instead of UNAVAILABLE."""
    worker = Dependency("worker", "127.0.0.1:1", 1024)
    try:
        reset = rpc_error(
            grpc.StatusCode.INTERNAL,
            "Stream removed (RST_STREAM (Received RST_STREAM with error code 2))",
        )
        assert transport_reset(reset)
        error = worker.error(reset, "after 12 tokens")
        assert error.code is grpc.StatusCode.UNAVAILABLE
        assert error.message.startswith("worker: the stream was cut after 12 tokens")
    finally:
        await worker.close()


async def test_errors_the_worker_answered_with_keep_their_code() -> None:
    worker = Dependency("worker", "127.0.0.1:1", 1024)
    try:
        internal = rpc_error(grpc.StatusCode.INTERNAL, "ValueError: boom")
        assert not transport_reset(internal)
        assert worker.error(internal).code is grpc.StatusCode.INTERNAL
        invalid = rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "prompt: empty")
        assert worker.error(invalid, "after 1 tokens").message == "prompt: empty"
    finally:
        await worker.close()
