"""The live ops feed: DashboardSnapshots from the workers themselves and the mesh's Prometheus,
and WorkersSnapshots (the workers' figures alone) for the gateways' endpoint picker."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import aiohttp
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tokenmesh.common.channels import SwappableChannel, client_options
from tokenmesh.common.credentials import ReloadingChannelCredentials
from tokenmesh.common.errors import InvalidArgument
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc, ops_pb2, ops_pb2_grpc

log = logging.getLogger(__name__)

WORKER_HEALTH_SERVICE = "tokenmesh.v1.InferenceService"
# The public API's calls at the gateways, whichever path their tokens took.
PUBLIC_CALLS = "tokenmesh_gateway_calls_total"
# Health checks are Envoy's, and the ops feed's own subscriptions end CANCELLED whenever a page
# closes: neither is an error worth showing.
NOT_OURS = 'grpc_service!~"grpc.health.v1.Health|tokenmesh.v1.OpsService"'
# tokenmesh_reranker_circuit_state gauge values (gateway/core/breaker.py) -> the API's enum.
CIRCUIT_STATES = {
    0: ops_pb2.CIRCUIT_STATE_CLOSED,
    1: ops_pb2.CIRCUIT_STATE_HALF_OPEN,
    2: ops_pb2.CIRCUIT_STATE_OPEN,
}


@dataclass(frozen=True)
class IntervalLimits:
    """A subscription's interval_ms: what 0 means, and the range a caller may ask for."""

    default_ms: int
    min_ms: int
    # Well under Envoy's 60 s stream idle timeout, which would cut a quieter stream at the edge.
    max_ms: int = 30_000


DASHBOARD_INTERVAL = IntervalLimits(default_ms=1000, min_ms=100)
# The gateways pick workers by these figures: fresher by default, and cheap (no Prometheus).
WORKERS_INTERVAL = IntervalLimits(default_ms=200, min_ms=50)


def interval_seconds(
    request: ops_pb2.DashboardRequest | ops_pb2.WorkersRequest, limits: IntervalLimits
) -> float:
    """The request's interval (0: the default); INVALID_ARGUMENT outside the limits."""
    interval_ms = request.interval_ms or limits.default_ms
    if not limits.min_ms <= interval_ms <= limits.max_ms:
        raise InvalidArgument(
            "interval_ms",
            f"must be 0 (default {limits.default_ms}) or {limits.min_ms}..{limits.max_ms}, "
            f"got {request.interval_ms}",
        )
    return interval_ms / 1000


def duration_seconds(duration: str) -> float:
    """Seconds of a PromQL duration of one unit (30s, 5m, 1h), as the settings allow."""
    return float(duration[:-1]) * {"s": 1, "m": 60, "h": 3600}[duration[-1]]


@dataclass(frozen=True)
class Sample:
    """One series of an instant query: its labels and value."""

    labels: Mapping[str, str]
    value: float


class PrometheusError(Exception):
    """A query that did not answer: Prometheus unreachable, slow, or the query rejected."""


class Prometheus(Protocol):
    async def query(self, expr: str) -> list[Sample]: ...


class PrometheusHttp:
    """Instant queries against Prometheus' HTTP API (/api/v1/query), each bounded by timeout."""

    def __init__(self, session: aiohttp.ClientSession, url: str, timeout_seconds: float) -> None:
        self._session = session
        self._url = url.rstrip("/") + "/api/v1/query"
        self._timeout = aiohttp.ClientTimeout(total=timeout_seconds)

    async def query(self, expr: str) -> list[Sample]:
        try:
            async with self._session.get(
                self._url, params={"query": expr}, timeout=self._timeout
            ) as reply:
                answer: Any = await reply.json(content_type=None)
        except TimeoutError:
            raise PrometheusError(f"no answer within {self._timeout.total:g}s") from None
        except (aiohttp.ClientError, ValueError) as exc:
            raise PrometheusError(f"{type(exc).__name__}: {exc}") from None
        if not isinstance(answer, dict) or answer.get("status") != "success":
            error = answer.get("error") if isinstance(answer, dict) else answer
            raise PrometheusError(f"query failed: {error}")
        return [
            Sample(dict(series.get("metric", {})), float(series["value"][1]))
            for series in answer["data"]["result"]
        ]


