"""The worker's composition root: the engine, its servicer and metrics, on the service host."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge
from prometheus_client.registry import Collector
from vllm.engine.arg_utils import AsyncEngineArgs

from tokenmesh.common.channels import Dependency
from tokenmesh.common.cpu_pinning import pin_threads
from tokenmesh.common.credentials import ReloadingChannelCredentials
from tokenmesh.common.host import ServiceHost
from tokenmesh.common.metrics import StreamMetrics
from tokenmesh.common.pools import pool_cluster
from tokenmesh.common.relay import Relay, ResumptionMetrics
from tokenmesh.v1 import admin_pb2_grpc, inference_pb2, inference_pb2_grpc
from tokenmesh.worker.adapters import AdapterMetrics
from tokenmesh.worker.admin import WorkerAdminServicer
from tokenmesh.worker.admission import Admission
from tokenmesh.worker.config import WorkerSettings
from tokenmesh.worker.engine import EngineSlot, VllmEngine
from tokenmesh.worker.engine_state import EngineLoad, EngineShare
from tokenmesh.worker.handover import Handover
from tokenmesh.worker.pacing import StreamPacing
from tokenmesh.worker.placement import place_engine
from tokenmesh.worker.servicer import InferenceServicer
from tokenmesh.worker.tenant import TenantMetadataInterceptor
from tokenmesh.worker.watchdog import EngineActivity, StallWatchdog

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


def register_stall_gauges(
    registry: CollectorRegistry, activity: EngineActivity, watchdog: StallWatchdog
) -> None:
    """Gauges of the stall watchdog, read at scrape time."""
    Gauge(
        "tokenmesh_worker_engine_stalled",
        "1 while the engine holds requests and has made no step for engine_stall_seconds (the "
        "worker is NOT_SERVING), else 0.",
        registry=registry,
    ).set_function(lambda: float(watchdog.stalled))
    Gauge(
        "tokenmesh_worker_engine_step_age_seconds",
        "Seconds since the engine's last step (or since work reached it idle) while it holds "
        "requests; 0 while it holds none.",
        registry=registry,
    ).set_function(activity.stalled_seconds)


def register_pacing_gauges(registry: CollectorRegistry, pacing: StreamPacing) -> None:
    """Gauges of the streams' pacing (decision 0039), read at scrape time."""
    Gauge(
        "tokenmesh_worker_stream_hold_seconds",
        "How long each stream's later tokens now gather into one message (0: every engine "
        "output goes at once; more while the server loop is behind).",
        registry=registry,
    ).set_function(lambda: pacing.hold_at(time.monotonic()))
    Gauge(
        "tokenmesh_worker_loop_lag_seconds",
        "The server loop's mean lag in taking the engine's outputs over the last 50 ms while "
        "the engine made them.",
        registry=registry,
    ).set_function(lambda: pacing.lag_at(time.monotonic()))


def aborted_counter(registry: CollectorRegistry) -> Counter:
    return Counter(
        "tokenmesh_worker_aborted_requests",
        "Engine requests aborted because the caller cancelled or its deadline passed.",
        ["reason"],
        registry=registry,
    )


def features_counter(registry: CollectorRegistry) -> Counter:
    return Counter(
        "tokenmesh_worker_request_features",
        "Requests the worker took that use an engine feature beyond plain sampling, by feature "
        "(structured_outputs_json, _json_object, _regex, _choice, _grammar; tools_auto, "
        "_required, _named, _none).",
        ["feature"],
        registry=registry,
    )


async def watch_engine(
    engine: VllmEngine,
    watchdog: StallWatchdog,
    interval: float,
    handover: Handover,
    set_healthy: Callable[[bool], Awaitable[None]],
    drain_seconds: float,
    handover_seconds: float,
) -> None:
    """Every interval, check the engine moves (the watchdog turns the worker NOT_SERVING while
    it is hung); when the engine process dies, turn NOT_SERVING at once, let the streams it
    hands over to other workers finish (handover.py; those Envoy sends until it sees
    NOT_SERVING too, for drain_seconds; at most handover_seconds), then return:
    the worker stops (exit 1) and its supervisor restarts it with a new engine."""
    # vLLM exposes no event for engine death, only the errored flag, so it is polled.
    while not engine.errored:
        await watchdog.check()
        await asyncio.sleep(interval)
    log.error("inference engine died; handing its streams over, then shutting the worker down")
    await set_healthy(False)
    # Streams Envoy sends until it sees NOT_SERVING are handed over too.
    await asyncio.sleep(drain_seconds)
    if not await handover.streams_ended(handover_seconds):
        log.error("streams still open %g s after the engine died", handover_seconds)


