"""The reranker's EmbeddingService side: embedding and rerank jobs share one model call, an input
longer than the model reads is refused on its own (never truncated), token counts are what the
model read, and Embed and Rank requests are validated naming the field and the limit.

Fake encoders stand in for the model; tests/integration/test_openai_embeddings.py runs MiniLM."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from numpy.typing import NDArray

from tokenmesh.common.errors import InvalidArgument, NotFound
from tokenmesh.reranker.batcher import MicroBatcher
from tokenmesh.reranker.config import RerankerSettings
from tokenmesh.reranker.model import BiEncoderScorer, Embedded, Scored
from tokenmesh.reranker.requests import (
    EmbedJob,
    ModelInfo,
    RerankJob,
    validate,
    validate_embed,
    validate_rank,
)
from tokenmesh.v1 import rerank_pb2

VECTORS = {
    "query": [1.0, 0.0, 0.0],
    "near": [0.8, 0.6, 0.0],
    "far": [0.0, 0.0, 1.0],
    "four words long text": [0.0, 1.0, 0.0],
}
INFO = ModelInfo("fake-model", dimensions=3, max_input_tokens=5)


class FakeEncoder:
    def __init__(self) -> None:
        self.calls: list[tuple[list[str], list[int]]] = []

    def __call__(self, texts: list[str], lengths: list[int]) -> NDArray[np.float32]:
        self.calls.append((texts, lengths))
        return np.array([VECTORS[text] for text in texts], dtype=np.float32)


def count_words(texts: list[str]) -> list[int]:
    """A token per word and two special tokens: "four words long text" is 6, over INFO's 5."""
    return [len(text.split()) + 2 for text in texts]


def test_embeddings_and_reranks_share_one_model_call_each_text_embedded_once() -> None:
    encoder = FakeEncoder()
    jobs = [
        RerankJob("query", ("far", "near"), 2),
        EmbedJob(("near", "query", "far")),
    ]
    ranked, embedded = BiEncoderScorer(encoder, count_words, INFO).run(jobs)
    assert len(encoder.calls) == 1
    texts, lengths = encoder.calls[0]
    assert sorted(texts) == ["far", "near", "query"]
    assert lengths == [3, 3, 3]
    assert isinstance(ranked, Scored) and ranked.scores == pytest.approx([0.0, 0.8])
    assert ranked.tokens == 9  # the query's and each document's
    assert isinstance(embedded, Embedded)
    assert embedded.vectors.dtype == np.float32
    expected = np.array([VECTORS["near"], VECTORS["query"], VECTORS["far"]], dtype=np.float32)
    assert np.array_equal(embedded.vectors, expected)
    assert embedded.tokens == 9


def test_an_input_longer_than_the_model_reads_is_refused_alone_and_not_embedded() -> None:
    encoder = FakeEncoder()
    jobs = [EmbedJob(("near", "four words long text")), EmbedJob(("far",))]
    refused, answered = BiEncoderScorer(encoder, count_words, INFO).run(jobs)
    assert isinstance(refused, InvalidArgument)
    assert str(refused) == "input[1]: is 6 tokens, over the model's limit of 5 tokens"
    assert refused.field == "input[1]"
    assert isinstance(answered, Embedded) and answered.tokens == 3
    assert encoder.calls == [(["far"], [3])]


def test_a_rerank_document_longer_than_the_model_reads_counts_only_what_it_read() -> None:
    """Reranks keep RerankService's rule: long documents are read up to the model's limit."""
    encoder = FakeEncoder()
    job = RerankJob("query", ("four words long text",), 1)
    (scored,) = BiEncoderScorer(encoder, count_words, INFO).run([job])
    assert isinstance(scored, Scored) and scored.tokens == 3 + 5
    assert encoder.calls[0][1] == [3, 5]


async def test_a_result_that_is_an_error_is_raised_to_its_caller_alone() -> None:
    scorer = BiEncoderScorer(FakeEncoder(), count_words, INFO)
    batcher = MicroBatcher(scorer.run, max_wait_seconds=0.05, max_size=100)
    batcher.start()
    try:
        refused = asyncio.ensure_future(batcher.submit(EmbedJob(("four words long text",))))
        answered = await batcher.submit(RerankJob("query", ("near",), 1))
        with pytest.raises(InvalidArgument) as error:
            await refused
    finally:
        await batcher.close()
    assert error.value.field == "input[0]"
    assert isinstance(answered, Scored) and answered.scores == pytest.approx([0.8])