@dataclass(frozen=True)
class FleetQueries:
    """The PromQL behind the fleet figures (the same as the dashboards'). Rates use
    rate_window; TTFT quantiles and errors the last minute."""

    rate_window: str = "30s"
    window: str = "1m"

    def requests_per_second(self) -> str:
        return f'sum(rate({PUBLIC_CALLS}{{service="gateway"}}[{self.rate_window}]))'

    def tokens_per_second(self) -> str:
        selector = 'service="gateway"'
        return f"sum(rate(tokenmesh_tokens_generated_total{{{selector}}}[{self.rate_window}]))"

    def worker_tokens_per_second(self) -> str:
        # `address` is the worker's gRPC address, a target label the scrape config sets.
        selector = 'service="worker"'
        return (
            "sum by (address) "
            f"(rate(tokenmesh_tokens_generated_total{{{selector}}}[{self.rate_window}]))"
        )

    def ttft(self, quantile: float) -> str:
        buckets = f'tokenmesh_ttft_seconds_bucket{{service="gateway"}}[{self.window}]'
        return f"histogram_quantile({quantile}, sum by (le) (rate({buckets})))"

    # Per model or adapter: the workers' series, which every stream reaches whatever its path,
    # labelled with the name it gave (the Serving load dashboard's panels).
    def model_tokens_per_second(self) -> str:
        rate = f'rate(tokenmesh_tokens_generated_total{{service="worker"}}[{self.rate_window}])'
        return f"sum by (model) ({rate})"

    def model_streams_per_second(self, failed: bool = False) -> str:
        selector = 'service="worker"' + (',grpc_code!="OK"' if failed else "")
        rate = f"rate(tokenmesh_request_duration_seconds_count{{{selector}}}[{self.rate_window}])"
        return f"sum by (model) ({rate})"

    def model_ttft(self, quantile: float) -> str:
        buckets = f'tokenmesh_ttft_seconds_bucket{{service="worker"}}[{self.window}]'
        return f"histogram_quantile({quantile}, sum by (le, model) (rate({buckets})))"

    def circuits(self) -> str:
        return "max by (replica) (tokenmesh_reranker_circuit_state)"

    def degraded_total(self) -> str:
        return "sum(tokenmesh_degraded_responses_total)"

    def resumptions_total(self) -> str:
        # The gateways' moves, the workers' handovers and the edge's stream relay's moves
        # (Envoy's stats of its module).
        return (
            'sum({__name__=~"tokenmesh_(gateway|worker)_resumptions_total'
            '|envoy_dynamicmodulescustom_tokenmesh_relay_resumptions"})'
        )

    def recent_errors(self) -> str:
        """Failed RPCs each service's server handled, and the public calls whose tokens came
        straight from a worker (no gateway's server handled those)."""
        served = f'grpc_server_handled_total{{grpc_code!="OK",{NOT_OURS}}}'
        direct = f'{PUBLIC_CALLS}{{grpc_code!="OK",path="direct"}}'
        return (
            "sum by (service, grpc_service, grpc_method, grpc_code) "
            f"(increase({served}[{self.window}]) or increase({direct}[{self.window}])) > 0"
        )


@dataclass
class Fleet:
    """The fleet figures from Prometheus, and why any are missing."""

    requests_per_second: float = 0.0
    tokens_per_second: float = 0.0
    worker_tokens_per_second: dict[str, float] = field(default_factory=dict)
    ttft_p50_seconds: float = math.nan
    ttft_p99_seconds: float = math.nan
    circuits: dict[str, int] = field(default_factory=dict)
    degraded_responses_total: int = 0
    resumptions_total: int = 0
    errors: list[ops_pb2.ErrorCount] = field(default_factory=list)
    models: list[ops_pb2.ModelFigures] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def single(samples: list[Sample], default: float) -> float:
    """The value of a query that sums to one series (none when nothing matched yet)."""
    return samples[0].value if samples else default


