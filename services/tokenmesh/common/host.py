"""ServiceHost: the lifecycle every tokenmesh process shares, from its first thread to its exit."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import sys
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import Any

from grpc import aio
from prometheus_client import CollectorRegistry
from prometheus_client.registry import Collector

from tokenmesh.common.cpu_pinning import pin_threads
from tokenmesh.common.interceptors import Ends, standard_interceptors
from tokenmesh.common.metrics import GrpcServerMetrics, MetricsEndpoint
from tokenmesh.common.registration import ConsulRegistration, instance_for
from tokenmesh.common.server import (
    Health,
    ProbePort,
    bind,
    build_server,
    enable_reflection,
    wait_for_shutdown_signal,
)
from tokenmesh.common.settings import ServiceSettings
from tokenmesh.common.tracing import Tracing

log = logging.getLogger(__name__)

CleanUp = Callable[[], Awaitable[None] | None]


class ServiceHost:
    """Owns what every service does the same way: its metrics registry and endpoint, tracing,
    grpc.health.v1 (on the service port and the optional probe port), reflection, the gRPC
    server with its bind and TLS/mTLS, Consul registration, signals, the service's background
    tasks, shutdown in reverse order and the exit code.

    A composition root builds its own parts on `registry` and `tracing`, adds its servicers to
    `server()`, and calls `run(start)`. run() listens (NOT_SERVING), runs `start` (a model
    load, a first snapshot) while health checks are answered, then turns SERVING and registers;
    it returns on SIGTERM/SIGINT (exit 0), or with exit 1 when `start` fails or a task handed to
    `keep_running` ends. While it runs, the service may turn itself NOT_SERVING and back
    (`set_healthy`). Shutdown: NOT_SERVING, deregister, the drain (still accepting new RPCs
    for `drain_seconds`), the `before_server_stop` clean-ups, `server.stop(grace)` (in-flight
    RPCs get the grace period, then are cancelled), the probe port, background tasks, the
    `on_stop` clean-ups (the last added first), tracing, metrics.
    """

    def __init__(
        self,
        role: str,
        settings: ServiceSettings,
        service_names: Sequence[str],
        *,
        pin_now: bool = True,
        register: bool = True,
        consul_meta: Mapping[str, str] | None = None,
        reuse_port: bool = False,
        cluster: str | None = None,
    ) -> None:
        if pin_now:
            pin_threads(settings.cores)  # before any thread starts: they inherit it
        sys.setswitchinterval(settings.gil_switch_interval_ms / 1000)
        self.role = role
        # The Envoy cluster it registers as in Consul (its role's by default).
        self._cluster = cluster
        self.settings = settings
        self.registry = CollectorRegistry()
        # grpc_server_*: the RPCs this process's server handled, recorded by its interceptors.
        self.rpc_metrics = GrpcServerMetrics(self.registry)
        self.tracing = Tracing(f"tokenmesh-{role}", settings.otlp_endpoint)
        self.health = Health(service_names)
        # The service's own verdict on itself (set_healthy), and whether start has finished:
        # health is SERVING with both, until shutdown begins. One change at a time, so a
        # verdict being applied cannot land after shutdown's NOT_SERVING.
        self._healthy = True
        self._up = False
        self._health_lock = asyncio.Lock()
        self._service_names = tuple(service_names)
        self._register = register
        # The service and health ports shared with the other processes of one service.
        self._reuse_port = reuse_port
        self._consul_meta = dict(consul_meta or {})
        self._server: aio.Server | None = None
        self._stop = asyncio.Event()
        self._exit_code = 0
        self._tasks: list[asyncio.Task[Any]] = []
        self._before_server_stop: list[CleanUp] = []
        self._on_stop: list[CleanUp] = []
        self.registration: ConsulRegistration | None = None
        # The bound ports once run() listens: port, metrics_port and health_port (if any).
        self.ports: dict[str, int] = {}

    @property
    def tracer(self) -> Any:
        """The tracer for interceptors and spans; None with tracing off (no spans at all)."""
        return self.tracing.tracer if self.tracing.enabled else None

    def add_collector(self, collector: Collector) -> None:
        self.registry.register(collector)

    def server(
        self, interceptors: Sequence[aio.ServerInterceptor] = (), ends: Ends | None = None
    ) -> aio.Server:
        """The service's gRPC server with the standard interceptors, then `interceptors`;
        health and reflection are on it; `ends`: the service's own accounting of some
        methods' RPCs. Built on the first call."""
        if self._server is None:
            self._server = build_server(
                self.settings,
                standard_interceptors(
                    self.registry, self.tracer, interceptors, self.rpc_metrics, ends
                ),
                self._reuse_port,
            )
            self.health.register(self._server)
            enable_reflection(self._server, self._service_names)
        return self._server

    def keep_running(self, work: Coroutine[Any, Any, Any], name: str) -> None:
        """Run `work` until shutdown; if it ends first (returns or raises), the service stops
        with exit 1. Callable before run() and from `start`."""
        task = asyncio.get_running_loop().create_task(work, name=name)
        task.add_done_callback(self._task_ended)
        self._tasks.append(task)

    def before_server_stop(self, clean_up: CleanUp) -> None:
        """Run at shutdown before the server stops (e.g. end streams that would not end)."""
        self._before_server_stop.append(clean_up)

    def on_stop(self, clean_up: CleanUp) -> None:
        """Run at shutdown once the server has stopped; the last added runs first."""
        self._on_stop.append(clean_up)

    async def set_healthy(self, healthy: bool) -> None:
        """The running service's verdict on itself, e.g. its engine hung (False), then moving
        again (True): health turns NOT_SERVING, or SERVING again, for every service name. Never
        SERVING before start has finished, nor once shutdown has begun."""
        self._healthy = healthy
        await self._publish_health()

    async def _publish_health(self) -> None:
        async with self._health_lock:
            if self._healthy and self._up and not self._stop.is_set():
                await self.health.set_serving()
            else:
                await self.health.set_not_serving()

    def fail(self, reason: str) -> None:
        """Stop the service with exit 1."""
        log.error("%s stopping: %s", self.role, reason)
        self._exit_code = 1
        self._stop.set()

    async def run(
        self,
        start: Callable[[], Awaitable[None]] | None = None,
        log_fields: Mapping[str, Any] | None = None,
    ) -> int:
        """Serve until a signal or a failure; returns the exit code."""
        server = self.server()
        port = bind(server, self.settings)
        await self.health.set_not_serving()
        await server.start()
        probes = ProbePort(self.health, self.settings, self._reuse_port)
        health_port = await probes.start()  # None without a health port
        metrics = MetricsEndpoint(
            self.registry, self.settings.metrics_host, self.settings.metrics_port
        )
        metrics_port = metrics.start()
        consul = self.settings.consul_http_addr if self._register else None
        self.registration = ConsulRegistration(
            consul,
            instance_for(
                self.settings, self.role, port, metrics_port, self._consul_meta, self._cluster
            ),
        )
        self.ports = {"port": port, "metrics_port": metrics_port}
        if health_port is not None:
            self.ports["health_port"] = health_port
        fields = {**self.ports, **(log_fields or {})}
        log.info("%s listening", self.role, extra=fields)
        signals = asyncio.create_task(wait_for_shutdown_signal(self._stop), name="signals")
        try:
            if await self._started(start, signals):
                self._up = True
                await self._publish_health()
                self.registration.start()  # no-op without a Consul address
                log.info("%s serving", self.role, extra=fields)
                await signals
        finally:
            signals.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await signals
            await self._shut_down(server, probes, metrics)
        return self._exit_code

    async def _started(
        self, start: Callable[[], Awaitable[None]] | None, signals: asyncio.Task[None]
    ) -> bool:
        """Run `start` unless a signal or a failure comes first; True once it has finished."""
        if start is None:
            return True
        starting = asyncio.ensure_future(start())
        await asyncio.wait({signals, starting}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            # Stopped while starting; work in a thread (a model load) cannot be interrupted:
            # the process exits once it returns.
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await starting
            return False
        if starting.exception() is not None:
            error = starting.exception()
            log.error("%s failed to start: %s", self.role, error, exc_info=error)
            self._exit_code = 1
            return False
        return not self._stop.is_set()

    def _task_ended(self, task: asyncio.Task[Any]) -> None:
        if task.cancelled() or self._stop.is_set():
            return
        error = task.exception()
        log.error("%s: task %s ended", self.role, task.get_name(), exc_info=error)
        self._exit_code = 1
        self._stop.set()

    async def _shut_down(
        self, server: aio.Server, probes: ProbePort, metrics: MetricsEndpoint
    ) -> None:
        self._stop.set()  # tasks that end from here on are not failures
        log.info("%s stopping", self.role, extra={"grace_seconds": self.settings.grace_seconds})
        # Drained only when it was serving and stops on a signal: a service stopping for a
        # failure (its engine dead) refuses new RPCs at once, so Envoy sends them elsewhere.
        drain = self.health.serving and self._exit_code == 0
        await self._publish_health()  # NOT_SERVING from here on, whatever set_healthy says
        if self.registration is not None:
            await self.registration.stop()
        if drain and self.settings.drain_seconds > 0:
            # New RPCs are still served while every Envoy sees NOT_SERVING and stops sending
            # them: one that reached a stopping server would end CANCELLED, not retried.
            log.info("%s draining", self.role, extra={"drain_seconds": self.settings.drain_seconds})
            await asyncio.sleep(self.settings.drain_seconds)
        for clean_up in self._before_server_stop:
            await _call(clean_up)
        await server.stop(self.settings.grace_seconds)
        await probes.stop()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(BaseException):
                await task
        for clean_up in reversed(self._on_stop):
            await _call(clean_up)
        await self.tracing.shutdown()
        metrics.stop()
        log.info("%s stopped", self.role, extra={"exit_code": self._exit_code})


async def _call(clean_up: CleanUp) -> None:
    result = clean_up()
    if inspect.isawaitable(result):
        await result
