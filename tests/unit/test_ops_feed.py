"""The ops feed's logic: interval limits, snapshots assembled from worker figures and Prometheus
answers, warnings instead of hangs when Prometheus is missing, the workers-only feed the
gateways pick workers by (no Prometheus), and streams that stop working the moment their caller
goes away. Fakes stand in for workers and Prometheus only where the logic
is under test; the probe, the Prometheus client and the page server run for real."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from aiohttp import web
from grpc import aio
from grpc_health.v1 import health_pb2
from prometheus_client import CollectorRegistry

from tests.support import free_port
from tokenmesh.common.errors import InvalidArgument
from tokenmesh.common.interceptors import standard_interceptors
from tokenmesh.common.server import Health
from tokenmesh.controlplane.app import worker_addresses
from tokenmesh.controlplane.endpoints import Endpoint
from tokenmesh.controlplane.ops import (
    DASHBOARD_INTERVAL,
    SHARED_ROUND_SECONDS,
    WORKERS_INTERVAL,
    Dashboard,
    FleetQueries,
    GrpcWorkerProbe,
    IntervalLimits,
    OpsServicer,
    PrefixCacheWindow,
    PrometheusError,
    PrometheusHttp,
    Sample,
    WorkerFigures,
    duration_seconds,
    interval_seconds,
)
from tokenmesh.controlplane.page import NOT_BUILT, PageServer
from tokenmesh.controlplane.snapshots import SnapshotCache
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc, ops_pb2, ops_pb2_grpc

QUERIES = FleetQueries(rate_window="30s")
W0, W1 = "127.0.0.1:50061", "127.0.0.1:50062"
# Added to a timeout where a test bounds how long something took: room for a heavily loaded
# machine, while a missing timeout (a hang) still fails.
SLACK = 4.0
# Generous bound for a condition that should hold promptly.
PROMPTLY = 10.0


# Each feed's request and interval limits.
DASHBOARD = (ops_pb2.DashboardRequest, DASHBOARD_INTERVAL)
WORKERS = (ops_pb2.WorkersRequest, WORKERS_INTERVAL)


@pytest.mark.parametrize(
    ("feed", "interval_ms", "seconds"),
    [
        (DASHBOARD, 0, 1.0),
        (DASHBOARD, 100, 0.1),
        (DASHBOARD, 30_000, 30.0),
        (WORKERS, 0, 0.2),
        (WORKERS, 50, 0.05),
        (WORKERS, 30_000, 30.0),
    ],
)
def test_interval_defaults_per_feed_and_accepts_its_limits(
    feed: tuple[Any, IntervalLimits], interval_ms: int, seconds: float
) -> None:
    request, limits = feed
    assert interval_seconds(request(interval_ms=interval_ms), limits) == seconds


@pytest.mark.parametrize(
    ("feed", "interval_ms", "limits"),
    [
        (DASHBOARD, -1, "100..30000"),
        (DASHBOARD, 99, "100..30000"),
        (DASHBOARD, 30_001, "100..30000"),
        (WORKERS, -1, "50..30000"),
        (WORKERS, 49, "50..30000"),
        (WORKERS, 30_001, "50..30000"),
    ],
)
def test_interval_outside_limits_is_rejected_naming_field_and_limits(
    feed: tuple[Any, IntervalLimits], interval_ms: int, limits: str
) -> None:
    request, interval_limits = feed
    with pytest.raises(InvalidArgument) as caught:
        interval_seconds(request(interval_ms=interval_ms), interval_limits)
    assert caught.value.field == "interval_ms"
    assert limits in caught.value.message and str(interval_ms) in caught.value.message


class FakeProbe:
    """Worker figures by address; an address not listed did not answer."""

    def __init__(self, figures: dict[str, WorkerFigures]) -> None:
        self.figures = figures
        self.calls = 0
        self.retained: list[str] = []

    async def probe(self, address: str) -> WorkerFigures:
        self.calls += 1
        return self.figures.get(address, WorkerFigures(address, error="UNAVAILABLE: down"))

    async def retain(self, addresses: Sequence[str]) -> None:
        self.retained = list(addresses)


class FakePrometheus:
    """Answers each query by the first marker it contains; unknown queries fail."""

    def __init__(self, answers: dict[str, list[Sample]]) -> None:
        self.answers = answers
        self.queries: list[str] = []

    async def query(self, expr: str) -> list[Sample]:
        self.queries.append(expr)
        for marker, samples in self.answers.items():
            if marker in expr:
                return samples
        raise PrometheusError(f"no canned answer for {expr}")


# Markers are checked in order: the more specific ones first.
PROMETHEUS_ANSWERS = {
    "sum by (model) (rate(tokenmesh_tokens_generated_total": [
        Sample({"model": "tiny"}, 9.0),
        Sample({"model": "tiny-lora"}, 3.0),
    ],
    'sum by (model) (rate(tokenmesh_request_duration_seconds_count{service="worker",grpc_code': [
        Sample({"model": "tiny-lora"}, 0.5)
    ],
    "sum by (model) (rate(tokenmesh_request_duration_seconds_count": [
        Sample({"model": "tiny"}, 2.0),
        Sample({"model": "tiny-lora"}, 1.0),
    ],
    "histogram_quantile(0.5, sum by (le, model)": [Sample({"model": "tiny"}, 0.03)],
    "histogram_quantile(0.99, sum by (le, model)": [Sample({"model": "tiny"}, 0.2)],
    "sum by (address)": [
        Sample({"address": W0}, 12.5),
        Sample({"address": W1}, 7.5),
    ],
    "tokenmesh_tokens_generated_total": [Sample({}, 20.0)],
    "grpc_code!=": [
        Sample(
            {
                "service": "gateway",
                "grpc_service": "tokenmesh.v1.LLMService",
                "grpc_method": "Generate",
                "grpc_code": "CANCELLED",
            },
            0.7,
        ),
        Sample(
            {
                "service": "reranker",
                "grpc_service": "tokenmesh.v1.RerankService",
                "grpc_method": "Rerank",
                "grpc_code": "UNAVAILABLE",
            },
            4.2,
        ),
    ],
    "tokenmesh_gateway_calls_total": [Sample({}, 3.0)],
    "histogram_quantile(0.5,": [Sample({}, 0.04)],
    "histogram_quantile(0.99,": [Sample({}, 0.25)],
    "tokenmesh_reranker_circuit_state": [
        Sample({"replica": "gateway-0"}, 0.0),
        Sample({"replica": "gateway-1"}, 2.0),
    ],
    "tokenmesh_degraded_responses_total": [Sample({}, 5.0)],
    "resumptions_total": [Sample({}, 7.0)],
}


async def test_snapshot_joins_worker_figures_with_prometheus_fleet_figures() -> None:
    probe = FakeProbe(
        {W0: WorkerFigures(W0, True, running_requests=3, waiting_requests=1, kv_cache_usage=0.25)}
    )
    dashboard = Dashboard(
        lambda: dict.fromkeys([W1, W0], ""),
        probe,
        FakePrometheus(PROMETHEUS_ANSWERS),
        QUERIES,
        clock=lambda: 12.0,
    )
    snapshot = await dashboard.snapshot()
    assert snapshot.taken_unix_millis == 12_000
    assert probe.retained == [W0, W1]
    w0, w1 = snapshot.workers
    assert (w0.address, w0.serving, w0.running_requests, w0.waiting_requests) == (W0, True, 3, 1)
    assert (w0.kv_cache_usage, w0.tokens_per_second, w0.error) == (0.25, 12.5, "")
    assert (w1.address, w1.serving, w1.error, w1.tokens_per_second) == (
        W1,
        False,
        "UNAVAILABLE: down",
        7.5,
    )
    assert snapshot.requests_per_second == 3.0 and snapshot.tokens_per_second == 20.0
    assert (snapshot.ttft_p50_seconds, snapshot.ttft_p99_seconds) == (0.04, 0.25)
    # The worst gateway decides: one open circuit makes the fleet's open.
    assert snapshot.reranker_circuit == ops_pb2.CIRCUIT_STATE_OPEN
    assert [(c.gateway, c.state) for c in snapshot.gateway_circuits] == [
        ("gateway-0", ops_pb2.CIRCUIT_STATE_CLOSED),
        ("gateway-1", ops_pb2.CIRCUIT_STATE_OPEN),
    ]
    assert snapshot.degraded_responses_total == 5
    assert snapshot.resumptions_total == 7
    assert [(e.service, e.method, e.code, e.count) for e in snapshot.recent_errors] == [
        ("reranker", "tokenmesh.v1.RerankService/Rerank", "UNAVAILABLE", 4),
        ("gateway", "tokenmesh.v1.LLMService/Generate", "CANCELLED", 1),
    ]
    assert list(snapshot.warnings) == []


async def test_no_traffic_yet_gives_zero_rates_nan_latency_and_unknown_circuit() -> None:
    empty: dict[str, list[Sample]] = {key: [] for key in PROMETHEUS_ANSWERS}
    dashboard = Dashboard(
        lambda: dict.fromkeys([W0], ""), FakeProbe({}), FakePrometheus(empty), QUERIES
    )
    snapshot = await dashboard.snapshot()
    assert snapshot.requests_per_second == 0 and snapshot.tokens_per_second == 0
    assert math.isnan(snapshot.ttft_p50_seconds) and math.isnan(snapshot.ttft_p99_seconds)
    assert snapshot.reranker_circuit == ops_pb2.CIRCUIT_STATE_UNSPECIFIED
    assert list(snapshot.recent_errors) == [] and list(snapshot.warnings) == []


async def test_one_failing_query_is_a_warning_and_the_rest_still_arrive() -> None:
    answers = {k: v for k, v in PROMETHEUS_ANSWERS.items() if "histogram" not in k}
    dashboard = Dashboard(
        lambda: dict.fromkeys([W0], ""), FakeProbe({}), FakePrometheus(answers), QUERIES
    )
    snapshot = await dashboard.snapshot()
    assert snapshot.tokens_per_second == 20.0
    assert math.isnan(snapshot.ttft_p99_seconds)
    assert [w for w in snapshot.warnings if w.startswith("Prometheus query p99 failed")]


async def test_without_prometheus_workers_still_stream_with_a_warning() -> None:
    probe = FakeProbe({W0: WorkerFigures(W0, True, running_requests=2)})
    snapshot = await Dashboard(lambda: dict.fromkeys([W0], ""), probe, None, QUERIES).snapshot()
    assert snapshot.workers[0].running_requests == 2
    assert snapshot.tokens_per_second == 0
    assert any("no Prometheus configured" in w for w in snapshot.warnings), snapshot.warnings


async def test_unreachable_prometheus_is_one_warning_not_a_hang() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    async with aiohttp.ClientSession() as session:
        prometheus = PrometheusHttp(session, url, timeout_seconds=1.0)
        probe = FakeProbe({W0: WorkerFigures(W0, True, running_requests=1)})
        started = time.monotonic()
        snapshot = await Dashboard(
            lambda: dict.fromkeys([W0], ""), probe, prometheus, QUERIES, url
        ).snapshot()
    assert time.monotonic() - started < 1.0 + SLACK
    assert snapshot.workers[0].running_requests == 1
    assert len(snapshot.warnings) == 1 and url in snapshot.warnings[0], snapshot.warnings


async def test_slow_prometheus_times_out_into_a_warning() -> None:
    release = asyncio.Event()

    async def stall(request: web.Request) -> web.Response:
        await release.wait()
        return web.json_response({})

    app = web.Application()
    app.router.add_get("/api/v1/query", stall)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        async with aiohttp.ClientSession() as session:
            prometheus = PrometheusHttp(session, url, timeout_seconds=0.3)
            started = time.monotonic()
            snapshot = await Dashboard(
                lambda: dict.fromkeys([], ""), FakeProbe({}), prometheus, QUERIES, url
            ).snapshot()
        assert time.monotonic() - started < 0.3 + SLACK
        assert any("no answer within 0.3s" in w for w in snapshot.warnings), snapshot.warnings
        assert any("no workers known" in w for w in snapshot.warnings), snapshot.warnings
    finally:
        release.set()
        await runner.cleanup()


async def test_prometheus_client_parses_instant_vectors_and_reports_bad_queries() -> None:
    async def query(request: web.Request) -> web.Response:
        if request.query["query"] == "bad(":
            error = {"status": "error", "errorType": "bad_data", "error": "parse error"}
            return web.json_response(error, status=400)
        result = [{"metric": {"replica": "gateway-1"}, "value": [1.0, "2"]}]
        data = {"resultType": "vector", "result": result}
        return web.json_response({"status": "success", "data": data})

    app = web.Application()
    app.router.add_get("/api/v1/query", query)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        async with aiohttp.ClientSession() as session:
            url = f"http://127.0.0.1:{runner.addresses[0][1]}/"
            prometheus = PrometheusHttp(session, url, PROMPTLY)
            assert await prometheus.query("up") == [Sample({"replica": "gateway-1"}, 2.0)]
            with pytest.raises(PrometheusError, match="parse error"):
                await prometheus.query("bad(")
    finally:
        await runner.cleanup()


class Clock:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_hit_ratio_is_over_the_window_from_the_engines_cumulative_counts() -> None:
    clock = Clock()
    window = PrefixCacheWindow(30.0, clock)
    # The first counts seen of a worker: nothing to take a difference from yet.
    assert math.isnan(window.ratio(W0, hits=500, queries=1000))
    clock.now += 10
    assert window.ratio(W0, hits=800, queries=1400) == 300 / 400
    clock.now += 10
    assert window.ratio(W0, hits=800, queries=2000) == 300 / 1000
    # 35 s after the first counts: they have left the window; the 10 s ones are its start.
    clock.now += 15
    assert window.ratio(W0, hits=1100, queries=2400) == 300 / 1000
    # No lookups over the whole window: no ratio (not 0, not an old one).
    clock.now += 31
    assert math.isnan(window.ratio(W0, hits=1100, queries=2400))
    clock.now += 1
    assert math.isnan(window.ratio(W0, hits=1100, queries=2400))


def test_hit_ratio_starts_again_when_a_worker_restarts_and_forgets_workers_gone() -> None:
    clock = Clock()
    window = PrefixCacheWindow(30.0, clock)
    window.ratio(W0, hits=5000, queries=9000)
    window.ratio(W1, hits=0, queries=0)
    clock.now += 1
    # A restarted engine counts from 0: its counts went back, so earlier ones do not count.
    assert math.isnan(window.ratio(W0, hits=10, queries=100))
    clock.now += 1
    assert window.ratio(W0, hits=70, queries=200) == 60 / 100
    # Lookups that find nothing cached: 0, a number.
    assert window.ratio(W1, hits=0, queries=50) == 0
    window.retain([W1])
    assert math.isnan(window.ratio(W0, hits=80, queries=300))
    clock.now += 1
    assert window.ratio(W1, hits=25, queries=100) == 25 / 100


def test_hit_ratio_stays_within_one_when_counts_are_read_mid_step() -> None:
    """A worker may report a step's lookups before its hits; the next reading has both."""
    clock = Clock()
    window = PrefixCacheWindow(30.0, clock)
    window.ratio(W0, hits=100, queries=228)  # 128 lookups counted, their 128 hits not yet
    clock.now += 1
    assert window.ratio(W0, hits=228, queries=300) == 1.0