async def query_fleet(prometheus: Prometheus | None, queries: FleetQueries, url: str) -> Fleet:
    """Every fleet figure, queried concurrently; what fails becomes a warning."""
    fleet = Fleet()
    if prometheus is None:
        fleet.warnings.append(
            "no Prometheus configured (prometheus_url): only worker figures are shown"
        )
        return fleet
    exprs = {
        "requests": queries.requests_per_second(),
        "tokens": queries.tokens_per_second(),
        "worker_tokens": queries.worker_tokens_per_second(),
        "p50": queries.ttft(0.5),
        "p99": queries.ttft(0.99),
        "circuits": queries.circuits(),
        "degraded": queries.degraded_total(),
        "resumptions": queries.resumptions_total(),
        "errors": queries.recent_errors(),
        "model_tokens": queries.model_tokens_per_second(),
        "model_streams": queries.model_streams_per_second(),
        "model_failed": queries.model_streams_per_second(failed=True),
        "model_p50": queries.model_ttft(0.5),
        "model_p99": queries.model_ttft(0.99),
    }
    answers = await asyncio.gather(
        *(prometheus.query(expr) for expr in exprs.values()), return_exceptions=True
    )
    results: dict[str, list[Sample]] = {}
    failures: dict[str, BaseException] = {}
    for name, answer in zip(exprs, answers, strict=True):
        if isinstance(answer, PrometheusError):
            failures[name] = answer
        elif isinstance(answer, BaseException):
            raise answer
        else:
            results[name] = answer
    if failures and not results:
        first = next(iter(failures.values()))
        fleet.warnings.append(f"Prometheus at {url} unavailable ({first}): fleet figures missing")
        return fleet
    for name, failure in failures.items():
        fleet.warnings.append(f"Prometheus query {name} failed: {failure}")
    fleet.requests_per_second = single(results.get("requests", []), 0.0)
    fleet.tokens_per_second = single(results.get("tokens", []), 0.0)
    fleet.worker_tokens_per_second = {
        s.labels.get("address", ""): s.value for s in results.get("worker_tokens", [])
    }
    fleet.ttft_p50_seconds = single(results.get("p50", []), math.nan)
    fleet.ttft_p99_seconds = single(results.get("p99", []), math.nan)
    fleet.circuits = {
        s.labels.get("replica", "?"): int(s.value)
        for s in results.get("circuits", [])
        if not math.isnan(s.value)
    }
    fleet.degraded_responses_total = round(single(results.get("degraded", []), 0.0))
    fleet.resumptions_total = round(single(results.get("resumptions", []), 0.0))
    errors = [
        ops_pb2.ErrorCount(
            service=s.labels.get("service", ""),
            method=f"{s.labels.get('grpc_service', '')}/{s.labels.get('grpc_method', '')}",
            code=s.labels.get("grpc_code", ""),
            # increase() extrapolates to the window's edges: 0.7 means "about one".
            count=max(1, round(s.value)),
        )
        for s in results.get("errors", [])
    ]
    fleet.errors = sorted(errors, key=lambda e: (-e.count, e.service, e.method, e.code))
    fleet.models = model_figures(results)
    return fleet


def model_figures(results: Mapping[str, list[Sample]]) -> list[ops_pb2.ModelFigures]:
    """Each model's figures from the per-model queries, by name (a model with no stream in
    the window has its rates 0 and its TTFT NaN)."""

    def by_model(name: str) -> dict[str, float]:
        return {s.labels["model"]: s.value for s in results.get(name, []) if "model" in s.labels}

    tokens, streams, failed = (
        by_model("model_tokens"),
        by_model("model_streams"),
        by_model("model_failed"),
    )
    p50, p99 = by_model("model_p50"), by_model("model_p99")
    return [
        ops_pb2.ModelFigures(
            model=model,
            tokens_per_second=tokens.get(model, 0.0),
            streams_per_second=streams.get(model, 0.0),
            failed_streams_per_second=failed.get(model, 0.0),
            ttft_p50_seconds=p50.get(model, math.nan),
            ttft_p99_seconds=p99.get(model, math.nan),
        )
        for model in sorted({*tokens, *streams, *failed, *p50, *p99})
    ]


