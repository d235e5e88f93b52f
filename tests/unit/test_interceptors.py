"""The shared interceptors map errors to status codes and count RPCs like go-grpc-prometheus.

A small servicer stands in for real handlers: the interceptors' logic does not depend on what
the handlers do, only on how they end."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from grpc import aio
from prometheus_client import CollectorRegistry

from tokenmesh.common.errors import InvalidArgument, ResourceExhausted
from tokenmesh.common.interceptors import ErrorMappingInterceptor, ObservingInterceptor
from tokenmesh.common.metrics import GrpcServerMetrics
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc, token_pb2

SERVICE = "tokenmesh.v1.InferenceService"
RPC_TYPES = {"Generate": "server_stream", "GetEngineStats": "unary"}


class ScriptedServicer(inference_pb2_grpc.InferenceServiceServicer):
    """Behaves according to the prompt: "ok", "invalid", "exhausted", "crash", "slow"."""

    async def Generate(self, request: Any, context: Any) -> AsyncIterator[token_pb2.Token]:
        for index in range(3):
            if request.prompt == "slow":
                await asyncio.sleep(10)
            yield token_pb2.Token(index=index)
            if request.prompt == "invalid":
                raise InvalidArgument("prompt", "is not allowed")
            if request.prompt == "crash":
                raise RuntimeError("boom")

    async def GetEngineStats(self, request: Any, context: Any) -> inference_pb2.EngineStats:
        if context.invocation_metadata() and dict(context.invocation_metadata()).get("fail"):
            raise ResourceExhausted("queue full (limit 3)")
        return inference_pb2.EngineStats(running_requests=1)


@pytest.fixture
async def server_and_registry():
    registry = CollectorRegistry()
    server = aio.server(
        interceptors=[
            ObservingInterceptor(GrpcServerMetrics(registry)),
            ErrorMappingInterceptor(),
        ]
    )
    inference_pb2_grpc.add_InferenceServiceServicer_to_server(ScriptedServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield inference_pb2_grpc.InferenceServiceStub(channel), registry
    await server.stop(0)


def value(registry: CollectorRegistry, name: str, method: str, **labels: str) -> float:
    found = registry.get_sample_value(
        name,
        {"grpc_service": SERVICE, "grpc_method": method, "grpc_type": RPC_TYPES[method], **labels},
    )
    return found or 0.0


async def collect(call: Any) -> tuple[list[Any], grpc.StatusCode]:
    tokens = []
    try:
        async for token in call:
            tokens.append(token)
    except aio.AioRpcError as err:
        return tokens, err.code()
    return tokens, grpc.StatusCode.OK


async def test_ok_stream_counts_started_handled_and_messages(server_and_registry) -> None:
    stub, registry = server_and_registry
    tokens, code = await collect(stub.Generate(inference_pb2.InferenceRequest(prompt="ok")))
    assert code == grpc.StatusCode.OK and len(tokens) == 3
    assert await _handled(registry) == {"OK": 1}
    assert value(registry, "grpc_server_started_total", "Generate") == 1
    assert value(registry, "grpc_server_stream_msg_sent_total", "Generate") == 3
    assert value(registry, "grpc_server_stream_msg_received_total", "Generate") == 1
    assert value(registry, "grpc_server_handling_seconds_count", "Generate") == 1


async def test_service_error_mid_stream_becomes_its_status(server_and_registry) -> None:
    stub, registry = server_and_registry
    call = stub.Generate(inference_pb2.InferenceRequest(prompt="invalid"))
    tokens, code = await collect(call)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert await call.details() == "prompt: is not allowed"
    assert len(tokens) == 1
    assert await _handled(registry) == {"INVALID_ARGUMENT": 1}


async def test_unexpected_exception_becomes_internal_with_message(server_and_registry) -> None:
    stub, registry = server_and_registry
    call = stub.Generate(inference_pb2.InferenceRequest(prompt="crash"))
    _, code = await collect(call)
    assert code == grpc.StatusCode.INTERNAL
    assert "RuntimeError: boom" in await call.details()
    assert await _handled(registry) == {"INTERNAL": 1}


async def test_unary_service_error_maps_and_counts(server_and_registry) -> None:
    stub, registry = server_and_registry
    reply = await stub.GetEngineStats(inference_pb2.EngineStatsRequest())
    assert reply.running_requests == 1
    with pytest.raises(aio.AioRpcError) as err:
        await stub.GetEngineStats(inference_pb2.EngineStatsRequest(), metadata=(("fail", "1"),))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.value.details() == "queue full (limit 3)"
    assert value(registry, "grpc_server_started_total", "GetEngineStats") == 2
    assert value(registry, "grpc_server_handled_total", "GetEngineStats", grpc_code="OK") == 1
    assert (
        value(
            registry, "grpc_server_handled_total", "GetEngineStats", grpc_code="RESOURCE_EXHAUSTED"
        )
        == 1
    )


async def _handled(registry: CollectorRegistry, within: float = 10.0) -> dict[str, float]:
    """Generate's grpc_server_handled_total by code, once the RPC has been counted (the server
    counts it after the client has seen its end); all codes, so a failure shows what was."""
    give_up = time.monotonic() + within
    while True:
        counts = {
            sample.labels["grpc_code"]: sample.value
            for metric in registry.collect()
            for sample in metric.samples
            if sample.name == "grpc_server_handled_total"
            and sample.labels["grpc_method"] == "Generate"
        }
        if counts or time.monotonic() > give_up:
            return counts
        await asyncio.sleep(0.01)


async def test_client_cancel_is_counted_as_cancelled(server_and_registry) -> None:
    stub, registry = server_and_registry
    call = stub.Generate(inference_pb2.InferenceRequest(prompt="slow"))
    # Cancelled once the handler runs: a call cancelled before that is never seen by it.
    give_up = time.monotonic() + 10
    while not value(registry, "grpc_server_started_total", "Generate"):
        assert time.monotonic() < give_up, "the handler never started"
        await asyncio.sleep(0.01)
    call.cancel()
    assert await _handled(registry) == {"CANCELLED": 1}


async def test_deadline_is_counted_as_deadline_exceeded(server_and_registry) -> None:
    stub, registry = server_and_registry
    # Long enough for the handler to have started on a busy machine: a call that ends before
    # its handler runs is never seen by the interceptor.
    _, code = await collect(
        stub.Generate(inference_pb2.InferenceRequest(prompt="slow"), timeout=1.0)
    )
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert await _handled(registry) == {"DEADLINE_EXCEEDED": 1}


@pytest.mark.parametrize(
    "body",
    [b"\xff\xff\xff", b"\x12\x03\xff\xfe\xfd"],  # not protobuf; a prompt of invalid UTF-8
    ids=["garbage", "invalid-utf8"],
)
async def test_a_request_that_does_not_parse_is_invalid_argument(body: bytes) -> None:
    server = aio.server(interceptors=[ErrorMappingInterceptor()])
    inference_pb2_grpc.add_InferenceServiceServicer_to_server(ScriptedServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            # Raw bytes instead of a serialized InferenceRequest.
            generate = channel.unary_stream(f"/{SERVICE}/Generate")
            with pytest.raises(aio.AioRpcError) as error:
                [message async for message in generate(body, timeout=5)]
    finally:
        await server.stop(0)
    assert error.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "request: not a valid message" in (error.value.details() or "")
