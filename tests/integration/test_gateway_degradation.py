"""When the reranker fails, answers keep streaming, flagged degraded; the circuit opens after the
threshold (then the reranker adds no latency), and closes again through a half-open probe once
the reranker is back. Real processes; faults are real signals."""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import time
from collections.abc import AsyncIterator, Iterator

import openai
import pytest
from grpc import aio

from tests.support import (
    ROOT,
    ServiceProcess,
    free_port,
    gateway_process,
    health_status,
    metric_value,
    positions,
    reranker_process,
    scrape_metrics,
)
from tokenmesh.v1 import llm_pb2, llm_pb2_grpc

pytestmark = pytest.mark.integration

LOG_DIR = ROOT / ".run" / "test-logs"
RERANKER_TIMEOUT = 0.5
OPEN_SECONDS = 2.0
DOCUMENTS = ["alpha", "beta", "gamma", "delta"]


@dataclasses.dataclass
class RerankedGateway:
    reranker: ServiceProcess
    gateway: ServiceProcess
    openai_port: int


@pytest.fixture(scope="module")
def faulty(worker: ServiceProcess) -> Iterator[RerankedGateway]:
    reranker = reranker_process(LOG_DIR, name="reranker-faults")
    reranker.start()
    openai_port = free_port()
    gateway = gateway_process(
        LOG_DIR,
        worker.address,
        reranker.address,
        name="gateway-faults",
        reranker_timeout_seconds=str(RERANKER_TIMEOUT),
        breaker__consecutive_failures="3",
        breaker__min_calls_in_window="100",
        breaker__open_seconds=str(OPEN_SECONDS),
        openai_port=str(openai_port),
    )
    gateway.start()
    faulty = RerankedGateway(reranker, gateway, openai_port)
    try:
        reranker.wait_serving(180)
        gateway.wait_serving(60)
        yield faulty
    finally:
        gateway.stop()
        # A test may have replaced the reranker with a restarted one: stop the current one.
        current = faulty.reranker.process
        if current is not None and current.poll() is None:
            faulty.reranker.signal(signal.SIGCONT)
        faulty.reranker.stop()
        reranker.stop()


@pytest.fixture(scope="module")
async def llm(faulty: RerankedGateway) -> AsyncIterator[llm_pb2_grpc.LLMServiceStub]:
    async with aio.insecure_channel(faulty.gateway.address) as channel:
        yield llm_pb2_grpc.LLMServiceStub(channel)


def query() -> llm_pb2.Query:
    return llm_pb2.Query(prompt="which one?", documents=DOCUMENTS, top_k_documents=3, max_tokens=4)


def gateway_metric(faulty: RerankedGateway, name: str, **labels: str) -> float:
    return metric_value(scrape_metrics(faulty.gateway.metrics_port), name, 0.0, **labels)


def rerank_seconds(faulty: RerankedGateway) -> tuple[float, float]:
    text = scrape_metrics(faulty.gateway.metrics_port)
    return (
        metric_value(text, "tokenmesh_gateway_rerank_seconds_sum", 0.0),
        metric_value(text, "tokenmesh_gateway_rerank_seconds_count", 0.0),
    )


async def test_healthy_reranker_answers_without_warnings(llm, faulty: RerankedGateway) -> None:
    answer = await llm.GetAnswer(query())
    assert not answer.warnings
    assert gateway_metric(faulty, "tokenmesh_reranker_circuit_state") == 0


async def test_hung_reranker_degrades_the_very_next_requests(llm, faulty: RerankedGateway) -> None:
    faulty.reranker.signal(signal.SIGSTOP)  # calls now time out instead of failing fast
    call = llm.Generate(
        llm_pb2.GenerateRequest(
            prompt="which one?", documents=DOCUMENTS, max_tokens=8, ignore_eos=True
        )
    )
    tokens = [token async for token in call]
    assert positions(tokens) == list(range(8))
    assert tokens[0].warnings and tokens[0].warnings[0].startswith("reranker_unavailable:")
    assert "DEADLINE_EXCEEDED" in tokens[0].warnings[0]
    assert not any(token.warnings for token in tokens[1:])
    assert dict(await call.trailing_metadata())["x-tokenmesh-degraded"] == "reranker"
    answer = await llm.GetAnswer(query())
    assert answer.warnings and list(answer.used_document_indices) == [0, 1, 2]
    assert (
        gateway_metric(faulty, "tokenmesh_degraded_responses_total", reason="reranker_timeout") == 2
    )
    assert health_status(faulty.gateway.address) == "SERVING"


