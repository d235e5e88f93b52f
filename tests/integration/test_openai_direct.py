"""OpenAI's completions on the direct token path: the session mesh's edge has a gateway prepare
each request (Envoy's external processor) and takes the answer, Server-Sent Events or one JSON
object, straight from a worker. The same answer as the gateway's own HTTP API, the same
errors, degraded answers that say so, the gateways still counting every request."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import openai
import psutil
import pytest
from grpc import aio

from tests.support import TINY_MODEL, direct_logs_delivered, metric_value, scrape_metrics
from tokenmesh.localmesh.mesh import LocalMesh
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc

pytestmark = pytest.mark.integration

MODEL = TINY_MODEL.name
MESSAGES = [{"role": "user", "content": "Name three colours."}]
GREEDY: dict[str, Any] = {"temperature": 0.0, "seed": 3, "max_tokens": 12}
DIRECT = "tokenmesh_gateway_direct_requests_total"
HTTP = "tokenmesh_gateway_http_requests_total"


def total(mesh: LocalMesh, name: str, **labels: str) -> float:
    return sum(
        metric_value(scrape_metrics(program.metrics_port or 0), name, 0.0, **labels)
        for program in mesh.replicas("gateway")
    )


def sdk(port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0)


@pytest.fixture(scope="module")
def edge(mesh: LocalMesh) -> Iterator[openai.OpenAI]:
    with sdk(mesh.settings.mesh().edge_port) as client:
        yield client


@pytest.fixture(scope="module")
def gateway(mesh: LocalMesh) -> Iterator[openai.OpenAI]:
    """A gateway's own HTTP API, where every token passes through the gateway."""
    with sdk(mesh.replicas("gateway")[0].openai_port or 0) as client:
        yield client


