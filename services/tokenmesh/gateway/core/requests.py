"""Validation of public requests: their questions and sampling, against the gateway's limits."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmesh.common.errors import InvalidArgument
from tokenmesh.common.sampling import check_sampling, copy_sampling
from tokenmesh.common.validation import check_count, check_text
from tokenmesh.gateway.config import GatewaySettings
from tokenmesh.v1 import inference_pb2, llm_pb2


@dataclass(frozen=True)
class Question:
    """A validated question: what to ask, which documents may give context, how to sample."""

    prompt: str
    documents: tuple[str, ...]
    top_k_documents: int
    sampling: inference_pb2.SamplingParams
    # The model or adapter it names (empty: the mesh's model), checked as it is prepared.
    model: str = ""


def sampling_params(
    request: llm_pb2.GenerateRequest | llm_pb2.Query | llm_pb2.UserTurn | llm_pb2.DocumentChunk,
    settings: GatewaySettings,
) -> inference_pb2.SamplingParams:
    """The worker's sampling params from the fields a public request has (named as the
    worker's), checked against the gateway's limits (common/sampling.py, as the worker checks
    them)."""
    sampling = inference_pb2.SamplingParams()
    copy_sampling(request, sampling)
    check_sampling(sampling, settings)
    return sampling


def question(
    request: llm_pb2.GenerateRequest | llm_pb2.Query, settings: GatewaySettings
) -> Question:
    check_text("prompt", request.prompt, settings.max_prompt_bytes)
    sampling = sampling_params(request, settings)
    check_count("documents", len(request.documents), settings.max_documents, "documents")
    for position, document in enumerate(request.documents):
        check_text(f"documents[{position}]", document, settings.max_document_bytes)
    top_k = request.top_k_documents or settings.default_top_k_documents
    if not 0 < top_k <= settings.max_top_k_documents:
        raise InvalidArgument(
            "top_k_documents",
            f"must be in [0, {settings.max_top_k_documents}] (0 = default "
            f"{settings.default_top_k_documents}), got {request.top_k_documents}",
        )
    return Question(
        prompt=request.prompt,
        documents=tuple(request.documents),
        top_k_documents=top_k,
        sampling=sampling,
        model=request.model,
    )