async def test_snapshots_carry_each_workers_hit_ratio_over_the_rate_window() -> None:
    """Worked out by the feed across snapshots, over FleetQueries' rate window; a worker that
    does not answer has none."""
    clock = Clock()
    figures = WorkerFigures(W0, True, prefix_cache_queries=1000, prefix_cache_hits=100)
    probe = FakeProbe({W0: figures})
    dashboard = Dashboard(
        lambda: dict.fromkeys([W0, W1], ""),
        probe,
        None,
        QUERIES,
        prefix_cache=PrefixCacheWindow(30.0, clock),
    )
    first = (await dashboard.snapshot()).workers
    assert math.isnan(first[0].prefix_cache_hit_ratio)
    assert (first[0].prefix_cache_queries, first[0].prefix_cache_hits) == (1000, 100)
    clock.now += 1
    probe.figures[W0] = WorkerFigures(W0, True, prefix_cache_queries=1400, prefix_cache_hits=400)
    w0, w1 = (await dashboard.snapshot()).workers
    assert w0.prefix_cache_hit_ratio == 300 / 400
    assert (w0.prefix_cache_queries, w0.prefix_cache_hits) == (1400, 400)
    assert w1.error and math.isnan(w1.prefix_cache_hit_ratio)


async def test_workers_snapshot_carries_each_workers_load_and_asks_prometheus_nothing() -> None:
    clock = Clock()
    probe = FakeProbe(
        {
            W0: WorkerFigures(
                W0,
                True,
                running_requests=3,
                waiting_requests=5,
                kv_cache_usage=0.25,
                prefix_cache_queries=1000,
                prefix_cache_hits=100,
            )
        }
    )
    prometheus = FakePrometheus(PROMETHEUS_ANSWERS)
    dashboard = Dashboard(
        lambda: dict.fromkeys([W1, W0], ""),
        probe,
        prometheus,
        QUERIES,
        clock=lambda: 12.0,
        prefix_cache=PrefixCacheWindow(30.0, clock),
    )
    snapshot = await dashboard.workers_snapshot()
    assert snapshot.taken_unix_millis == 12_000
    assert probe.retained == [W0, W1]
    w0, w1 = snapshot.workers
    assert (w0.address, w0.serving, w0.running_requests, w0.waiting_requests) == (W0, True, 3, 5)
    assert (w0.kv_cache_usage, w0.error, w0.tokens_per_second) == (0.25, "", 0.0)
    assert (w0.prefix_cache_queries, w0.prefix_cache_hits) == (1000, 100)
    assert math.isnan(w0.prefix_cache_hit_ratio)
    assert (w1.address, w1.serving, w1.error) == (W1, False, "UNAVAILABLE: down")
    assert prometheus.queries == []
    # Its counts stay out of the dashboard's window: the dashboard's first look is still NaN.
    clock.now += 1
    probe.figures[W0] = WorkerFigures(W0, True, prefix_cache_queries=1400, prefix_cache_hits=400)
    assert math.isnan((await dashboard.snapshot()).workers[0].prefix_cache_hit_ratio)
    assert prometheus.queries, "the dashboard's snapshot asks Prometheus (the fake records it)"


