"""The reranker's composition root: builds the model, batcher, server, health and metrics."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from prometheus_client import CollectorRegistry

from tokenmesh.common.affinity import pin_threads
from tokenmesh.common.interceptors import standard_interceptors
from tokenmesh.common.metrics import MetricsEndpoint
from tokenmesh.common.registration import ConsulRegistration
from tokenmesh.common.server import (
    Health,
    ProbePort,
    bind,
    build_server,
    enable_reflection,
    wait_for_shutdown_signal,
)
from tokenmesh.common.tracing import Tracing
from tokenmesh.reranker.batcher import MicroBatcher
from tokenmesh.reranker.config import RerankerSettings
from tokenmesh.reranker.metrics import RerankMetrics
from tokenmesh.reranker.model import RerankBatcher, RerankerSlot, ScoringModel, load_model
from tokenmesh.reranker.servicer import RerankServicer
from tokenmesh.v1 import rerank_pb2, rerank_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAMES = (rerank_pb2.DESCRIPTOR.services_by_name["RerankService"].full_name,)


def build_batcher(
    model: ScoringModel, settings: RerankerSettings, metrics: RerankMetrics
) -> RerankBatcher:
    return MicroBatcher(
        model.score,
        max_wait_seconds=settings.batch_max_wait_ms / 1000,
        max_size=settings.batch_max_texts,
        size=lambda job: job.text_count,
        on_batch=metrics.batch_size.observe,
    )


async def serve(settings: RerankerSettings) -> int:
    """Run the reranker until SIGTERM/SIGINT (exit 0), or exit 1 if the model cannot load."""
    pin_threads(settings.cores)  # before any thread starts: they inherit it
    registry = CollectorRegistry()
    rerank_metrics = RerankMetrics(registry)
    tracing = Tracing("tokenmesh-reranker", settings.otlp_endpoint)
    slot = RerankerSlot()
    health = Health(SERVICE_NAMES)
    server = build_server(
        settings, standard_interceptors(registry, tracing.tracer if tracing.enabled else None)
    )
    rerank_pb2_grpc.add_RerankServiceServicer_to_server(
        RerankServicer(slot, settings, rerank_metrics), server
    )
    health.register(server)
    enable_reflection(server, SERVICE_NAMES)
    port = bind(server, settings)
    await health.set_not_serving()
    await server.start()
    probes = ProbePort(health, settings)
    await probes.start()  # no-op without a health port
    metrics = MetricsEndpoint(registry, settings.metrics_host, settings.metrics_port)
    metrics_port = metrics.start()
    log.info(
        "reranker listening; loading model",
        extra={"port": port, "metrics_port": metrics_port, "model": settings.model or "default"},
    )

    registration = ConsulRegistration.for_service(settings, "reranker", port, metrics_port)
    stop = asyncio.Event()
    signals = asyncio.create_task(wait_for_shutdown_signal(stop))
    loading = asyncio.create_task(asyncio.to_thread(load_model, settings))
    await asyncio.wait({signals, loading}, return_when=asyncio.FIRST_COMPLETED)
    batcher: RerankBatcher | None = None
    exit_code = 0
    if not loading.done():
        # Stopped while loading. The loading thread cannot be interrupted: the process exits
        # once it returns.
        loading.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loading
    elif loading.exception() is not None:
        log.error("the model failed to load", exc_info=loading.exception())
        exit_code = 1
        signals.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await signals
    else:
        batcher = build_batcher(loading.result(), settings, rerank_metrics)
        batcher.start()
        slot.set(batcher)
        await health.set_serving()
        registration.start()  # no-op without a Consul address
        log.info("reranker serving", extra={"port": port})
        await signals

    log.info("reranker stopping", extra={"grace_seconds": settings.grace_seconds})
    await health.set_not_serving()
    await registration.stop()
    # New RPCs are refused; in-flight reranks get the grace period to finish (the batcher
    # keeps running meanwhile), then are cancelled.
    await server.stop(settings.grace_seconds)
    await probes.stop()
    if batcher is not None:
        await batcher.close()
    await tracing.shutdown()
    metrics.stop()
    log.info("reranker stopped", extra={"exit_code": exit_code})
    return exit_code
