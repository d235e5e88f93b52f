"""gRPC server bootstrap: channel options, health, reflection, signals and the event loop."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Coroutine, Sequence
from typing import Any

import grpc
import uvloop
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from tokenmesh.common.credentials import ReloadingServerCredentials
from tokenmesh.common.settings import ServiceSettings

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def server_options(settings: ServiceSettings, reuse_port: bool = False) -> list[tuple[str, Any]]:
    """Channel arguments from the production playbook; each is explained in ServiceSettings.
    reuse_port: several processes serve the port together (SO_REUSEPORT)."""
    return [
        ("grpc.max_send_message_length", settings.max_message_bytes),
        ("grpc.max_receive_message_length", settings.max_message_bytes),
        ("grpc.max_concurrent_streams", settings.max_concurrent_streams),
        ("grpc.keepalive_time_ms", settings.keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", settings.keepalive_timeout_ms),
        ("grpc.keepalive_permit_without_calls", int(settings.keepalive_permit_without_calls)),
        ("grpc.http2.min_ping_interval_without_data_ms", settings.min_ping_interval_ms),
        # With a minimum interval enforced, a few early pings are tolerated before GOAWAY.
        ("grpc.http2.max_ping_strikes", 2),
        ("grpc.max_connection_idle_ms", settings.max_connection_idle_ms),
        ("grpc.max_connection_age_ms", settings.max_connection_age_ms),
        ("grpc.max_connection_age_grace_ms", settings.max_connection_age_grace_ms),
        # A server that cannot bind its port must fail, not share it with a stale copy; only
        # the front ends of one worker share theirs (worker/frontends.py checks it is free).
        ("grpc.so_reuseport", int(reuse_port)),
    ]


def build_server(
    settings: ServiceSettings,
    interceptors: Sequence[aio.ServerInterceptor],
    reuse_port: bool = False,
) -> aio.Server:
    return aio.server(interceptors=list(interceptors), options=server_options(settings, reuse_port))


def server_credentials(settings: ServiceSettings) -> grpc.ServerCredentials | None:
    """TLS that requires a client certificate signed by tls_client_ca_file (mTLS with Envoy),
    or None when no certificate is configured (plaintext). The files are read again when they
    change (a renewed certificate serves the next connection; common/credentials.py)."""
    if (
        settings.tls_cert_file is None
        or settings.tls_key_file is None
        or settings.tls_client_ca_file is None
    ):
        return None
    return ReloadingServerCredentials(
        settings.tls_cert_file, settings.tls_key_file, settings.tls_client_ca_file
    ).credentials()


def bind(server: aio.Server, settings: ServiceSettings) -> int:
    """Listen on settings.host:port, plaintext or, with TLS settings, mTLS only; returns the
    bound port."""
    address = f"{settings.host}:{settings.port}"
    credentials = server_credentials(settings)
    if credentials is None:
        return int(server.add_insecure_port(address))
    return int(server.add_secure_port(address, credentials))


class Health:
    """grpc.health.v1 for the overall server ("") and each named service, switched together."""

    def __init__(self, service_names: Sequence[str]) -> None:
        self.servicer = HealthServicer()
        self._names = ("", *service_names)
        # What the checks answer now (also for HTTP health checks of a service's other ports).
        self.serving = False

    def register(self, server: aio.Server) -> None:
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)

    async def set_serving(self) -> None:
        await self._set_all(SERVING)

    async def set_not_serving(self) -> None:
        await self._set_all(NOT_SERVING)

    async def _set_all(self, status: int) -> None:
        self.serving = status == SERVING
        for name in self._names:
            await self.servicer.set(name, status)


class ProbePort:
    """grpc.health.v1 alone on a plaintext port (settings.health_port), for probes that cannot
    do mTLS; it shares the service's Health, so both ports report the same status."""

    def __init__(self, health: Health, settings: ServiceSettings, reuse_port: bool = False) -> None:
        self._health = health
        self._settings = settings
        self._reuse_port = reuse_port
        self._server: aio.Server | None = None

    async def start(self) -> int | None:
        """Listen (if a health port is configured); returns the bound port."""
        if self._settings.health_port < 0:
            return None
        self._server = aio.server(options=server_options(self._settings, self._reuse_port))
        self._health.register(self._server)
        port = self._server.add_insecure_port(f"{self._settings.host}:{self._settings.health_port}")
        await self._server.start()
        return int(port)

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(0)


def enable_reflection(server: aio.Server, service_names: Sequence[str]) -> None:
    """Server reflection, so `grpcurl -plaintext HOST:PORT list` works without proto files."""
    names = (*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name)
    reflection.enable_server_reflection((*names, reflection.SERVICE_NAME), server)


async def wait_for_shutdown_signal(stop: asyncio.Event | None = None) -> None:
    """Return on SIGTERM or SIGINT (or when stop is set, for fatal conditions)."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


def run(main: Coroutine[Any, Any, int | None]) -> int:
    """Run a service's serve() coroutine on uvloop; returns its exit status."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main) or 0