@pytest.mark.parametrize(("duration", "seconds"), [("30s", 30), ("5m", 300), ("1h", 3600)])
def test_the_rate_window_the_hit_ratio_shares_is_read_in_seconds(
    duration: str, seconds: float
) -> None:
    assert duration_seconds(duration) == seconds


class StatsServicer(inference_pb2_grpc.InferenceServiceServicer):
    def __init__(self, prefix_cache_queries: int = 0, prefix_cache_hits: int = 0) -> None:
        self._prefix_cache = (prefix_cache_queries, prefix_cache_hits)

    async def GetEngineStats(self, request: Any, context: Any) -> inference_pb2.EngineStats:
        queries, hits = self._prefix_cache
        return inference_pb2.EngineStats(
            running_requests=4,
            waiting_requests=2,
            kv_cache_usage=0.5,
            prefix_cache_queries=queries,
            prefix_cache_hits=hits,
        )


async def test_grpc_probe_reads_health_and_engine_stats_and_reports_a_dead_worker() -> None:
    server = aio.server()
    inference_pb2_grpc.add_InferenceServiceServicer_to_server(StatsServicer(3000, 1200), server)
    health = Health(["tokenmesh.v1.InferenceService"])
    health.register(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await health.set_serving()
    # A probe's first call connects its channel, which a loaded machine can take over 1 s to do.
    probe = GrpcWorkerProbe(timeout_seconds=PROMPTLY, max_message_bytes=1 << 20)
    dead = f"127.0.0.1:{free_port()}"
    try:
        live = await probe.probe(f"127.0.0.1:{port}")
        assert live == WorkerFigures(
            f"127.0.0.1:{port}",
            True,
            4,
            2,
            0.5,
            prefix_cache_queries=3000,
            prefix_cache_hits=1200,
        )
        started = time.monotonic()
        gone = await probe.probe(dead)
        assert time.monotonic() - started < PROMPTLY + SLACK
        assert not gone.serving and gone.error.startswith(("UNAVAILABLE", "DEADLINE_EXCEEDED"))
        await health.servicer.set(
            "tokenmesh.v1.InferenceService", health_pb2.HealthCheckResponse.NOT_SERVING
        )
        assert not (await probe.probe(f"127.0.0.1:{port}")).serving
    finally:
        await probe.close()
        await server.stop(0)


@dataclass
class Ops:
    stub: ops_pb2_grpc.OpsServiceStub
    probe: FakeProbe
    prometheus: FakePrometheus
    registry: CollectorRegistry

    def subscriptions_ended(self, method: str) -> float:
        """The method's handlers that have returned, by the server's own metrics."""
        return sum(
            sample.value
            for metric in self.registry.collect()
            for sample in metric.samples
            if sample.name == "grpc_server_handled_total" and sample.labels["grpc_method"] == method
        )


@pytest.fixture
async def ops() -> AsyncIterator[Ops]:
    """OpsService behind the standard interceptors, on a real port: W0 answers, W1 does not."""
    probe = FakeProbe({W0: WorkerFigures(W0, True, running_requests=1, waiting_requests=2)})
    prometheus = FakePrometheus(PROMETHEUS_ANSWERS)
    dashboard = Dashboard(lambda: dict.fromkeys([W0, W1], ""), probe, prometheus, QUERIES)
    registry = CollectorRegistry()
    server = aio.server(interceptors=standard_interceptors(registry))
    ops_pb2_grpc.add_OpsServiceServicer_to_server(OpsServicer(dashboard), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield Ops(ops_pb2_grpc.OpsServiceStub(channel), probe, prometheus, registry)
    await server.stop(0)


async def read_then_leave(call: Any, count: int) -> tuple[list[Any], float]:
    """A subscription's first count snapshots and the seconds they took to arrive; then the
    caller goes away."""
    started = time.monotonic()
    snapshots = [await call.read() for _ in range(count)]
    elapsed = time.monotonic() - started
    call.cancel()
    return snapshots, elapsed


async def test_subscription_streams_a_snapshot_per_interval(ops: Ops) -> None:
    call = ops.stub.SubscribeDashboard(ops_pb2.DashboardRequest(interval_ms=100))
    snapshots, elapsed = await read_then_leave(call, 4)
    assert [s.workers[0].running_requests for s in snapshots] == [1, 1, 1, 1]
    # Three ticks of 100 ms after the first (the first one sooner: ticks fall on multiples of
    # the interval); the default 1 s ones would take over 2 s.
    assert 0.19 < elapsed < 1.5, elapsed


async def test_workers_stream_carries_every_workers_load_at_the_asked_interval(ops: Ops) -> None:
    call = ops.stub.SubscribeWorkers(ops_pb2.WorkersRequest(interval_ms=500))
    snapshots, elapsed = await read_then_leave(call, 3)
    for snapshot in snapshots:
        assert [
            (w.address, w.serving, w.running_requests, w.waiting_requests, w.error)
            for w in snapshot.workers
        ] == [(W0, True, 1, 2, ""), (W1, False, 0, 0, "UNAVAILABLE: down")]
    # Two ticks of 500 ms after the first (the first one sooner: ticks fall on multiples of
    # the interval); the default 200 ms ones would take at most 0.4 s.
    assert 0.5 < elapsed < 1.0 + SLACK, elapsed


async def test_subscribers_at_one_moment_share_a_round_of_probes() -> None:
    probe = FakeProbe({W0: WorkerFigures(W0, True, running_requests=1)})
    dashboard = Dashboard(lambda: dict.fromkeys([W0, W1], ""), probe, None, QUERIES)
    first, second = await asyncio.gather(dashboard.workers_snapshot(), dashboard.workers_snapshot())
    assert first == second and probe.calls == 2  # each worker once, not once per subscriber
    await asyncio.sleep(SHARED_ROUND_SECONDS * 2)
    await dashboard.workers_snapshot()
    assert probe.calls == 4


async def test_workers_stream_asks_prometheus_nothing(ops: Ops) -> None:
    call = ops.stub.SubscribeWorkers(ops_pb2.WorkersRequest(interval_ms=50))
    for _ in range(3):
        await call.read()
    call.cancel()
    assert ops.prometheus.queries == []
    # The same server's dashboard does ask it: the fake would have seen the workers' queries.
    dashboard = ops.stub.SubscribeDashboard(ops_pb2.DashboardRequest())
    await dashboard.read()
    dashboard.cancel()
    assert ops.prometheus.queries


@pytest.mark.parametrize(
    ("method", "request_", "limits"),
    [
        ("SubscribeDashboard", ops_pb2.DashboardRequest(interval_ms=5), "100..30000"),
        ("SubscribeWorkers", ops_pb2.WorkersRequest(interval_ms=49), "50..30000"),
        ("SubscribeWorkers", ops_pb2.WorkersRequest(interval_ms=30_001), "50..30000"),
    ],
)
async def test_bad_interval_fails_with_invalid_argument(
    ops: Ops, method: str, request_: Any, limits: str
) -> None:
    with pytest.raises(aio.AioRpcError) as caught:
        async for _ in getattr(ops.stub, method)(request_):
            pass
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    details = caught.value.details() or ""
    assert "interval_ms" in details and limits in details, details


@pytest.mark.parametrize(
    ("method", "request_"),
    [
        ("SubscribeDashboard", ops_pb2.DashboardRequest(interval_ms=100)),
        ("SubscribeWorkers", ops_pb2.WorkersRequest(interval_ms=100)),
    ],
)
async def test_stream_stops_probing_once_the_caller_goes_away(
    ops: Ops, method: str, request_: Any
) -> None:
    call = getattr(ops.stub, method)(request_)
    await call.read()
    call.cancel()
    # The cancel reaches the server and its handler returns (a handler that went on would
    # never be counted as handled).
    deadline = time.monotonic() + PROMPTLY
    while ops.subscriptions_ended(method) < 1:
        assert time.monotonic() < deadline, "the handler did not end after the caller left"
        await asyncio.sleep(0.01)
    calls = ops.probe.calls
    await asyncio.sleep(0.5)  # five intervals
    assert ops.probe.calls == calls, "the server kept probing after the caller left"


async def test_page_server_serves_the_built_page_and_says_how_to_build_it(tmp_path: Path) -> None:
    built, unbuilt = tmp_path / "dist", tmp_path / "missing"
    built.mkdir()
    (built / "index.html").write_text("<title>ops</title>")
    (built / "app.js").write_text("console.log(1)")
    (tmp_path / "secret.txt").write_text("no")
    servers = [PageServer(built, "127.0.0.1", 0), PageServer(unbuilt, "127.0.0.1", 0)]
    good, bad = [await server.start() for server in servers]
    try:
        async with aiohttp.ClientSession() as session:

            async def get(port: int, path: str) -> tuple[int, str]:
                async with session.get(f"http://127.0.0.1:{port}{path}") as reply:
                    return reply.status, await reply.text()

            assert await get(good, "/ops/") == (200, "<title>ops</title>")
            assert await get(good, "/ops/app.js") == (200, "console.log(1)")
            assert (await get(good, "/ops/%2E%2E%2Fsecret.txt"))[0] == 404
            assert (await get(good, "/ops/nothing.js"))[0] == 404
            assert await get(bad, "/ops/") == (404, NOT_BUILT)
    finally:
        for server in servers:
            await server.stop()


async def test_every_pools_workers_are_probed_and_named_with_their_pool_and_model() -> None:
    probe = FakeProbe(
        {
            W0: WorkerFigures(W0, True, model="tiny", held_adapters=("sql",)),
            W1: WorkerFigures(W1, True, model="other"),
        }
    )
    dashboard = Dashboard(lambda: {W1: "b", W0: ""}, probe, None, QUERIES)
    snapshot = await dashboard.snapshot()
    # The default pool first, then each further pool's, by address within a pool.
    assert [(w.address, w.pool, w.model) for w in snapshot.workers] == [
        (W0, "", "tiny"),
        (W1, "b", "other"),
    ]
    feed = await dashboard.workers_snapshot()
    assert [(w.address, w.pool) for w in feed.workers] == [(W0, ""), (W1, "b")]
    # What each engine holds, for the picker.
    assert [list(w.held_adapters) for w in feed.workers] == [["sql"], []]


def test_the_workers_are_every_worker_pools_endpoints_and_no_other_clusters() -> None:
    cache = SnapshotCache()
    cache.update(
        {
            "worker": [Endpoint("10.0.0.1", 50061)],
            "worker-b": [Endpoint("10.0.0.2", 50061)],
            "gateway": [Endpoint("10.0.0.3", 50051)],
            "worker_relay": [Endpoint("10.0.0.4", 1)],
        }
    )
    assert worker_addresses(cache) == {"10.0.0.1:50061": "", "10.0.0.2:50061": "b"}


async def test_each_model_and_adapter_has_its_streams_figures() -> None:
    dashboard = Dashboard(lambda: {}, FakeProbe({}), FakePrometheus(PROMETHEUS_ANSWERS), QUERIES)
    snapshot = await dashboard.snapshot()
    figures = {m.model: m for m in snapshot.models}
    assert list(figures) == ["tiny", "tiny-lora"]
    tiny, lora = figures["tiny"], figures["tiny-lora"]
    assert (tiny.tokens_per_second, tiny.streams_per_second) == (9.0, 2.0)
    assert tiny.failed_streams_per_second == 0.0
    assert (tiny.ttft_p50_seconds, tiny.ttft_p99_seconds) == (0.03, 0.2)
    assert (lora.tokens_per_second, lora.failed_streams_per_second) == (3.0, 0.5)
    # No stream started in the window: no TTFT, not zero.
    assert math.isnan(lora.ttft_p50_seconds) and math.isnan(lora.ttft_p99_seconds)