async def test_open_circuit_adds_no_reranker_latency(llm, faulty: RerankedGateway) -> None:
    await llm.GetAnswer(query())  # the third consecutive failure opens the circuit
    assert gateway_metric(faulty, "tokenmesh_reranker_circuit_state") == 2
    sum_before, count_before = rerank_seconds(faulty)
    assert sum_before / count_before >= RERANKER_TIMEOUT * 0.9 * 3 / 4  # timeouts so far
    for _ in range(5):
        answer = await llm.GetAnswer(query())
        assert answer.warnings == ["reranker_unavailable: circuit open"]
    sum_after, count_after = rerank_seconds(faulty)
    per_request_while_open = (sum_after - sum_before) / (count_after - count_before)
    # Open: refused without a network wait, so a small fraction of the timeout it used to cost.
    assert per_request_while_open < RERANKER_TIMEOUT / 10
    assert (
        gateway_metric(faulty, "tokenmesh_degraded_responses_total", reason="reranker_circuit_open")
        == 5
    )
    assert health_status(faulty.gateway.address) == "SERVING"


async def test_recovered_reranker_closes_the_circuit_through_a_probe(
    llm, faulty: RerankedGateway
) -> None:
    faulty.reranker.signal(signal.SIGCONT)
    await asyncio.sleep(OPEN_SECONDS)
    answer = await llm.GetAnswer(query())  # the half-open probe
    assert not answer.warnings
    assert gateway_metric(faulty, "tokenmesh_reranker_circuit_state") == 0
    assert (
        gateway_metric(faulty, "tokenmesh_reranker_circuit_transitions_total", to="half_open") == 1
    )
    assert gateway_metric(faulty, "tokenmesh_reranker_circuit_transitions_total", to="closed") == 1
    assert not (await llm.GetAnswer(query())).warnings


async def test_killed_then_restarted_reranker_degrades_then_recovers(
    llm, faulty: RerankedGateway
) -> None:
    faulty.reranker.signal(signal.SIGKILL)
    assert faulty.reranker.process is not None
    faulty.reranker.process.wait()
    for _ in range(3):
        answer = await llm.GetAnswer(query())
        assert answer.warnings and answer.warnings[0].startswith("reranker_unavailable:")
    assert gateway_metric(faulty, "tokenmesh_reranker_circuit_state") == 2
    restarted = dataclasses.replace(
        faulty.reranker, log_path=LOG_DIR / "reranker-faults-restarted.log", health_history=[]
    )
    restarted.start()
    faulty.reranker = restarted
    await asyncio.to_thread(restarted.wait_serving, 180)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        answer = await llm.GetAnswer(query())
        if not answer.warnings:
            break
        await asyncio.sleep(0.5)
    assert not answer.warnings, answer.warnings
    assert gateway_metric(faulty, "tokenmesh_reranker_circuit_state") == 0


def test_a_degraded_openai_answer_says_so_in_its_header_and_every_object(
    faulty: RerankedGateway,
) -> None:
    """The OpenAI API's degraded answers (the same pipeline as gRPC's): the
    x-tokenmesh-degraded header, and the documented tokenmesh field in the object and in
    every streamed chunk."""
    url = f"http://127.0.0.1:{faulty.openai_port}/v1"
    faulty.reranker.signal(signal.SIGSTOP)
    try:
        with openai.OpenAI(base_url=url, api_key="unused", max_retries=0) as sdk:
            model = sdk.models.list().data[0].id
            ask = dict(
                model=model,
                messages=[{"role": "user", "content": "which one?"}],
                max_tokens=4,
                extra_body={"documents": DOCUMENTS, "ignore_eos": True},
            )
            raw = sdk.chat.completions.with_raw_response.create(**ask)  # type: ignore[call-overload]
            assert raw.headers["x-tokenmesh-degraded"] == "reranker"
            marker = (raw.parse().model_extra or {})["tokenmesh"]
            assert marker["degraded"] == "reranker"
            assert marker["warnings"][0].startswith("reranker_unavailable:")
            with sdk.chat.completions.with_streaming_response.create(  # type: ignore[call-overload]
                stream=True, **ask
            ) as streamed:
                assert streamed.headers["x-tokenmesh-degraded"] == "reranker"
                chunks = list(streamed.parse())
            assert chunks
            assert all((c.model_extra or {})["tokenmesh"]["degraded"] == "reranker" for c in chunks)
    finally:
        faulty.reranker.signal(signal.SIGCONT)
