"""Validation of the reranker's requests into model-ready jobs (transport-agnostic)."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmesh.common.errors import InvalidArgument, NotFound
from tokenmesh.common.validation import check_count, check_text
from tokenmesh.reranker.config import RerankerSettings
from tokenmesh.v1 import rerank_pb2


@dataclass(frozen=True)
class RerankJob:
    """A validated rerank request."""

    query: str
    documents: tuple[str, ...]
    # How many results to return; already resolved, so 0 ("all") is never stored here.
    top_k: int

    @property
    def text_count(self) -> int:
        """Texts the model reads for this job: the query and every document."""
        return 1 + len(self.documents)


@dataclass(frozen=True)
class EmbedJob:
    """A validated embedding request: its texts, in order."""

    texts: tuple[str, ...]

    @property
    def text_count(self) -> int:
        return len(self.texts)


# What the batcher takes: both kinds share one model call (model.py).
Job = RerankJob | EmbedJob


@dataclass(frozen=True)
class ModelInfo:
    """The loaded model as the OpenAI API names and describes it."""

    name: str
    # Length of its embeddings; 0: it gives none (a cross-encoder).
    dimensions: int
    # The most tokens it reads of one text, special tokens included.
    max_input_tokens: int


class ModelNotFound(NotFound):
    field = "model"


def validate(request: rerank_pb2.RerankRequest, settings: RerankerSettings) -> RerankJob:
    """Check every field against the reranker's limits; raise InvalidArgument naming it."""
    check_text("query", request.query, settings.max_query_bytes)
    count = len(request.documents)
    if count == 0:
        raise InvalidArgument("documents", "must not be empty (send 1 or more documents)")
    check_count("documents", count, settings.max_documents, "documents")
    for position, document in enumerate(request.documents):
        check_text(f"documents[{position}]", document, settings.max_document_bytes)
    if not 0 <= request.top_k <= count:
        raise InvalidArgument(
            "top_k", f"must be in [0, {count}] (0 = all documents), got {request.top_k}"
        )
    return RerankJob(
        query=request.query,
        documents=tuple(request.documents),
        top_k=request.top_k or count,
    )


def check_model(requested: str, model: ModelInfo) -> None:
    if requested != model.name:
        raise ModelNotFound(
            f"the model {requested!r} does not exist; this reranker serves {model.name!r}"
        )


def validate_rank(
    request: rerank_pb2.RankRequest, settings: RerankerSettings, model: ModelInfo
) -> RerankJob:
    """A Rank request as the RerankJob RerankService would make of it: the same limits and
    messages; top_n 0, or more than the documents, means all of them (vLLM's rule)."""
    check_model(request.model, model)
    if request.top_n < 0:
        raise InvalidArgument("top_n", f"must be 0 (all documents) or more, got {request.top_n}")
    top_k = min(request.top_n, len(request.documents))
    rerank = rerank_pb2.RerankRequest(query=request.query, documents=request.documents, top_k=top_k)
    return validate(rerank, settings)


def validate_embed(
    request: rerank_pb2.EmbedRequest, settings: RerankerSettings, model: ModelInfo
) -> EmbedJob:
    """Check the model, dimensions and every input against the limits (the token limit is
    checked with the model's tokenizer, in the model call); raise naming the field."""
    check_model(request.model, model)
    if not model.dimensions:
        raise InvalidArgument("model", f"{model.name!r} ranks documents and gives no embeddings")
    if request.dimensions not in (0, model.dimensions):
        raise InvalidArgument(
            "dimensions",
            f"{model.name!r} gives embeddings of {model.dimensions} dimensions only, "
            f"got {request.dimensions}",
        )
    count = len(request.input)
    if count == 0:
        raise InvalidArgument("input", "must not be empty (send 1 or more texts)")
    check_count("input", count, settings.max_embedding_inputs, "texts")
    for position, text in enumerate(request.input):
        check_text(f"input[{position}]", text, settings.max_input_bytes)
    return EmbedJob(tuple(request.input))
