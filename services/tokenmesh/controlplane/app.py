"""The control plane's composition root: source, snapshot cache, xDS, ops; on the service host."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp
from envoy.service.discovery.v3 import ads_pb2, ads_pb2_grpc
from envoy.service.endpoint.v3 import eds_pb2, eds_pb2_grpc

from tokenmesh.common.backoff import Backoff
from tokenmesh.common.consul_http import consul_client
from tokenmesh.common.credentials import ReloadingChannelCredentials
from tokenmesh.common.host import ServiceHost
from tokenmesh.controlplane.admin import AdapterAdminServicer, AdapterFleet, AdminKeys
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
from tokenmesh.controlplane.snapshots import SnapshotCache, worker_addresses
from tokenmesh.controlplane.static_source import StaticFileSource
from tokenmesh.v1 import admin_pb2, admin_pb2_grpc, ops_pb2, ops_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAMES = (
    ads_pb2.DESCRIPTOR.services_by_name["AggregatedDiscoveryService"].full_name,
    eds_pb2.DESCRIPTOR.services_by_name["EndpointDiscoveryService"].full_name,
    ops_pb2.DESCRIPTOR.services_by_name["OpsService"].full_name,
    admin_pb2.DESCRIPTOR.services_by_name["AdapterAdmin"].full_name,
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


async def feed(source: EndpointSource, cache: SnapshotCache, first: asyncio.Event) -> None:
    """Copy the source's snapshots into the cache; set `first` with the first."""
    async for snapshot in source.snapshots():
        cache.update(snapshot)
        if not first.is_set():
            first.set()
            log.info("first endpoint snapshot", extra={"clusters": sorted(snapshot)})


async def serve(settings: ControlPlaneSettings) -> int:
    """Run until SIGTERM/SIGINT (exit 0); exit 1 if the endpoint source fails for good. SERVING
    (and registered, with register_self) from the first endpoint snapshot."""
    host = ServiceHost("controlplane", settings, SERVICE_NAMES, register=settings.register_self)
    metrics = ControlPlaneMetrics(host.registry)
    cache = SnapshotCache(on_update=metrics.observe_snapshot)
    server = host.server()
    ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(
        AggregatedDiscoveryServicer(cache, metrics), server
    )
    eds_pb2_grpc.add_EndpointDiscoveryServiceServicer_to_server(
        EndpointDiscoveryServicer(cache, metrics), server
    )
    http = aiohttp.ClientSession()
    host.on_stop(http.close)
    worker_tls = (
        None
        if settings.worker_tls_ca_file is None
        else ReloadingChannelCredentials(
            settings.worker_tls_ca_file, settings.worker_tls_cert_file, settings.worker_tls_key_file
        )
    )

    def worker_channels(timeout: float) -> GrpcWorkerProbe:
        """Channels to the workers, with the TLS their ports want, closed at shutdown."""
        made = GrpcWorkerProbe(
            timeout, settings.max_message_bytes, worker_tls, settings.worker_tls_server_name
        )
        host.on_stop(made.close)
        return made

    probe = worker_channels(settings.worker_probe_timeout_seconds)
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
    # The adapter admin API, over channels of its own (the feed's have a probe's timeouts).
    timeout = settings.admin_worker_timeout_seconds
    fleet = AdapterFleet(cache, worker_channels(timeout), timeout)
    admin_pb2_grpc.add_AdapterAdminServicer_to_server(
        AdapterAdminServicer(AdminKeys(settings.admin_keys_file), fleet), server
    )
    host.keep_running(fleet.keep_reconciled(settings.admin_reconcile_seconds), "adapter-reconcile")
    page = PageServer(settings.ops_page_dir, settings.host, settings.ops_page_port)
    consul = None
    if settings.source == "consul":
        assert settings.consul_http_addr is not None  # checked by the settings
        consul = consul_client(
            settings.consul_http_addr,
            settings.consul_wait_seconds * 17 / 16 + CONSUL_TIMEOUT_MARGIN_SECONDS,
        )
        host.on_stop(consul.close)
    # Ends every xDS stream at shutdown; Envoy keeps the endpoints it has and reconnects with
    # backoff.
    host.before_server_stop(cache.close)
    first = asyncio.Event()
    # Sources retry their backend forever: ending on their own means a bug.
    host.keep_running(feed(build_source(settings, metrics, consul), cache, first), "endpoint-feed")

    async def start() -> None:
        page_port = await page.start()
        host.on_stop(page.stop)
        log.info("ops page listening", extra={"ops_page_port": page_port})
        await first.wait()

    return await host.run(start, {"source": settings.source})
