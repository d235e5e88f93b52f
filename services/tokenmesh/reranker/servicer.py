"""RerankService RPC handlers: validate, score through the batcher, rank."""

from __future__ import annotations

import time
from typing import Any

from grpc import aio

from tokenmesh.reranker.config import RerankerSettings
from tokenmesh.reranker.metrics import RerankMetrics
from tokenmesh.reranker.model import RerankerSlot, rank
from tokenmesh.reranker.requests import validate
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
        batcher = self._rerankers.get()
        # A caller that cancels or runs out of deadline cancels this await: its work is dropped
        # from the queue, or its result discarded if the model already has it.
        started = time.perf_counter()
        scores = await batcher.submit(job)
        self._metrics.latency.observe(time.perf_counter() - started)
        return rerank_pb2.RerankResponse(
            results=[
                rerank_pb2.RankedDocument(index=index, score=score)
                for index, score in rank(scores, job.top_k)
            ]
        )