def handover_relay(settings: WorkerSettings, registry: CollectorRegistry) -> Relay | None:
    """The relay a worker hands its streams over through, if it has an address to reach the
    other workers at."""
    if not settings.handover_address:
        return None
    tls = None
    if settings.handover_tls_ca_file is not None:
        tls = ReloadingChannelCredentials(settings.handover_tls_ca_file)
    peers = Dependency("worker", settings.handover_address, settings.max_message_bytes, (), tls)
    return Relay(
        inference_pb2_grpc.InferenceServiceStub(peers.channel),
        settings.max_resumptions,
        peers.error,
        ResumptionMetrics(registry, "worker"),
    )


async def serve(
    settings: WorkerSettings, arguments: AsyncEngineArgs, share: EngineShare | None = None
) -> int:
    """Run the worker until SIGTERM/SIGINT (exit 0) or until its engine dies (exit 1);
    arguments: the engine's (worker/engine_args.py). share: this process is front end
    share.index of several over one engine (worker/frontends.py): it serves the shared port,
    its metrics on a port of its own that the supervisor gathers, and leaves the engine's
    processes, their placement, its gauges and the Consul registration to the supervisor."""
    if share is not None:
        settings = settings.model_copy(update={"metrics_host": "127.0.0.1", "metrics_port": 0})
    # The engine's processes start with every core (vLLM binds its runner's, cpu_threads_bind);
    # once it has started, its engine core is placed (engine_affinity) and the front end's
    # threads are pinned to the worker's own cores.
    host = ServiceHost(
        "worker",
        settings,
        SERVICE_NAMES,
        pin_now=False,
        register=share is None,
        consul_meta={
            "model": settings.model_name,
            **({"pool": settings.pool} if settings.pool else {}),
        },
        reuse_port=share is not None,
        # Its pool's cluster: discovery places it in the pool.
        cluster=pool_cluster(settings.pool),
    )
    host.add_collector(VllmMetricsCollector())
    # With tracing on, each stream's queue_prefill and decode spans too.
    stream_metrics = StreamMetrics(
        host.registry, host.tracer, log_tokens=settings.log_tokens, by_model=True
    )
    slot = EngineSlot()
    handover = Handover(handover_relay(settings, host.registry))
    # The tenant the gateway named (x-tenant-id) goes on each RPC's log line and span.
    server = host.server((TenantMetadataInterceptor(),))
    inference_pb2_grpc.add_InferenceServiceServicer_to_server(
        InferenceServicer(
            slot,
            settings,
            stream_metrics,
            aborted_counter(host.registry),
            features_counter(host.registry),
            Admission(settings.max_waiting_requests, share.admitted if share is not None else None),
            handover,
        ),
        server,
    )
    admin_pb2_grpc.add_WorkerAdminServicer_to_server(WorkerAdminServicer(slot, settings), server)

    async def start() -> None:
        if share is not None:
            share.metrics_ports[share.index] = host.ports["metrics_port"]
        engine = await VllmEngine.start(
            settings, arguments, share, AdapterMetrics.register(host.registry)
        )
        # Closed once the server has stopped: in-flight streams get the grace period, then are
        # cancelled, which aborts their engine requests.
        host.on_stop(lambda: asyncio.to_thread(engine.close))
        if share is None:
            place_engine(settings.engine_affinity)
            register_engine_gauges(host.registry, engine.load)
        pin_threads(settings.cores)
        slot.set(engine)
        watchdog = StallWatchdog(engine.activity, settings.engine_stall_seconds, host.set_healthy)
        register_stall_gauges(host.registry, engine.activity, watchdog)
        register_pacing_gauges(host.registry, engine.pacing)
        host.keep_running(
            watch_engine(
                engine,
                watchdog,
                settings.engine_check_interval_seconds,
                handover,
                host.set_healthy,
                settings.drain_seconds,
                settings.handover_seconds,
            ),
            "engine-watch",
        )

    fields = {"model": settings.model}
    if share is not None:
        fields["frontend"] = str(share.index)
    return await host.run(start, fields)
