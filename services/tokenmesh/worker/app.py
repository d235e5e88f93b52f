"""The worker's composition root: builds the engine, server, health and metrics, runs, stops."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge
from prometheus_client.registry import Collector

from tokenmesh.common.affinity import pin_threads
from tokenmesh.common.auth import TenantMetadataInterceptor
from tokenmesh.common.interceptors import standard_interceptors
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
from tokenmesh.common.tracing import Tracing
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc
from tokenmesh.worker.config import WorkerSettings
from tokenmesh.worker.engine import EngineLoad, EngineSlot, VllmEngine
from tokenmesh.worker.servicer import InferenceServicer

log = logging.getLogger(__name__)

SERVICE_NAMES = (inference_pb2.DESCRIPTOR.services_by_name["InferenceService"].full_name,)


class VllmMetricsCollector(Collector):
    """Re-exports vLLM's own metrics (vllm:*), which vLLM registers in the global registry."""

    def collect(self):  # type: ignore[no-untyped-def]
        for family in REGISTRY.collect():
            if family.name.startswith("vllm:"):
                yield family


def register_engine_gauges(registry: CollectorRegistry, load: EngineLoad) -> None:
    """Gauges read from the scheduler's latest report at scrape time."""
    Gauge(
        "tokenmesh_worker_running_requests",
        "Requests in the engine's running batch (vLLM scheduler).",
        registry=registry,
    ).set_function(lambda: load.running)
    Gauge(
        "tokenmesh_worker_waiting_requests",
        "Requests waiting in the engine's queue (vLLM scheduler).",
        registry=registry,
    ).set_function(lambda: load.waiting)
    Gauge(
        "tokenmesh_worker_kv_cache_usage_ratio",
        "Fraction of the KV cache in use, 0..1 (vLLM scheduler).",
        registry=registry,
    ).set_function(lambda: load.kv_cache_usage)


def aborted_counter(registry: CollectorRegistry) -> Counter:
    return Counter(
        "tokenmesh_worker_aborted_requests",
        "Engine requests aborted because the caller cancelled or its deadline passed.",
        ["reason"],
        registry=registry,
    )


async def watch_engine(engine: VllmEngine, interval: float, stop: asyncio.Event) -> None:
    """Stop the worker when the engine process dies, so its supervisor restarts it."""
    # vLLM exposes no event for engine death, only the errored flag, so it is polled.
    while not engine.errored:  # noqa: ASYNC110
        await asyncio.sleep(interval)
    log.error("inference engine died; shutting the worker down")
    stop.set()


async def serve(settings: WorkerSettings) -> int:
    """Run the worker until SIGTERM/SIGINT (exit 0) or until its engine dies (exit 1)."""
    registry = CollectorRegistry()
    registry.register(VllmMetricsCollector())
    tracing = Tracing("tokenmesh-worker", settings.otlp_endpoint)
    tracer = tracing.tracer if tracing.enabled else None
    # With tracing on, each stream's queue_prefill and decode spans too.
    stream_metrics = StreamMetrics(registry, tracer, log_tokens=settings.log_tokens)
    slot = EngineSlot()
    health = Health(SERVICE_NAMES)
    # The tenant the gateway named (x-tenant-id) goes on each RPC's log line and span.
    interceptors = standard_interceptors(registry, tracer, (TenantMetadataInterceptor(),))
    server = build_server(settings, interceptors)
    inference_pb2_grpc.add_InferenceServiceServicer_to_server(
        InferenceServicer(slot, settings, stream_metrics, aborted_counter(registry)), server
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
        "worker listening; loading model",
        extra={"port": port, "metrics_port": metrics_port, "model": settings.model},
    )

    registration = ConsulRegistration.for_service(
        settings, "worker", port, metrics_port, extra={"model": settings.model_name}
    )
    stop = asyncio.Event()
    signals = asyncio.create_task(wait_for_shutdown_signal(stop))
    loading = asyncio.create_task(VllmEngine.start(settings))
    await asyncio.wait({signals, loading}, return_when=asyncio.FIRST_COMPLETED)
    engine: VllmEngine | None = None
    watchdog: asyncio.Task[None] | None = None
    exit_code = 0
    if loading.done():
        engine = loading.result()
        # Now, not before: the engine's processes were started with every core (they bind
        # their own, cpu_threads_bind); the front end's threads leave those to them.
        pin_threads(settings.cores)
        slot.set(engine)
        register_engine_gauges(registry, engine.load)
        watchdog = asyncio.create_task(
            watch_engine(engine, settings.engine_check_interval_seconds, stop)
        )
        await health.set_serving()
        registration.start()  # no-op without a Consul address
        log.info("worker serving", extra={"port": port, "model": engine.model_name})
        await signals
        exit_code = 1 if engine.errored else 0
    else:
        loading.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loading

    log.info("worker stopping", extra={"grace_seconds": settings.grace_seconds})
    await health.set_not_serving()
    await registration.stop()
    # New RPCs are refused; in-flight streams get the grace period, then are cancelled, which
    # aborts their engine requests.
    await server.stop(settings.grace_seconds)
    await probes.stop()
    if watchdog is not None:
        watchdog.cancel()
    if engine is not None:
        await asyncio.to_thread(engine.close)
    await tracing.shutdown()
    metrics.stop()
    log.info("worker stopped", extra={"exit_code": exit_code})
    return exit_code
