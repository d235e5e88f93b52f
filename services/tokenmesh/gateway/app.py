"""The gateway's composition root: clients, breaker, pipeline, server, health and metrics."""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry

from tokenmesh.common.channels import Dependency
from tokenmesh.common.client import standard_client_interceptors
from tokenmesh.common.interceptors import standard_interceptors
from tokenmesh.common.metrics import MetricsEndpoint, StreamMetrics
from tokenmesh.common.registration import ConsulRegistration
from tokenmesh.common.server import (
    Health,
    bind,
    build_server,
    enable_reflection,
    wait_for_shutdown_signal,
)
from tokenmesh.common.tracing import Tracing
from tokenmesh.gateway.breaker import CircuitBreaker
from tokenmesh.gateway.config import GatewaySettings
from tokenmesh.gateway.pipeline import DocumentSelector, GatewayMetrics, Pipeline, WorkerClient
from tokenmesh.gateway.servicer import LLMServicer
from tokenmesh.v1 import llm_pb2, llm_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAMES = (llm_pb2.DESCRIPTOR.services_by_name["LLMService"].full_name,)


async def serve(settings: GatewaySettings) -> int:
    """Run the gateway until SIGTERM/SIGINT. It is SERVING as soon as it listens: a missing
    worker fails calls with UNAVAILABLE, and a missing reranker only degrades answers."""
    registry = CollectorRegistry()
    tracing = Tracing("tokenmesh-gateway", settings.otlp_endpoint)
    metrics = GatewayMetrics(registry)
    calls = standard_client_interceptors(registry, tracing)
    worker = Dependency("worker", settings.worker_address, settings.max_message_bytes, calls)
    reranker = Dependency("reranker", settings.reranker_address, settings.max_message_bytes, calls)
    breaker = CircuitBreaker(settings.breaker, on_transition=metrics.on_transition)
    pipeline = Pipeline(
        DocumentSelector(reranker, breaker, metrics, settings, tracing.tracer),
        WorkerClient(worker, settings.connect_timeout_seconds),
        settings,
    )
    health = Health(SERVICE_NAMES)
    tracer = tracing.tracer if tracing.enabled else None
    server = build_server(settings, standard_interceptors(registry, tracer))
    stream_metrics = StreamMetrics(registry, log_tokens=settings.log_tokens)
    llm_pb2_grpc.add_LLMServiceServicer_to_server(
        LLMServicer(pipeline, settings, stream_metrics), server
    )
    health.register(server)
    enable_reflection(server, SERVICE_NAMES)
    port = bind(server, settings)
    await server.start()
    endpoint = MetricsEndpoint(registry, settings.metrics_host, settings.metrics_port)
    metrics_port = endpoint.start()
    await health.set_serving()
    registration = ConsulRegistration.for_service(settings, "gateway", port, metrics_port)
    registration.start()  # no-op without a Consul address
    log.info(
        "gateway serving",
        extra={
            "port": port,
            "metrics_port": metrics_port,
            "worker": settings.worker_address,
            "reranker": settings.reranker_address,
            "otlp_endpoint": settings.otlp_endpoint,
        },
    )
    await wait_for_shutdown_signal()
    log.info("gateway stopping", extra={"grace_seconds": settings.grace_seconds})
    await health.set_not_serving()
    await registration.stop()
    await server.stop(settings.grace_seconds)
    await worker.close()
    await reranker.close()
    await tracing.shutdown()
    endpoint.stop()
    return 0