@dataclass(frozen=True)
class WorkerFigures:
    """What one worker says about itself; error says why the figures are missing."""

    address: str
    serving: bool = False
    running_requests: int = 0
    waiting_requests: int = 0
    kv_cache_usage: float = 0.0
    # The engine's counts since it started: prompt tokens looked up in its prefix cache, and
    # found there.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    model: str = ""
    held_adapters: tuple[str, ...] = ()
    error: str = ""


class PrefixCacheWindow:
    """Each worker's prefix-cache hit ratio over the last `window` seconds, from the
    cumulative counts its engine reports at each probe: the hits and lookups between its
    newest counts and the oldest ones the feed took within the window.

    Worked out here rather than in the page, so every client of the feed gets the same figure
    (grpcurl too), and without Prometheus. Counts are kept for the window only, shared by every
    subscription whatever its interval.
    """

    def __init__(self, window_seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._window = window_seconds
        self._clock = clock
        # Per address: (time, hits, queries), oldest first.
        self._seen: dict[str, deque[tuple[float, int, int]]] = {}

    def ratio(self, address: str, hits: int, queries: int) -> float:
        """Record a worker's counts now; its hit ratio over the window, NaN when it looked
        nothing up in it or these are its first counts."""
        now = self._clock()
        seen = self._seen.setdefault(address, deque())
        if seen and (queries < seen[-1][2] or hits < seen[-1][1]):
            seen.clear()  # counts went back: the engine restarted
        seen.append((now, hits, queries))
        while seen[0][0] < now - self._window:
            seen.popleft()
        _, first_hits, first_queries = seen[0]
        looked_up = queries - first_queries
        if looked_up <= 0:
            return math.nan
        # Counts read mid-step may hold a step's lookups without its hits: never over 1.
        return min(1.0, (hits - first_hits) / looked_up)

    def retain(self, addresses: Sequence[str]) -> None:
        """Forget workers no longer in the fleet."""
        for address in set(self._seen) - set(addresses):
            del self._seen[address]


class WorkerProbe(Protocol):
    async def probe(self, address: str) -> WorkerFigures: ...

    async def retain(self, addresses: Sequence[str]) -> None:
        """Forget workers no longer in the fleet."""


class GrpcWorkerProbe:
    """Asks a worker directly: grpc.health.v1 Check and InferenceService.GetEngineStats, over
    one channel per address (kept while the address is in the fleet). With tls, over mTLS:
    the workers' certificates must name server_name (the addresses are pod IPs), and
    renewed files give every channel a new connection."""

    def __init__(
        self,
        timeout_seconds: float,
        max_message_bytes: int,
        tls: ReloadingChannelCredentials | None = None,
        server_name: str = "worker",
    ) -> None:
        self._timeout = timeout_seconds
        self._options = client_options(max_message_bytes)
        self._tls = tls
        if tls is not None:
            self._options.append(("grpc.ssl_target_name_override", server_name))
        self._channels: dict[str, SwappableChannel] = {}

    def _open(self, address: str) -> aio.Channel:
        if self._tls is None:
            return aio.insecure_channel(address, options=self._options)
        return aio.secure_channel(address, self._tls.credentials(), options=self._options)

    def channel(self, address: str) -> SwappableChannel:
        """The channel to one worker (opened on first use, kept until retain() drops it)."""
        channel = self._channels.get(address)
        if channel is None:
            channel = SwappableChannel(lambda: self._open(address))
            self._channels[address] = channel
        return channel

    def _reload_tls(self) -> None:
        """New channels when the TLS files changed (a stat per file when they did not); probes
        in flight finish on the old ones."""
        if self._tls is None or not self._tls.changed():
            return
        log.info(
            "TLS files changed: new channels to the workers",
            extra={"files": [str(path) for path in self._tls.paths]},
        )
        for channel in self._channels.values():
            channel.swap(self._timeout)

    async def probe(self, address: str) -> WorkerFigures:
        channel = self.channel(address)
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=WORKER_HEALTH_SERVICE), timeout=self._timeout
        )
        stats = inference_pb2_grpc.InferenceServiceStub(channel).GetEngineStats(
            inference_pb2.EngineStatsRequest(), timeout=self._timeout
        )
        replies: tuple[Any, Any] = await asyncio.gather(health, stats, return_exceptions=True)
        health_reply, stats_reply = replies
        serving = (
            isinstance(health_reply, health_pb2.HealthCheckResponse)
            and health_reply.status == health_pb2.HealthCheckResponse.SERVING
        )
        if isinstance(stats_reply, aio.AioRpcError):
            return WorkerFigures(
                address, serving, error=f"{stats_reply.code().name}: {stats_reply.details()}"
            )
        if isinstance(stats_reply, BaseException):
            raise stats_reply
        return WorkerFigures(
            address,
            serving,
            running_requests=stats_reply.running_requests,
            waiting_requests=stats_reply.waiting_requests,
            kv_cache_usage=stats_reply.kv_cache_usage,
            prefix_cache_queries=stats_reply.prefix_cache_queries,
            prefix_cache_hits=stats_reply.prefix_cache_hits,
            model=stats_reply.model,
            held_adapters=tuple(stats_reply.held_adapters),
        )

    async def retain(self, addresses: Sequence[str]) -> None:
        """Close the channels of workers no longer in the fleet; reopen the others if the TLS
        files changed (once per snapshot, before its probes)."""
        for address in set(self._channels) - set(addresses):
            await self._channels.pop(address).close()
        self._reload_tls()

    async def close(self) -> None:
        await self.retain(())


