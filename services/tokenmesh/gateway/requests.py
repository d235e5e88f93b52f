"""Validation of public requests into GenerationJobs (transport-agnostic)."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmesh.common.errors import InvalidArgument
from tokenmesh.common.validation import (
    check_count,
    check_logprobs,
    check_range,
    check_stop,
    check_text,
)
from tokenmesh.gateway.config import GatewaySettings
from tokenmesh.v1 import inference_pb2, llm_pb2

MAX_TEMPERATURE = 2.0


@dataclass(frozen=True)
class GenerationJob:
    """A validated request: what to ask, which documents may give context, how to sample."""

    prompt: str
    documents: tuple[str, ...]
    top_k_documents: int
    sampling: inference_pb2.SamplingParams


def sampling_params(
    request: llm_pb2.GenerateRequest | llm_pb2.Query | llm_pb2.UserTurn | llm_pb2.DocumentChunk,
    settings: GatewaySettings,
) -> inference_pb2.SamplingParams:
    """Check the sampling fields every public request shares and build the worker's params."""
    if not 1 <= request.max_tokens <= settings.max_tokens_cap:
        raise InvalidArgument(
            "max_tokens", f"must be in [1, {settings.max_tokens_cap}], got {request.max_tokens}"
        )
    sampling = inference_pb2.SamplingParams(max_tokens=request.max_tokens)
    if request.HasField("temperature"):
        check_range("temperature", request.temperature, 0.0, MAX_TEMPERATURE)
        sampling.temperature = request.temperature
    if isinstance(request, llm_pb2.GenerateRequest | llm_pb2.Query):
        if request.HasField("top_p"):
            check_range("top_p", request.top_p, 0.0, 1.0, low_open=True)
            sampling.top_p = request.top_p
        if request.HasField("seed"):
            sampling.seed = request.seed
        check_stop(
            "stop", request.stop, settings.max_stop_sequences, settings.max_stop_sequence_bytes
        )
        sampling.stop.extend(request.stop)
    if isinstance(request, llm_pb2.GenerateRequest):
        check_logprobs("", request.logprobs, request.top_logprobs, settings.max_top_logprobs)
        sampling.logprobs = request.logprobs
        sampling.top_logprobs = request.top_logprobs
        if not 0 <= request.stream_interval <= settings.max_stream_interval:
            raise InvalidArgument(
                "stream_interval",
                f"must be in [0, {settings.max_stream_interval}], got {request.stream_interval}",
            )
        sampling.stream_interval = request.stream_interval
    if isinstance(request, llm_pb2.GenerateRequest | llm_pb2.Query | llm_pb2.UserTurn):
        sampling.ignore_eos = request.ignore_eos
    return sampling


def generation_job(
    request: llm_pb2.GenerateRequest | llm_pb2.Query, settings: GatewaySettings
) -> GenerationJob:
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
    return GenerationJob(
        prompt=request.prompt,
        documents=tuple(request.documents),
        top_k_documents=top_k,
        sampling=sampling,
    )
