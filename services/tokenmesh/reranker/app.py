"""The reranker's composition root: the model, its batcher and servicer, on the service host."""

from __future__ import annotations

import asyncio

from tokenmesh.common.host import ServiceHost
from tokenmesh.reranker.batcher import MicroBatcher
from tokenmesh.reranker.config import RerankerSettings
from tokenmesh.reranker.metrics import RerankMetrics
from tokenmesh.reranker.model import RerankBatcher, RerankerSlot, ScoringModel, load_model
from tokenmesh.reranker.servicer import EmbeddingServicer, RerankServicer
from tokenmesh.v1 import rerank_pb2, rerank_pb2_grpc

SERVICE_NAMES = (
    rerank_pb2.DESCRIPTOR.services_by_name["RerankService"].full_name,
    rerank_pb2.DESCRIPTOR.services_by_name["EmbeddingService"].full_name,
)


def build_batcher(
    model: ScoringModel, settings: RerankerSettings, metrics: RerankMetrics
) -> RerankBatcher:
    return MicroBatcher(
        model.run,
        max_wait_seconds=settings.batch_max_wait_ms / 1000,
        max_size=settings.batch_max_texts,
        size=lambda job: job.text_count,
        on_batch=metrics.batch_size.observe,
    )


async def serve(settings: RerankerSettings) -> int:
    """Run the reranker until SIGTERM/SIGINT (exit 0), or exit 1 if the model cannot load."""
    host = ServiceHost("reranker", settings, SERVICE_NAMES)
    rerank_metrics = RerankMetrics(host.registry)
    slot = RerankerSlot()
    server = host.server()
    rerank_pb2_grpc.add_RerankServiceServicer_to_server(
        RerankServicer(slot, settings, rerank_metrics), server
    )
    rerank_pb2_grpc.add_EmbeddingServiceServicer_to_server(
        EmbeddingServicer(slot, settings, rerank_metrics), server
    )

    async def start() -> None:
        try:
            model = await asyncio.to_thread(load_model, settings)
        except Exception as error:
            raise RuntimeError("the model failed to load") from error
        batcher = build_batcher(model, settings, rerank_metrics)
        batcher.start()
        # Closed once the server has stopped: in-flight reranks get the grace period to
        # finish, with the batcher still running.
        host.on_stop(batcher.close)
        slot.set(batcher, model.info)

    return await host.run(start, {"model": settings.model or "default"})