class Dashboard:
    """Builds one DashboardSnapshot: every worker probed and Prometheus queried at once; or one
    WorkersSnapshot: every worker probed, nothing else."""

    def __init__(
        self,
        workers: Callable[[], Mapping[str, str]],
        probe: WorkerProbe,
        prometheus: Prometheus | None,
        queries: FleetQueries,
        prometheus_url: str = "",
        clock: Callable[[], float] = time.time,
        prefix_cache: PrefixCacheWindow | None = None,
    ) -> None:
        self._workers = workers
        self._probe = probe
        self._prometheus = prometheus
        self._queries = queries
        self._prometheus_url = prometheus_url
        self._clock = clock
        # Over the same window as the fleet's rates.
        self._prefix_cache = prefix_cache or PrefixCacheWindow(
            duration_seconds(queries.rate_window)
        )
        # The workers-only round in flight or just taken, which every gateway's subscription
        # shares (their ticks are aligned: `every`), so workers are probed once per tick.
        self._workers_round: asyncio.Future[ops_pb2.WorkersSnapshot] | None = None
        self._workers_round_at = -math.inf

    async def _probe_worker(
        self, address: str, pool: str, hit_ratio: bool
    ) -> ops_pb2.WorkerSnapshot:
        """A worker's figures; with hit_ratio, its prefix-cache hit ratio too, its counts taken
        as they arrive (so concurrent subscriptions' readings go in in the order they were
        made), else NaN and its counts left out of the window."""
        worker = await self._probe.probe(address)
        ratio = math.nan
        if hit_ratio and not worker.error:
            ratio = self._prefix_cache.ratio(
                address, worker.prefix_cache_hits, worker.prefix_cache_queries
            )
        return ops_pb2.WorkerSnapshot(
            address=worker.address,
            serving=worker.serving,
            running_requests=worker.running_requests,
            waiting_requests=worker.waiting_requests,
            kv_cache_usage=worker.kv_cache_usage,
            error=worker.error,
            prefix_cache_hit_ratio=ratio,
            prefix_cache_queries=worker.prefix_cache_queries,
            prefix_cache_hits=worker.prefix_cache_hits,
            pool=pool,
            model=worker.model,
            held_adapters=worker.held_adapters,
        )

    async def _probe_workers(
        self, pools: Mapping[str, str], hit_ratios: bool
    ) -> list[ops_pb2.WorkerSnapshot]:
        """Every worker (by address: its pool) probed at once, by pool and address; those gone
        from the fleet forgotten."""
        addresses = sorted(pools, key=lambda address: (pools[address], address))
        await self._probe.retain(addresses)
        self._prefix_cache.retain(addresses)
        return await asyncio.gather(
            *(self._probe_worker(address, pools[address], hit_ratios) for address in addresses)
        )

    async def workers_snapshot(self) -> ops_pb2.WorkersSnapshot:
        """The workers' figures alone, for the gateways' endpoint picker: no Prometheus, and no
        hit ratio (the dashboard's, over its window: a feed this frequent, on several streams,
        would crowd it with readings that may arrive out of order). Callers within
        SHARED_ROUND_SECONDS of each other share one round of probes."""
        now = asyncio.get_running_loop().time()
        round_ = self._workers_round
        if round_ is None or (
            round_.done() and now - self._workers_round_at > SHARED_ROUND_SECONDS
        ):
            round_ = self._workers_round = asyncio.ensure_future(self._take_workers())
            self._workers_round_at = now
        # One caller going away must not cancel the others' round.
        return await asyncio.shield(round_)

    async def _take_workers(self) -> ops_pb2.WorkersSnapshot:
        workers = await self._probe_workers(self._workers(), hit_ratios=False)
        return ops_pb2.WorkersSnapshot(taken_unix_millis=int(self._clock() * 1000), workers=workers)

    async def snapshot(self) -> ops_pb2.DashboardSnapshot:
        addresses = self._workers()
        fleet, workers = await asyncio.gather(
            query_fleet(self._prometheus, self._queries, self._prometheus_url),
            self._probe_workers(addresses, hit_ratios=True),
        )
        for worker in workers:
            worker.tokens_per_second = fleet.worker_tokens_per_second.get(worker.address, 0.0)
        warnings = list(fleet.warnings)
        if not addresses:
            warnings.append("no workers known to the control plane's endpoint source")
        circuit = (
            CIRCUIT_STATES.get(max(fleet.circuits.values()), ops_pb2.CIRCUIT_STATE_UNSPECIFIED)
            if fleet.circuits
            else ops_pb2.CIRCUIT_STATE_UNSPECIFIED
        )
        return ops_pb2.DashboardSnapshot(
            taken_unix_millis=int(self._clock() * 1000),
            workers=workers,
            reranker_circuit=circuit,
            requests_per_second=fleet.requests_per_second,
            tokens_per_second=fleet.tokens_per_second,
            ttft_p50_seconds=fleet.ttft_p50_seconds,
            ttft_p99_seconds=fleet.ttft_p99_seconds,
            degraded_responses_total=fleet.degraded_responses_total,
            resumptions_total=fleet.resumptions_total,
            gateway_circuits=[
                ops_pb2.GatewayCircuit(
                    gateway=gateway,
                    state=CIRCUIT_STATES.get(value, ops_pb2.CIRCUIT_STATE_UNSPECIFIED),
                )
                for gateway, value in sorted(fleet.circuits.items())
            ],
            recent_errors=fleet.errors,
            models=fleet.models,
            warnings=warnings,
        )


