"""The reranker's own metrics: rerank latency and requests per model call."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram

# One rerank, queue plus model: from 1 ms (a few short texts) to 10 s (a saturated batcher).
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
# Requests sharing one model call.
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class RerankMetrics:
    """Rerank latency and batch size, in the service's own registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.latency = Histogram(
            "tokenmesh_rerank_latency_seconds",
            "Time a rerank spent queued for and inside the model (answered requests only).",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.batch_size = Histogram(
            "tokenmesh_rerank_batch_size",
            "Requests (reranks and embeddings) served together by one model call (the count "
            "is the number of calls).",
            buckets=BATCH_SIZE_BUCKETS,
            registry=registry,
        )
