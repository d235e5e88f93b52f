"""Each service's policy as data, decided once from MeshSettings: how its cluster checks, balances
and ejects hosts, how routes to it retry, and what its internal listener adds. The
builders (clusters, routes, listeners, tls) read these fields; none asks a cluster's name."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from tokenmesh.common.pools import pool_cluster
from tokenmesh.meshconfig.balancing import worker_balancing
from tokenmesh.meshconfig.config import MeshSettings
from tokenmesh.meshconfig.constants import (
    GATEWAY,
    OPENAI_CLUSTER,
    RERANKER,
    WORKER,
    Config,
    seconds,
)
from tokenmesh.meshconfig.retries import NEVER_SENT, OVERLOADED, RETRY_ON

# The path of the gateways' OpenAI API's HTTP health check.
OPENAI_HEALTH_PATH = "/health"


@dataclass(frozen=True)
class HealthCheckTiming:
    """The numbers of the service clusters' active health checks as the config carries them:
    Envoy's values, or (CHART_HEALTH_CHECKS) placeholders for the chart's values."""

    timeout: str
    interval: str
    unhealthy_threshold: int | str
    healthy_threshold: int | str
    panic_threshold_percent: float | str

    @classmethod
    def of(cls, mesh: MeshSettings) -> HealthCheckTiming:
        panic = mesh.healthy_panic_threshold_percent
        return cls(
            timeout=seconds(mesh.health_check_timeout_seconds),
            interval=seconds(mesh.health_check_interval_seconds),
            unhealthy_threshold=mesh.health_check_unhealthy_threshold,
            healthy_threshold=mesh.health_check_healthy_threshold,
            panic_threshold_percent=int(panic) if panic.is_integer() else panic,
        )


# The kubernetes profiles' health-check numbers: the chart's ConfigMap puts its
# envoy.healthChecks values in their place (tokenmesh.envoyConfig in _helpers.tpl).
CHART_HEALTH_CHECKS = HealthCheckTiming(
    timeout="${TOKENMESH_HEALTH_CHECK_TIMEOUT}",
    interval="${TOKENMESH_HEALTH_CHECK_INTERVAL}",
    unhealthy_threshold="${TOKENMESH_HEALTH_CHECK_UNHEALTHY_THRESHOLD}",
    healthy_threshold="${TOKENMESH_HEALTH_CHECK_HEALTHY_THRESHOLD}",
    panic_threshold_percent="${TOKENMESH_HEALTHY_PANIC_THRESHOLD_PERCENT}",
)

# Least outstanding requests, per stream: long and short generations even out. The services
# other than the workers balance so; the workers as their routing says (balancing.py).
LEAST_REQUEST = "LEAST_REQUEST"


@dataclass(frozen=True)
class WorkerBalancing:
    """The workers' cluster's load_balancing_policy: Envoy's typed policy for the mesh's
    worker_routing, or (CHART_WORKER_BALANCING) a placeholder, which the chart's ConfigMap
    replaces with the one of its envoy.workerRouting (files/worker-balancing.yaml)."""

    policy: Config | str

    @classmethod
    def of(cls, mesh: MeshSettings) -> WorkerBalancing:
        return cls(worker_balancing(mesh.worker_routing, mesh.prefix_balance_factor_percent))


CHART_WORKER_BALANCING = WorkerBalancing("${TOKENMESH_WORKER_BALANCING}")
# The prefix policy's bounded load in the chart's worker-balancing.yaml: its ConfigMap puts
# envoy.workerRouting.prefixBalanceFactorPercent in its place.
CHART_PREFIX_BALANCE_FACTOR = "${TOKENMESH_PREFIX_BALANCE_FACTOR}"


@dataclass(frozen=True)
class HealthCheck:
    """A cluster's active health check: gRPC's health service asked about target (a service
    name), or an HTTP GET of target (a path); with the mesh's timing."""

    kind: Literal["grpc", "http"]
    target: str
    timing: HealthCheckTiming


@dataclass(frozen=True)
class Ejection:
    """When a host leaves its cluster's load balancing before its health checks fail (Envoy's
    outlier detection): at `after` consecutive connection failures, and nothing else
    (connection_failures), or consecutive 5xx or gateway errors, counted every interval
    (errors); for base_seconds, as many hosts as fail."""

    on: Literal["connection_failures", "errors"]
    after: int
    base_seconds: float
    interval_seconds: float | None = None


@dataclass(frozen=True)
class CircuitBreaker:
    """A cluster's bounds on connections and requests, and its retry budget."""

    retry_budget_percent: float
    min_retry_concurrency: int
    max_connections: int = 1024
    max_pending_requests: int = 1024
    max_requests: int = 4096