Snapshot = TypeVar("Snapshot")
# Subscriptions asking for the workers' figures this close together share one round of probes.
SHARED_ROUND_SECONDS = 0.02


async def every(
    interval: float, take: Callable[[], Awaitable[Snapshot]]
) -> AsyncIterator[Snapshot]:
    """take()'s snapshot at once, then at every multiple of interval on the event loop's clock
    (skipping those a snapshot overran), for ever: subscriptions with one interval tick
    together, so they can share a round of probes."""
    loop = asyncio.get_running_loop()
    while True:
        yield await take()
        await asyncio.sleep(interval - loop.time() % interval)


class OpsServicer(ops_pb2_grpc.OpsServiceServicer):
    """tokenmesh.v1.OpsService: a snapshot every interval until the caller goes away (gRPC
    cancels the handler, ending the sleep or the probes at once)."""

    def __init__(self, dashboard: Dashboard) -> None:
        self._dashboard = dashboard

    async def SubscribeDashboard(
        self, request: ops_pb2.DashboardRequest, context: aio.ServicerContext[Any, Any]
    ) -> Any:
        interval = interval_seconds(request, DASHBOARD_INTERVAL)
        async for snapshot in every(interval, self._dashboard.snapshot):
            yield snapshot

    async def SubscribeWorkers(
        self, request: ops_pb2.WorkersRequest, context: aio.ServicerContext[Any, Any]
    ) -> Any:
        interval = interval_seconds(request, WORKERS_INTERVAL)
        async for snapshot in every(interval, self._dashboard.workers_snapshot):
            yield snapshot
