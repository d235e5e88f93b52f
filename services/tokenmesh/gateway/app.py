"""The gateway's composition root: clients, breaker, pipeline and servicers, on the service host."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from envoy.service.accesslog.v3 import als_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from grpc import aio
from prometheus_client import CollectorRegistry

from tokenmesh.common.backoff import Backoff
from tokenmesh.common.channels import Dependency
from tokenmesh.common.credentials import ReloadingChannelCredentials
from tokenmesh.common.host import ServiceHost
from tokenmesh.common.metrics import StreamMetrics
from tokenmesh.common.relay import ResumptionMetrics
from tokenmesh.gateway.client_interceptors import standard_client_interceptors
from tokenmesh.gateway.config import GatewaySettings
from tokenmesh.gateway.core.breaker import CircuitBreaker
from tokenmesh.gateway.core.catalog import ModelCatalog
from tokenmesh.gateway.core.documents import DocumentMetrics, DocumentSelector
from tokenmesh.gateway.core.picker import EndpointPicker, PickerMetrics, WorkerFeed
from tokenmesh.gateway.core.pipeline import Pipeline
from tokenmesh.gateway.core.prepare import Preparer
from tokenmesh.gateway.core.tenancy.auth import AuthInterceptor, KeysFileError, KeyStore
from tokenmesh.gateway.core.tenancy.http import HttpTenancy
from tokenmesh.gateway.core.tenancy.limits import LimitsInterceptor, TenantLimiter
from tokenmesh.gateway.core.tenancy.metrics import TenantMetrics
from tokenmesh.gateway.core.tenancy.quota import QuotaMeter
from tokenmesh.gateway.core.workers import WorkerClient
from tokenmesh.gateway.frontends.calls import CallMetrics
from tokenmesh.gateway.frontends.direct_log import DirectStreamLog
from tokenmesh.gateway.frontends.extproc import PROCESS_METHOD, DirectMetrics, ExternalProcessor
from tokenmesh.gateway.frontends.grpc import LLMServicer
from tokenmesh.gateway.frontends.openai.api import OpenAIApi
from tokenmesh.gateway.frontends.openai.http import HttpMetrics, HttpServer
from tokenmesh.gateway.frontends.openai.pooling import EmbeddingClient, PoolingApi
from tokenmesh.gateway.frontends.openai.prepare import OpenAIPreparer
from tokenmesh.gateway.frontends.openai.tokenize import TokenizeApi
from tokenmesh.v1 import llm_pb2, llm_pb2_grpc

log = logging.getLogger(__name__)

# Between attempts to subscribe to the control plane's worker feed again.
FEED_BACKOFF_SECONDS = 0.5
FEED_BACKOFF_MAX_SECONDS = 10.0
SERVICE_NAMES = (llm_pb2.DESCRIPTOR.services_by_name["LLMService"].full_name,)


@dataclass(frozen=True)
class Tenancy:
    """API keys and tenant limits, when a keys file is configured: the interceptors that
    authenticate and admit each RPC, and the meter charging token quotas."""

    store: KeyStore | None = None
    interceptors: tuple[aio.ServerInterceptor, ...] = ()
    meter: QuotaMeter | None = None
    # The same checks for the OpenAI HTTP API.
    http: HttpTenancy = field(default_factory=HttpTenancy)

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
        return cls(
            store, interceptors, QuotaMeter(limiter, metrics), HttpTenancy(store, limiter, metrics)
        )


async def serve(settings: GatewaySettings) -> int:
    """Run the gateway until SIGTERM/SIGINT. It is SERVING as soon as it listens: a missing
    worker fails calls with UNAVAILABLE, and a missing reranker only degrades answers."""
    host = ServiceHost("gateway", settings, SERVICE_NAMES)
    try:
        tenancy = Tenancy.build(settings, host.registry)
    except KeysFileError as exc:
        log.error("gateway not started: %s", exc)
        return 1
    metrics = DocumentMetrics(host.registry)
    calls = standard_client_interceptors(host.registry, host.tracing)
    ca = settings.dependency_tls_ca_file
    # Read again when the CA file changes: each dependency then opens a new channel.
    worker_tls = None if ca is None else ReloadingChannelCredentials(ca)
    reranker_tls = None if ca is None else ReloadingChannelCredentials(ca)
    worker = Dependency(
        "worker", settings.worker_address, settings.max_message_bytes, calls, worker_tls
    )
    reranker = Dependency(
        "reranker", settings.reranker_address, settings.max_message_bytes, calls, reranker_tls
    )
    host.on_stop(worker.close)
    host.on_stop(reranker.close)
    if ca is not None:
        host.keep_running(worker.watch_tls(), "worker-tls-watch")
        host.keep_running(reranker.watch_tls(), "reranker-tls-watch")
    breaker = CircuitBreaker(settings.breaker, on_transition=metrics.on_transition)
    picker = None
    if settings.picker.feed_address is not None:
        picker = EndpointPicker(settings.picker, PickerMetrics(host.registry))
        feed = Dependency("controlplane", settings.picker.feed_address, settings.max_message_bytes)
        host.on_stop(feed.close)
        host.keep_running(
            WorkerFeed(
                feed.channel,
                picker,
                settings.picker.feed_interval_ms,
                Backoff(FEED_BACKOFF_SECONDS, FEED_BACKOFF_MAX_SECONDS),
            ).run(),
            "worker-feed",
        )
    # The model and adapters the workers serve, as requests name them.
    catalog = ModelCatalog(
        worker,
        settings.connect_timeout_seconds,
        settings.worker_pools,
        settings.max_model_name_bytes,
    )
    preparer = Preparer(
        DocumentSelector(reranker, breaker, metrics, settings, host.tracing.tracer),
        settings,
        catalog,
        picker,
    )
    pipeline = Pipeline(
        WorkerClient(
            worker,
            settings.connect_timeout_seconds,
            settings.max_coalesced_tokens,
            settings.max_message_tokens,
            settings.max_resumptions,
            ResumptionMetrics(host.registry, "gateway"),
        ),
        settings,
        tenancy.meter,
    )
    call_metrics = CallMetrics(host.registry)
    server = host.server(tenancy.interceptors, call_metrics.ends)
    stream_metrics = StreamMetrics(host.registry, log_tokens=settings.log_tokens)
    http_metrics = HttpMetrics(host.registry)
    llm_pb2_grpc.add_LLMServiceServicer_to_server(
        LLMServicer(preparer, pipeline, settings, stream_metrics), server
    )
    direct_metrics = DirectMetrics(host.registry)
    als_pb2_grpc.add_AccessLogServiceServicer_to_server(
        DirectStreamLog(
            stream_metrics, call_metrics, host.tracer, http_metrics, direct_metrics.logged
        ),
        server,
    )
    if tenancy.store is not None:
        host.keep_running(tenancy.store.watch(settings.keys_reload_seconds), "keys-watch")
    start = None
    openai = None
    if settings.openai_port >= 0:
        openai = OpenAIPreparer(preparer, catalog, settings)
        # /v1/embeddings and /v1/rerank: the reranker's model, called as HTTP requests are
        # timed (no caller deadline); its description for /v1/models within a rerank's time.
        pooling = PoolingApi(
            EmbeddingClient(
                reranker,
                settings.http_request_timeout_seconds,
                settings.reranker_timeout_seconds,
            ),
            tenancy.http,
        )
        api = OpenAIApi(
            openai,
            pipeline,
            settings,
            stream_metrics,
            catalog,
            tenancy.http,
            host.tracing.tracer,
            http_metrics,
            lambda: host.health.serving,
            pooling,
            # /tokenize and /detokenize: a worker's tokenizer, timed as HTTP requests are.
            TokenizeApi(
                worker, catalog, tenancy.http, settings, settings.http_request_timeout_seconds
            ),
        )
        http = HttpServer(
            api.app(),
            settings.host,
            settings.openai_port,
            settings.grace_seconds,
            settings.tls_cert_file,
            settings.tls_key_file,
            settings.tls_client_ca_file,
        )

        async def start() -> None:
            host.ports["openai_port"] = await http.start()
            log.info(
                "gateway OpenAI API listening", extra={"openai_port": host.ports["openai_port"]}
            )
            host.before_server_stop(http.stop)

    # Used when Envoy's edge sends Generate's and OpenAI completions' tokens straight from
    # workers (the mesh's direct_token_path); idle otherwise.
    ext_proc_grpc.add_ExternalProcessorServicer_to_server(
        ExternalProcessor(
            preparer, settings, direct_metrics, host.tracer, openai, pipeline.metered
        ),
        server,
    )
    return await host.run(
        start,
        log_fields={
            "worker": settings.worker_address,
            "reranker": settings.reranker_address,
            "otlp_endpoint": settings.otlp_endpoint,
            "keys_file": None if settings.keys_file is None else str(settings.keys_file),
        },
    )
