"""The public API's calls counted by the path their tokens took: the gateway path as the
gateway's server ends them (with the code error mapping gave), only for LLMService."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from grpc import aio
from prometheus_client import CollectorRegistry

from tokenmesh.common.errors import InvalidArgument
from tokenmesh.common.interceptors import standard_interceptors
from tokenmesh.gateway.frontends.calls import CallMetrics
from tokenmesh.v1 import llm_pb2, llm_pb2_grpc, token_pb2

CALLS = "tokenmesh_gateway_calls_total"


class Scripted(llm_pb2_grpc.LLMServiceServicer):
    """Generate: two tokens, or INVALID_ARGUMENT for the prompt "bad"."""

    async def Generate(self, request: Any, context: Any) -> AsyncIterator[token_pb2.Token]:
        if request.prompt == "bad":
            raise InvalidArgument("prompt", "is bad")
        for index in range(2):
            yield token_pb2.Token(index=index)


def calls(registry: CollectorRegistry, code: str, path: str = "gateway") -> float:
    labels = {
        "grpc_service": "tokenmesh.v1.LLMService",
        "grpc_method": "Generate",
        "path": path,
        "grpc_code": code,
    }
    return registry.get_sample_value(CALLS, labels) or 0.0


async def test_the_gateway_paths_calls_are_counted_with_their_final_code() -> None:
    registry = CollectorRegistry()
    metrics = CallMetrics(registry)
    server = aio.server(interceptors=standard_interceptors(registry, ends=metrics.ends))
    llm_pb2_grpc.add_LLMServiceServicer_to_server(Scripted(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = llm_pb2_grpc.LLMServiceStub(channel)
            tokens = [t async for t in stub.Generate(llm_pb2.GenerateRequest(prompt="hi"))]
            assert len(tokens) == 2
            with pytest.raises(aio.AioRpcError) as refused:
                async for _ in stub.Generate(llm_pb2.GenerateRequest(prompt="bad")):
                    pass
            assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    finally:
        await server.stop(None)
    assert calls(registry, "OK") == 1
    assert calls(registry, "INVALID_ARGUMENT") == 1
    assert calls(registry, "OK", path="direct") == 0
    seconds = {"grpc_method": "Generate", "path": "gateway"}
    assert registry.get_sample_value("tokenmesh_gateway_call_seconds_count", seconds) == 2


def test_only_the_public_services_methods_are_accounted() -> None:
    metrics = CallMetrics(CollectorRegistry())
    assert metrics.ends("/tokenmesh.v1.LLMService/Chat") is not None
    assert metrics.ends("/grpc.health.v1.Health/Check") is None
    assert metrics.ends("/envoy.service.ext_proc.v3.ExternalProcessor/Process") is None