LIMITS = RerankerSettings(
    max_embedding_inputs=3,
    max_input_bytes=5,
    max_query_bytes=10,
    max_documents=3,
    max_document_bytes=5,
)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        (dict(input=[]), "input: must not be empty (send 1 or more texts)"),
        (dict(input=["a"] * 4), "input: has 4 texts, over the limit of 3"),
        (dict(input=["a", ""]), "input[1]: must not be empty"),
        (dict(input=["a", "abcdef"]), "input[1]: is 6 bytes, over the limit of 5"),
        (
            dict(dimensions=2),
            "dimensions: 'fake-model' gives embeddings of 3 dimensions only, got 2",
        ),
    ],
)
def test_embed_requests_out_of_bounds_name_the_field_and_the_limit(
    fields: dict, expected: str
) -> None:
    request = rerank_pb2.EmbedRequest(**{"model": "fake-model", "input": ["a", "b"], **fields})
    with pytest.raises(InvalidArgument) as error:
        validate_embed(request, LIMITS, INFO)
    assert str(error.value) == expected


def test_an_embed_request_of_the_models_own_dimensions_or_none_is_taken() -> None:
    for dimensions in (0, 3):
        request = rerank_pb2.EmbedRequest(model="fake-model", input=["a"], dimensions=dimensions)
        assert validate_embed(request, LIMITS, INFO) == EmbedJob(("a",))


def test_another_model_is_not_found_naming_the_served_one() -> None:
    with pytest.raises(NotFound) as error:
        validate_embed(rerank_pb2.EmbedRequest(model="gpt", input=["a"]), LIMITS, INFO)
    assert "'gpt' does not exist" in str(error.value) and "'fake-model'" in str(error.value)
    with pytest.raises(NotFound):
        validate_rank(rerank_pb2.RankRequest(model="gpt", query="q", documents=["a"]), LIMITS, INFO)


def test_a_model_without_embeddings_refuses_embed_requests() -> None:
    cross_encoder = ModelInfo("ranker", dimensions=0, max_input_tokens=512)
    with pytest.raises(InvalidArgument) as error:
        validate_embed(rerank_pb2.EmbedRequest(model="ranker", input=["a"]), LIMITS, cross_encoder)
    assert error.value.field == "model"


@pytest.mark.parametrize(("top_n", "top_k"), [(0, 3), (1, 1), (3, 3), (50, 3)])
def test_top_n_zero_or_past_the_documents_ranks_them_all(top_n: int, top_k: int) -> None:
    request = rerank_pb2.RankRequest(
        model="fake-model", query="q", documents=["a", "b", "c"], top_n=top_n
    )
    assert validate_rank(request, LIMITS, INFO) == RerankJob("q", ("a", "b", "c"), top_k)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        (dict(top_n=-1), "top_n: must be 0 (all documents) or more, got -1"),
        (dict(query=""), "query: must not be empty"),
        (dict(documents=[]), "documents: must not be empty (send 1 or more documents)"),
        (dict(documents=["a"] * 4), "documents: has 4 documents, over the limit of 3"),
        (dict(documents=["a", "abcdef"]), "documents[1]: is 6 bytes, over the limit of 5"),
    ],
)
def test_rank_requests_are_checked_as_rerank_requests_are(fields: dict, expected: str) -> None:
    request = rerank_pb2.RankRequest(
        **{"model": "fake-model", "query": "q", "documents": ["a", "b"], **fields}
    )
    with pytest.raises(InvalidArgument) as error:
        validate_rank(request, LIMITS, INFO)
    assert str(error.value) == expected
    if "top_n" not in fields:
        # The same message RerankService gives for the same texts.
        same = {key: value for key, value in fields.items() if key != "top_n"}
        with pytest.raises(InvalidArgument) as rerank_error:
            validate(
                rerank_pb2.RerankRequest(**{"query": "q", "documents": ["a", "b"], **same}),
                LIMITS,
            )
        assert str(rerank_error.value) == expected