def wait_for(condition: Any, what: str, seconds: float = 15.0) -> None:
    """The gateways learn of a direct answer from Envoy's access log, flushed every 0.5 s."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def streamed(client: openai.OpenAI, **fields: Any) -> tuple[str, Any, list[Any]]:
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
            **fields,
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks[-1].usage, chunks


def test_a_chat_streams_from_a_worker_as_the_gateway_would_answer_it(
    mesh: LocalMesh, edge: openai.OpenAI, gateway: openai.OpenAI
) -> None:
    route = "/v1/chat/completions"
    direct = total(mesh, DIRECT, api="openai", outcome="direct")
    gaps = total(mesh, "tokenmesh_inter_token_latency_seconds_count")
    text, usage, chunks = streamed(edge)
    assert total(mesh, DIRECT, api="openai", outcome="direct") == direct + 1
    # No gateway saw a token of it (a gateway's own answers record each gap).
    assert total(mesh, "tokenmesh_inter_token_latency_seconds_count") == gaps
    # Counted by the gateways, from the edge's access log: read to its end, a 200. (The SDK
    # closes the connection at [DONE], which can overtake the worker's end of the stream:
    # docs/architecture.md says how that one counts.)
    direct_logs_delivered(mesh)
    served = total(mesh, HTTP, route=route, status="200")
    body = {"model": MODEL, "messages": MESSAGES, "stream": True, **GREEDY}
    edge_url = f"http://127.0.0.1:{mesh.settings.mesh().edge_port}/v1/chat/completions"
    with httpx.stream("POST", edge_url, json=body, timeout=60) as reply:
        events = [line for line in reply.iter_lines() if line.startswith("data: ")]
    assert reply.status_code == 200 and events[-1] == "data: [DONE]"
    wait_for(lambda: total(mesh, HTTP, route=route, status="200") == served + 1, "counted")
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert chunks[-2].choices[0].finish_reason == "length"
    assert usage is not None and usage.completion_tokens == GREEDY["max_tokens"]
    # The gateway's own HTTP API gives the same answer, chunk for chunk in shape.
    own_text, own_usage, own_chunks = streamed(gateway)
    assert (own_text, own_usage) == (text, usage)
    # (How many chunks depends on how the worker's outputs merge, which is timing's.)
    assert {c.object for c in own_chunks} == {c.object for c in chunks}


def test_a_whole_completion_is_the_same_object_on_both_paths(
    mesh: LocalMesh, edge: openai.OpenAI, gateway: openai.OpenAI
) -> None:
    direct = total(mesh, DIRECT, api="openai", outcome="direct")
    answers = [
        client.completions.create(model=MODEL, prompt="One, two,", logprobs=2, **GREEDY)
        for client in (edge, gateway)
    ]
    assert total(mesh, DIRECT, api="openai", outcome="direct") == direct + 1
    direct_answer, own_answer = answers
    assert direct_answer.object == own_answer.object == "text_completion"
    assert direct_answer.usage == own_answer.usage
    for mine, theirs in zip(direct_answer.choices, own_answer.choices, strict=True):
        assert (mine.text, mine.finish_reason) == (theirs.text, theirs.finish_reason)
        assert mine.logprobs is not None and theirs.logprobs is not None
        assert mine.logprobs.tokens == theirs.logprobs.tokens
        assert mine.logprobs.text_offset == theirs.logprobs.text_offset
        assert mine.logprobs.token_logprobs == pytest.approx(
            theirs.logprobs.token_logprobs, abs=1e-3
        )
    logprobs = answers[0].choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None
    assert "".join(logprobs.tokens) == answers[0].choices[0].text


def test_a_workers_refusal_is_openais_error_with_its_status(
    mesh: LocalMesh, edge: openai.OpenAI
) -> None:
    route = "/v1/completions"
    refused = total(mesh, HTTP, route=route, status="400")
    direct = total(mesh, DIRECT, api="openai", outcome="direct")
    with pytest.raises(openai.BadRequestError) as error:
        edge.completions.create(model=MODEL, prompt="hello " * 3000, max_tokens=4, stream=True)
    assert "context" in error.value.message and "2048" in error.value.message
    body = error.value.body
    assert isinstance(body, dict) and body.get("type") == "invalid_request_error"
    # Prepared for a worker, which refused it before its first token.
    assert total(mesh, DIRECT, api="openai", outcome="direct") == direct + 1
    wait_for(lambda: total(mesh, HTTP, route=route, status="400") == refused + 1, "counted")


async def test_the_workers_openai_method_is_not_served_at_the_edge(mesh: LocalMesh) -> None:
    async with aio.insecure_channel(f"127.0.0.1:{mesh.settings.mesh().edge_port}") as channel:
        call = inference_pb2_grpc.InferenceServiceStub(channel).GenerateOpenAI(
            inference_pb2.InferenceRequest(
                prompt="hi", sampling=inference_pb2.SamplingParams(max_tokens=2)
            ),
            timeout=30,
        )
        with pytest.raises(aio.AioRpcError) as refused:
            _ = [message async for message in call]
    assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_a_degraded_answer_says_so_in_its_header_and_every_chunk(
    mesh: LocalMesh, edge: openai.OpenAI
) -> None:
    reranker = psutil.Process(mesh.pid(mesh.replicas("reranker")[0].name))
    direct = total(mesh, DIRECT, api="openai", outcome="direct")
    reranker.suspend()  # SIGSTOP: the reranker's calls time out
    try:
        raw = edge.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=MESSAGES,  # type: ignore[arg-type]
            stream=True,
            extra_body={"documents": ["red", "green", "blue"], "top_k_documents": 2},
            **GREEDY,
        )
        chunks: list[Any] = list(raw.parse())
    finally:
        reranker.resume()
    assert raw.headers.get("x-tokenmesh-degraded") == "reranker"
    assert raw.headers.get("content-type", "").startswith("text/event-stream")
    assert "grpc-accept-encoding" not in raw.headers
    assert total(mesh, DIRECT, api="openai", outcome="direct") == direct + 1
    for chunk in chunks:
        marker = (chunk.model_extra or {}).get("tokenmesh")
        assert marker is not None and marker["degraded"] == "reranker", chunk
        assert marker["warnings"][0].startswith("reranker_unavailable")
    wait_for(
        lambda: any(ok for _, ok in mesh.envoy_hosts().get("reranker", [])),
        "the reranker rejoined",
        30,
    )
