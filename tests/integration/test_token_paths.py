"""One set of expectations for both token paths: a caller sees the same answer whether Envoy
streams a worker's tokens straight to it (`direct`: the edge, the default) or the tokens pass
through a gateway (`gateway`: a gateway's own LLMService, the path that token quotas,
gRPC-Web and the Chat RPC take). Both present the same prepared call with the same code
(common/presentation.py, the worker's first-token warnings)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import psutil
import pytest
from grpc import aio

from tests.support import positions
from tokenmesh.localmesh.mesh import LocalMesh
from tokenmesh.v1 import llm_pb2, llm_pb2_grpc, token_pb2

pytestmark = pytest.mark.integration

PATHS = ("direct", "gateway")


def address(mesh: LocalMesh, path: str) -> str:
    if path == "direct":
        return f"127.0.0.1:{mesh.settings.mesh().edge_port}"
    return mesh.replicas("gateway")[0].address


@pytest.fixture(params=PATHS)
async def llm(
    request: pytest.FixtureRequest, mesh: LocalMesh
) -> AsyncIterator[llm_pb2_grpc.LLMServiceStub]:
    async with aio.insecure_channel(address(mesh, request.param)) as channel:
        yield llm_pb2_grpc.LLMServiceStub(channel)


async def test_a_stream_is_contiguous_with_one_finish_and_its_usage(
    llm: llm_pb2_grpc.LLMServiceStub,
) -> None:
    request = llm_pb2.GenerateRequest(prompt="both paths", max_tokens=24, ignore_eos=True)
    tokens = [token async for token in llm.Generate(request, timeout=120)]
    assert positions(tokens) == list(range(24))
    assert [bool(token.finish_reason) for token in tokens] == [False] * (len(tokens) - 1) + [True]
    last = tokens[-1]
    assert last.finish_reason == token_pb2.FINISH_REASON_LENGTH
    assert last.usage.completion_tokens == 24 and last.usage.prompt_tokens > 0
    assert not any(token.warnings for token in tokens)


async def test_logprobs_reach_the_caller_for_every_token(llm: llm_pb2_grpc.LLMServiceStub) -> None:
    request = llm_pb2.GenerateRequest(
        prompt="logprobs", max_tokens=6, ignore_eos=True, logprobs=True, top_logprobs=2
    )
    tokens = [token async for token in llm.Generate(request, timeout=120)]
    per_position = [
        alternatives
        for token in tokens
        for alternatives in (
            [token.top_logprobs, *(p.top_logprobs for p in token.following_logprobs)]
        )
    ]
    assert len(per_position) == 6
    assert all(len(alternatives) == 2 for alternatives in per_position)


async def test_bad_input_gets_the_same_status_and_message(
    llm: llm_pb2_grpc.LLMServiceStub,
) -> None:
    request = llm_pb2.GenerateRequest(prompt="x", max_tokens=10**6)
    with pytest.raises(aio.AioRpcError) as refused:
        [token async for token in llm.Generate(request, timeout=30)]
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details() == "max_tokens: must be in [1, 4096] (0 with echo), got 1000000"


async def test_a_degraded_answer_has_its_warning_on_the_first_token_and_its_trailer(
    llm: llm_pb2_grpc.LLMServiceStub, mesh: LocalMesh
) -> None:
    """With the reranker stopped, the answer is prepared without it: the first token carries
    the warning and the stream ends with the degraded trailer, on either path."""
    reranker = psutil.Process(mesh.pid(mesh.replicas("reranker")[0].name))
    request = llm_pb2.GenerateRequest(
        prompt="which one?", documents=["alpha", "beta", "gamma"], top_k_documents=2, max_tokens=4
    )
    reranker.suspend()  # SIGSTOP: the reranker's calls time out
    try:
        call = llm.Generate(request, timeout=60)
        tokens = [token async for token in call]
        trailers = tuple(await call.trailing_metadata())
    finally:
        reranker.resume()
    assert positions(tokens) == list(range(4))
    assert tokens[0].warnings and tokens[0].warnings[0].startswith("reranker_unavailable")
    assert not any(token.warnings for token in tokens[1:])
    assert ("x-tokenmesh-degraded", "reranker") in trailers
    deadline = time.monotonic() + 30
    while not any(ok for _, ok in mesh.envoy_hosts().get("reranker", [])):
        assert time.monotonic() < deadline, "the reranker did not rejoin"
        await asyncio.sleep(0.2)


async def test_both_paths_give_the_same_greedy_answer(mesh: LocalMesh) -> None:
    request = llm_pb2.GenerateRequest(
        prompt="the same answer", max_tokens=16, ignore_eos=True, temperature=0.0
    )
    answers = []
    for path in PATHS:
        async with aio.insecure_channel(address(mesh, path)) as channel:
            stub = llm_pb2_grpc.LLMServiceStub(channel)
            tokens = [token async for token in stub.Generate(request, timeout=120)]
        answers.append(([i for t in tokens for i in t.token_ids], tokens[-1].usage))
    assert answers[0] == answers[1]
