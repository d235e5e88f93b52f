"""The control plane's composition root: source, snapshot cache, xDS server, health, metrics."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import aiohttp
from envoy.service.discovery.v3 import ads_pb2, ads_pb2_grpc
from envoy.service.endpoint.v3 import eds_pb2, eds_pb2_grpc
from prometheus_client import CollectorRegistry

from tokenmesh.common.affinity import pin_threads
from tokenmesh.common.backoff import Backoff
from tokenmesh.common.consul_http import consul_client
from tokenmesh.common.interceptors import standard_interceptors
from tokenmesh.common.metrics import MetricsEndpoint
from tokenmesh.common.registration import ConsulRegistration, instance_for
from tokenmesh.common.server import (
    Health,
    bind,
    build_server,
    enable_reflection,
    wait_for_shutdown_signal,
)
from tokenmesh.controlplane.config import ControlPlaneSettings
from tokenmesh.controlplane.consul_source import ConsulSource
from tokenmesh.controlplane.dns_source import DnsSource
from tokenmesh.controlplane.endpoints import EndpointSource
from tokenmesh.controlplane.metrics import ControlPlaneMetrics
from tokenmesh.controlplane.ops import (
    Dashboard,
    FleetQueries,
    GrpcWorkerProbe,
    OpsServicer,
    PrometheusHttp,
)
from tokenmesh.controlplane.page import PageServer
from tokenmesh.controlplane.servicer import AggregatedDiscoveryServicer, EndpointDiscoveryServicer
from tokenmesh.controlplane.snapshots import SnapshotCache
from tokenmesh.controlplane.static_source import StaticFileSource
from tokenmesh.v1 import ops_pb2, ops_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAMES = (
    ads_pb2.DESCRIPTOR.services_by_name["AggregatedDiscoveryService"].full_name,
    eds_pb2.DESCRIPTOR.services_by_name["EndpointDiscoveryService"].full_name,
    ops_pb2.DESCRIPTOR.services_by_name["OpsService"].full_name,
)
# Consul answers a blocking query after wait plus up to wait/16 of jitter; a request gets
# that and this much more before it counts as failed.
CONSUL_TIMEOUT_MARGIN_SECONDS = 5.0


def build_source(
    settings: ControlPlaneSettings, metrics: ControlPlaneMetrics, consul: Any
) -> EndpointSource:
    if settings.source == "static":
        assert settings.static_file is not None  # checked by the settings
        return StaticFileSource(
            settings.static_file,
            settings.static_poll_seconds,
            on_error=metrics.source_errors.labels("static").inc,
        )
    if settings.source == "dns":
        return DnsSource(
            settings.dns_targets,
            settings.dns_poll_seconds,
            on_error=metrics.source_errors.labels("dns").inc,
        )
    return ConsulSource(
        consul,
        settings.consul_services,
        passing_only=settings.consul_passing_only,
        wait_seconds=settings.consul_wait_seconds,
        backoff=lambda: Backoff(
            settings.consul_backoff_initial_seconds, settings.consul_backoff_max_seconds
        ),
        on_error=metrics.source_errors.labels("consul").inc,
    )


async def feed(
    source: EndpointSource,
    cache: SnapshotCache,
    health: Health,
    registration: ConsulRegistration,
) -> None:
    """Copy the source's snapshots into the cache; SERVING (and registered) from the first."""
    serving = False
    async for snapshot in source.snapshots():
        cache.update(snapshot)
        if not serving:
            serving = True
            await health.set_serving()
            registration.start()
            log.info("control plane serving", extra={"clusters": sorted(snapshot)})


def worker_addresses(cache: SnapshotCache) -> list[str]:
    """The worker cluster's addresses in the current endpoint snapshot (none before it)."""
    current = cache.current
    return [str(endpoint) for endpoint in current.clusters.get("worker", ())] if current else []


async def serve(settings: ControlPlaneSettings) -> int:
    """Run until SIGTERM/SIGINT (exit 0); exit 1 if the endpoint source fails for good."""
    pin_threads(settings.cores)  # before any thread starts: they inherit it
    registry = CollectorRegistry()
    metrics = ControlPlaneMetrics(registry)
    cache = SnapshotCache(on_update=metrics.observe_snapshot)
    health = Health(SERVICE_NAMES)
    server = build_server(settings, standard_interceptors(registry))
    ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(
        AggregatedDiscoveryServicer(cache, metrics), server
    )
    eds_pb2_grpc.add_EndpointDiscoveryServiceServicer_to_server(
        EndpointDiscoveryServicer(cache, metrics), server
    )
    http = aiohttp.ClientSession()
    probe = GrpcWorkerProbe(settings.worker_probe_timeout_seconds, settings.max_message_bytes)
    dashboard = Dashboard(
        workers=lambda: worker_addresses(cache),
        probe=probe,
        prometheus=PrometheusHttp(
            http, settings.prometheus_url, settings.prometheus_timeout_seconds
        )
        if settings.prometheus_url
        else None,
        queries=FleetQueries(rate_window=settings.ops_rate_window),
        prometheus_url=settings.prometheus_url or "",
    )
    ops_pb2_grpc.add_OpsServiceServicer_to_server(OpsServicer(dashboard), server)
    health.register(server)
    enable_reflection(server, SERVICE_NAMES)
    port = bind(server, settings)
    await health.set_not_serving()
    await server.start()
    endpoint = MetricsEndpoint(registry, settings.metrics_host, settings.metrics_port)
    metrics_port = endpoint.start()
    page = PageServer(settings.ops_page_dir, settings.host, settings.ops_page_port)
    page_port = await page.start()
    consul = None
    if settings.source == "consul":
        assert settings.consul_http_addr is not None  # checked by the settings
        consul = consul_client(
            settings.consul_http_addr,
            settings.consul_wait_seconds * 17 / 16 + CONSUL_TIMEOUT_MARGIN_SECONDS,
        )
    registration = ConsulRegistration(
        settings.consul_http_addr if settings.register_self else None,
        instance_for(settings, "controlplane", port, metrics_port),
    )
    log.info(
        "control plane listening; loading endpoints",
        extra={
            "port": port,
            "metrics_port": metrics_port,
            "ops_page_port": page_port,
            "source": settings.source,
        },
    )

    stop = asyncio.Event()
    signals = asyncio.create_task(wait_for_shutdown_signal(stop))
    source = build_source(settings, metrics, consul)
    feeding = asyncio.create_task(feed(source, cache, health, registration))
    await asyncio.wait({signals, feeding}, return_when=asyncio.FIRST_COMPLETED)
    exit_code = 0
    if feeding.done():
        # Sources retry their backend forever: ending on their own means a bug.
        log.error("the endpoint source stopped", exc_info=feeding.exception())
        exit_code = 1
        signals.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await signals
    else:
        feeding.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await feeding

    log.info("control plane stopping")
    await health.set_not_serving()
    await registration.stop()
    # Ends every xDS stream now; Envoy keeps the endpoints it has and reconnects with backoff.
    cache.close()
    await server.stop(settings.grace_seconds)
    await page.stop()
    await probe.close()
    await http.close()
    if consul is not None:
        await consul.close()
    endpoint.stop()
    log.info("control plane stopped", extra={"exit_code": exit_code})
    return exit_code
