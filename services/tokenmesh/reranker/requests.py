"""Validation of RerankRequest into a model-ready RerankJob (transport-agnostic)."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmesh.common.errors import InvalidArgument
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
