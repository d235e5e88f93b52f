"""The gateway's composition root: clients, breaker, pipeline, server, health and metrics."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from grpc import aio
from prometheus_client import CollectorRegistry

from tokenmesh.common.affinity import pin_threads
from tokenmesh.common.auth import AuthInterceptor, KeysFileError, KeyStore
from tokenmesh.common.channels import Dependency
from tokenmesh.common.client import standard_client_interceptors
from tokenmesh.common.interceptors import standard_interceptors
from tokenmesh.common.limits import LimitsInterceptor, TenantLimiter
from tokenmesh.common.metrics import MetricsEndpoint, StreamMetrics
from tokenmesh.common.registration import ConsulRegistration
from tokenmesh.common.server import (
    Health,
    ProbePort,
    bind,
    build_server,
    enable_reflection,
    wait_for_shutdown_signal,
)
from tokenmesh.common.tenants import TenantMetrics
from tokenmesh.common.tracing import Tracing
from tokenmesh.gateway.breaker import CircuitBreaker
from tokenmesh.gateway.config import GatewaySettings
from tokenmesh.gateway.extproc import PROCESS_METHOD, DirectMetrics, ExternalProcessor
from tokenmesh.gateway.pipeline import DocumentSelector, GatewayMetrics, Pipeline, WorkerClient
from tokenmesh.gateway.quota import QuotaMeter
from tokenmesh.gateway.servicer import LLMServicer
from tokenmesh.v1 import llm_pb2, llm_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAMES = (llm_pb2.DESCRIPTOR.services_by_name["LLMService"].full_name,)


@dataclass(frozen=True)
class Tenancy:
    """API keys and tenant limits, when a keys file is configured: the interceptors that
    authenticate and admit each RPC, and the meter charging token quotas."""

    store: KeyStore | None = None
    interceptors: tuple[aio.ServerInterceptor, ...] = ()
    meter: QuotaMeter | None = None

    @classmethod
    def build(cls, settings: GatewaySettings, registry: CollectorRegistry) -> Tenancy:
        if settings.keys_file is None:
            return cls()
        store = KeyStore(settings.keys_file)  # KeysFileError when missing or invalid
        metrics = TenantMetrics(registry, store.tenant_ids)
        limiter = TenantLimiter(settings.concurrency_retry_after_ms)
        interceptors = (
            # Envoy's external-processor calls carry no key: with quotas on, the processor
            # only hands each Generate back to the gateway's own (authenticated) handler.
            AuthInterceptor(store, (*settings.open_methods, PROCESS_METHOD), metrics),
            LimitsInterceptor(limiter, metrics),
        )
        return cls(store, interceptors, QuotaMeter(limiter, metrics))

    def start_watching(self, interval: float) -> asyncio.Task[None] | None:
        """Re-read the keys file when it changes, until the task is cancelled."""
        if self.store is None:
            return None
        return asyncio.get_running_loop().create_task(self.store.watch(interval))


async def serve(settings: GatewaySettings) -> int:
    """Run the gateway until SIGTERM/SIGINT. It is SERVING as soon as it listens: a missing
    worker fails calls with UNAVAILABLE, and a missing reranker only degrades answers."""
    pin_threads(settings.cores)  # before any thread starts: they inherit it
    registry = CollectorRegistry()
    try:
        tenancy = Tenancy.build(settings, registry)
    except KeysFileError as exc:
        log.error("gateway not started: %s", exc)
        return 1
    tracing = Tracing("tokenmesh-gateway", settings.otlp_endpoint)
    metrics = GatewayMetrics(registry)
    calls = standard_client_interceptors(registry, tracing)
    ca = settings.dependency_tls_ca_file
    tls = None if ca is None else grpc.ssl_channel_credentials(ca.read_bytes())
    worker = Dependency("worker", settings.worker_address, settings.max_message_bytes, calls, tls)
    reranker = Dependency(
        "reranker", settings.reranker_address, settings.max_message_bytes, calls, tls
    )
    breaker = CircuitBreaker(settings.breaker, on_transition=metrics.on_transition)
    pipeline = Pipeline(
        DocumentSelector(reranker, breaker, metrics, settings, tracing.tracer),
        WorkerClient(
            worker,
            settings.connect_timeout_seconds,
            settings.max_coalesced_tokens,
            settings.max_message_tokens,
        ),
        settings,
        tenancy.meter,
    )
    health = Health(SERVICE_NAMES)
    tracer = tracing.tracer if tracing.enabled else None
    server = build_server(settings, standard_interceptors(registry, tracer, tenancy.interceptors))
    stream_metrics = StreamMetrics(registry, log_tokens=settings.log_tokens)
    llm_pb2_grpc.add_LLMServiceServicer_to_server(
        LLMServicer(pipeline, settings, stream_metrics), server
    )
    # Used when Envoy's edge sends Generate's tokens straight from workers (the mesh's
    # direct_token_path); idle otherwise.
    ext_proc_grpc.add_ExternalProcessorServicer_to_server(
        ExternalProcessor(pipeline, settings, DirectMetrics(registry)), server
    )
    health.register(server)
    enable_reflection(server, SERVICE_NAMES)
    port = bind(server, settings)
    await server.start()
    probes = ProbePort(health, settings)
    await probes.start()  # no-op without a health port
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
            "keys_file": None if settings.keys_file is None else str(settings.keys_file),
        },
    )
    keys_watch = tenancy.start_watching(settings.keys_reload_seconds)
    await wait_for_shutdown_signal()
    if keys_watch is not None:
        keys_watch.cancel()
    log.info("gateway stopping", extra={"grace_seconds": settings.grace_seconds})
    await health.set_not_serving()
    await registration.stop()
    await server.stop(settings.grace_seconds)
    await probes.stop()
    await worker.close()
    await reranker.close()
    await tracing.shutdown()
    endpoint.stop()
    return 0
