"""RerankService and EmbeddingService RPC handlers: validate, run through the batcher, answer."""

from __future__ import annotations

import time
from typing import Any

from grpc import aio

from tokenmesh.common.errors import Internal
from tokenmesh.reranker.config import RerankerSettings
from tokenmesh.reranker.metrics import RerankMetrics
from tokenmesh.reranker.model import Embedded, RerankerSlot, Result, Scored, rank
from tokenmesh.reranker.requests import Job, validate, validate_embed, validate_rank
from tokenmesh.v1 import rerank_pb2, rerank_pb2_grpc


class RerankServicer(rerank_pb2_grpc.RerankServiceServicer):
    def __init__(
        self, rerankers: RerankerSlot, settings: RerankerSettings, metrics: RerankMetrics
    ) -> None:
        self._rerankers = rerankers
        self._settings = settings
        self._metrics = metrics

    async def Rerank(
        self,
        request: rerank_pb2.RerankRequest,
        context: aio.ServicerContext[Any, Any],
    ) -> rerank_pb2.RerankResponse:
        job = validate(request, self._settings)
        scored = await scored_by(self._rerankers, job, self._metrics)
        return rerank_pb2.RerankResponse(
            results=[
                rerank_pb2.RankedDocument(index=index, score=score)
                for index, score in rank(scored.scores, job.top_k)
            ]
        )


class EmbeddingServicer(rerank_pb2_grpc.EmbeddingServiceServicer):
    """The model on OpenAI's API (the gateways' /v1/embeddings and /v1/rerank): the same
    batcher and model as RerankService."""

    def __init__(
        self, rerankers: RerankerSlot, settings: RerankerSettings, metrics: RerankMetrics
    ) -> None:
        self._rerankers = rerankers
        self._settings = settings
        self._metrics = metrics

    async def Describe(
        self, request: rerank_pb2.DescribeRequest, context: aio.ServicerContext[Any, Any]
    ) -> rerank_pb2.ModelDescription:
        info = self._rerankers.info()
        return rerank_pb2.ModelDescription(
            model=info.name, dimensions=info.dimensions, max_input_tokens=info.max_input_tokens
        )

    async def Embed(
        self, request: rerank_pb2.EmbedRequest, context: aio.ServicerContext[Any, Any]
    ) -> rerank_pb2.EmbedResponse:
        info = self._rerankers.info()
        job = validate_embed(request, self._settings, info)
        embedded = await self._rerankers.get().submit(job)
        if not isinstance(embedded, Embedded):
            raise Internal(f"reranker: an embedding job got {type(embedded).__name__}")
        return rerank_pb2.EmbedResponse(
            model=info.name,
            data=[rerank_pb2.Embedding(values=row) for row in embedded.vectors.tolist()],
            prompt_tokens=embedded.tokens,
        )

    async def Rank(
        self, request: rerank_pb2.RankRequest, context: aio.ServicerContext[Any, Any]
    ) -> rerank_pb2.RankResponse:
        info = self._rerankers.info()
        job = validate_rank(request, self._settings, info)
        scored = await scored_by(self._rerankers, job, self._metrics)
        return rerank_pb2.RankResponse(
            model=info.name,
            results=[
                rerank_pb2.RankedDocument(index=index, score=score)
                for index, score in rank(scored.scores, job.top_k)
            ],
            total_tokens=scored.tokens,
        )


async def scored_by(rerankers: RerankerSlot, job: Job, metrics: RerankMetrics) -> Scored:
    """A rerank job's scores from the batcher, timed. A caller that cancels or runs out of
    deadline cancels this await: its work is dropped from the queue, or its result discarded
    if the model already has it."""
    batcher = rerankers.get()
    started = time.perf_counter()
    result: Result = await batcher.submit(job)
    metrics.latency.observe(time.perf_counter() - started)
    if not isinstance(result, Scored):
        raise Internal(f"reranker: a rerank job got {type(result).__name__}")
    return result