@dataclass(frozen=True)
class ServicePolicy:
    """One service's cluster, the routes to it, and (listener_port) its internal listener."""

    name: str  # the cluster's, the internal listener's and its virtual host's
    server_name: str  # the name its hosts' certificates carry (SNI, SAN) under mTLS
    protocol: Literal["grpc", "http1"]  # gRPC over HTTP/2, or HTTP/1.1
    health_check: HealthCheck
    circuit_breaker: CircuitBreaker
    retry_on: str
    lb_policy: str = LEAST_REQUEST
    # A typed load-balancing policy in place of lb_policy (the workers': balancing.py).
    load_balancing: Config | str | None = None
    ejection: Ejection | None = None
    listener_port: int | None = None  # the gateways' listener for it, if they call it
    # Its hosts' answers say which host answered (UPSTREAM_HEADER, set by its cluster: whatever
    # starts the stream, a route or the edge's stream relay); the edge removes it for callers.
    names_upstream_host: bool = False
    # Streams one connection to a host carries before Envoy opens another (None: the mesh's).
    streams_per_connection: int | None = None


@dataclass(frozen=True)
class Services:
    """The service policies of a mesh, by role."""

    gateway: ServicePolicy
    worker: ServicePolicy
    reranker: ServicePolicy
    openai: ServicePolicy | None  # with openai_api
    # The further worker pools' (worker_pools), by pool name: the workers' policy, each its own
    # cluster, reached through the workers' routes by the pool's header (pool_routes).
    pools: tuple[tuple[str, ServicePolicy], ...] = ()

    @property
    def clusters(self) -> tuple[ServicePolicy, ...]:
        """Every service's, in the config's order."""
        found = (self.gateway, self.worker, *(pool for _, pool in self.pools), self.reranker)
        return found + ((self.openai,) if self.openai else ())

    @property
    def internal(self) -> tuple[ServicePolicy, ...]:
        """The services the gateways reach through an internal listener."""
        return tuple(service for service in self.clusters if service.listener_port is not None)

    @classmethod
    def of(
        cls, mesh: MeshSettings, checks: HealthCheckTiming, balancing: WorkerBalancing
    ) -> Services:
        breaker = CircuitBreaker(mesh.retry_budget_percent, mesh.retry_min_concurrency)

        def grpc_service(name: str, health_service: str) -> ServicePolicy:
            """A gRPC service as the mesh treats one by default; each differs from it below."""
            return ServicePolicy(
                name=name,
                server_name=name,
                protocol="grpc",
                health_check=HealthCheck("grpc", health_service, checks),
                circuit_breaker=breaker,
                retry_on=RETRY_ON,
            )

        gateway = grpc_service(GATEWAY, "tokenmesh.v1.LLMService")
        worker = replace(
            grpc_service(WORKER, "tokenmesh.v1.InferenceService"),
            retry_on=RETRY_ON + OVERLOADED,
            load_balancing=balancing.policy,
            # A worker whose connections fail (killed, its port closed) leaves the table at the
            # first failure, not at its next failed health check; a passing check brings it
            # back. Hashing under bounded load (worker_routing prefix) needs it: a dead worker
            # has no streams, so it is the least loaded, and every pick and retry would go to
            # it until then. Only connection failures count: a worker's gRPC answers never
            # eject it.
            ejection=Ejection("connection_failures", after=1, base_seconds=10),
            listener_port=mesh.worker_listener_port,
            # Which worker took a gateway's call (for the gateway's span) or a relayed stream
            # (for the relay's access log). The edge never tells callers the workers' addresses.
            names_upstream_host=True,
            # A worker's front ends share its port and the kernel spreads connections over
            # them (worker/frontends.py): more connections as the streams grow.
            streams_per_connection=mesh.worker_streams_per_connection,
        )
        reranker = replace(
            grpc_service(RERANKER, "tokenmesh.v1.RerankService"),
            # Bound what may pile up in front of a slow reranker.
            circuit_breaker=replace(breaker, max_pending_requests=64, max_requests=256),
            # Eject a failing reranker host quickly, before the gateway's own breaker opens.
            ejection=Ejection("errors", after=3, base_seconds=5, interval_seconds=1),
            listener_port=mesh.reranker_listener_port,
        )
        # The gateways' HTTP port (uvicorn): HTTP/1.1, a connection per stream in flight; its
        # hosts are the gateways, with their certificate.
        openai = replace(
            gateway,
            name=OPENAI_CLUSTER,
            protocol="http1",
            health_check=HealthCheck("http", OPENAI_HEALTH_PATH, checks),
            retry_on=NEVER_SENT,
        )
        # A pool's workers are workers: the same certificate name, checks and balancing.
        pools = tuple(
            (pool, replace(worker, name=pool_cluster(pool), listener_port=None))
            for pool in mesh.worker_pools
        )
        return cls(gateway, worker, reranker, openai if mesh.openai_api else None, pools)
