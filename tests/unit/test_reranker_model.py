"""Scoring flattens a whole batch into one model call and maps scores back to each request;
requests are validated against the reranker's limits; settings come from TOKENMESH_RERANKER_*.

Fake encoders stand in for the model here; tests/integration/test_reranker.py runs the real
MiniLM."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
from numpy.typing import NDArray

from tokenmesh.common.errors import InvalidArgument
from tokenmesh.reranker.config import RerankerSettings
from tokenmesh.reranker.model import BiEncoderScorer, CrossEncoderScorer, Scored
from tokenmesh.reranker.requests import ModelInfo, RerankJob, validate
from tokenmesh.v1 import rerank_pb2

# Unit vectors for the fake encoder: "paris" is close to the query, "banana" orthogonal.
VECTORS = {
    "capital of france?": [1.0, 0.0, 0.0],
    "paris": [0.8, 0.6, 0.0],
    "lyon": [0.6, 0.8, 0.0],
    "banana": [0.0, 0.0, 1.0],
    "fruit?": [0.0, 0.6, 0.8],
}


INFO = ModelInfo("fake", dimensions=3, max_input_tokens=256)


class FakeEncoder:
    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def __call__(self, texts: list[str], lengths: list[int]) -> NDArray[np.float32]:
        self.calls.append(texts)
        return np.array([VECTORS[text] for text in texts], dtype=np.float32)


def count_words(texts: list[str]) -> list[int]:
    """A token per word, and two for the special tokens around them."""
    return [len(text.split()) + 2 for text in texts]


def scores_of(scorer: BiEncoderScorer | CrossEncoderScorer, jobs: list[RerankJob]) -> list:
    results = scorer.run(jobs)
    assert all(isinstance(result, Scored) for result in results)
    return [result.scores for result in results if isinstance(result, Scored)]


def test_bi_encoder_embeds_each_distinct_text_of_a_batch_once_in_one_call() -> None:
    encoder = FakeEncoder()
    jobs = [
        RerankJob("capital of france?", ("banana", "paris", "lyon", "paris"), 4),
        RerankJob("fruit?", ("paris", "banana"), 2),
    ]
    scores = scores_of(BiEncoderScorer(encoder, count_words, INFO), jobs)
    assert len(encoder.calls) == 1
    assert sorted(encoder.calls[0]) == sorted(VECTORS)
    assert scores[0] == pytest.approx([0.0, 0.8, 0.6, 0.8])
    assert scores[1] == pytest.approx([0.36, 0.8])
    # The same text gets the very same score, so duplicates tie exactly.
    assert scores[0][1] == scores[0][3]


def stack_rows(
    table: dict[str, NDArray[np.float32]], texts: list[str], lengths: list[int]
) -> NDArray[np.float32]:
    return np.stack([table[text] for text in texts])


def test_duplicate_documents_tie_exactly_wherever_they_sit() -> None:
    # A BLAS matrix-vector product (documents @ query) breaks most of these ties: it sums
    # rows differently depending on their position in the matrix.
    rng = np.random.default_rng(7)
    for count in range(2, 20):
        texts = ["query", "other", "duplicate"]
        vectors = rng.standard_normal((len(texts), 384)).astype(np.float32)
        vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
        table = dict(zip(texts, vectors, strict=True))
        scorer = BiEncoderScorer(partial(stack_rows, table), count_words, INFO)
        documents = ("other", *["duplicate"] * count, "other")
        (scores,) = scores_of(scorer, [RerankJob("query", documents, len(documents))])
        assert len(set(scores[1:-1])) == 1, (count, scores)
        assert scores[0] == scores[-1]
        assert scores[1] == pytest.approx(float(table["duplicate"] @ table["query"]), abs=1e-6)


def test_cross_encoder_scores_every_pair_in_one_call_and_splits_per_request() -> None:
    calls: list[list[tuple[str, str]]] = []

    def predict(pairs: list[tuple[str, str]]) -> NDArray[np.float32]:
        calls.append(pairs)
        return np.array([len(query) + len(document) for query, document in pairs], np.float32)

    def count(pairs: list[tuple[str, str]]) -> list[int]:
        return [3] * len(pairs)

    jobs = [RerankJob("q", ("a", "bb"), 2), RerankJob("qq", ("ccc",), 1)]
    scorer = CrossEncoderScorer(predict, count, ModelInfo("fake", 0, 512))
    assert scorer.run(jobs) == [Scored([2.0, 3.0], 6), Scored([5.0], 3)]
    assert calls == [[("q", "a"), ("q", "bb"), ("qq", "ccc")]]


LIMITS = RerankerSettings(max_query_bytes=10, max_documents=3, max_document_bytes=5)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        (dict(query=""), "query: must not be empty"),
        (dict(query="é" * 6), "query: is 12 bytes, over the limit of 10"),
        (dict(documents=[]), "documents: must not be empty (send 1 or more documents)"),
        (dict(documents=["a"] * 4), "documents: has 4 documents, over the limit of 3"),
        (dict(documents=["a", ""]), "documents[1]: must not be empty"),
        (dict(documents=["a", "b", "abcdef"]), "documents[2]: is 6 bytes, over the limit of 5"),
        (dict(top_k=-1), "top_k: must be in [0, 2] (0 = all documents), got -1"),
        (dict(top_k=3), "top_k: must be in [0, 2] (0 = all documents), got 3"),
    ],
)
def test_invalid_requests_name_the_field_and_the_limit(fields: dict, expected: str) -> None:
    request = rerank_pb2.RerankRequest(**{"query": "q", "documents": ["a", "b"], **fields})
    with pytest.raises(InvalidArgument) as error:
        validate(request, LIMITS)
    assert str(error.value) == expected


def test_top_k_zero_means_every_document() -> None:
    request = rerank_pb2.RerankRequest(query="q", documents=["a", "b", "c"])
    assert validate(request, LIMITS) == RerankJob("q", ("a", "b", "c"), 3)


def test_settings_read_their_prefixed_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENMESH_RERANKER_BATCH_MAX_WAIT_MS", "2.5")
    monkeypatch.setenv("TOKENMESH_RERANKER_MODEL_KIND", "cross_encoder")
    monkeypatch.setenv("TOKENMESH_WORKER_PORT", "7000")
    settings = RerankerSettings()
    assert (settings.port, settings.metrics_port) == (50071, 9471)
    assert settings.batch_max_wait_ms == 2.5 and settings.model_kind == "cross_encoder"
    assert settings.model == "" and settings.torch_threads == 1
