"""Prometheus metrics shared by the services: the standard gRPC server set, LLM stream timing,
and the HTTP endpoint that serves them. Every metric lives in a registry passed in, never the
process-global one, so tests and multiple servers in one process do not collide."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

# Time to first token: from 1 ms (cached, tiny model) to 30 s (long prefill under load).
TTFT_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 30.0,
)  # fmt: skip
# Inter-token latency: from 0.1 ms (small batches) to 2 s (stalled decode).
ITL_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075,
    0.1, 0.25, 0.5, 1.0, 2.0,
)  # fmt: skip
# Whole RPCs: from 1 ms (health, validation errors) to 10 min (long generations).
RPC_BUCKETS = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip


@dataclass(frozen=True)
class MethodMetrics:
    """The gRPC server metrics of one method, labels bound once so the per-message path is a
    plain increment."""

    started: Counter
    sent: Counter
    received: Counter
    handling_seconds: Histogram
    # The handled counter family and this method's label values; the code is known at the end.
    handled: Counter
    label_values: tuple[str, str, str]

    def finish(self, code: str, seconds: float) -> None:
        self.handled.labels(*self.label_values, code).inc()
        self.handling_seconds.observe(seconds)


class GrpcServerMetrics:
    """grpc_server_* metrics with go-grpc-prometheus names and labels."""

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ("grpc_type", "grpc_service", "grpc_method")
        self._started = Counter(
            "grpc_server_started", "RPCs started on the server.", labels, registry=registry
        )
        self._handled = Counter(
            "grpc_server_handled",
            "RPCs completed on the server, by status code.",
            (*labels, "grpc_code"),
            registry=registry,
        )
        self._sent = Counter(
            "grpc_server_stream_msg_sent",
            "Messages sent by the server (responses).",
            labels,
            registry=registry,
        )
        self._received = Counter(
            "grpc_server_stream_msg_received",
            "Messages received by the server (requests).",
            labels,
            registry=registry,
        )
        self._seconds = Histogram(
            "grpc_server_handling_seconds",
            "Time from RPC start to its end on the server.",
            labels,
            buckets=RPC_BUCKETS,
            registry=registry,
        )
        self._by_method: dict[str, MethodMetrics] = {}

    def for_method(self, full_method: str, grpc_type: str) -> MethodMetrics:
        """Metrics for '/package.Service/Method', created on first use."""
        cached = self._by_method.get(full_method)
        if cached is not None:
            return cached
        service, _, method = full_method.lstrip("/").partition("/")
        values = (grpc_type, service, method)
        metrics = MethodMetrics(
            started=self._started.labels(*values),
            sent=self._sent.labels(*values),
            received=self._received.labels(*values),
            handling_seconds=self._seconds.labels(*values),
            handled=self._handled,
            label_values=values,
        )
        self._by_method[full_method] = metrics
        return metrics


class StreamMetrics:
    """Time to first token, inter-token latency and generated tokens of token streams."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.ttft = Histogram(
            "tokenmesh_ttft_seconds",
            "Time from receiving a request to sending its first token.",
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.itl = Histogram(
            "tokenmesh_inter_token_latency_seconds",
            "Time between consecutive tokens sent on one stream.",
            buckets=ITL_BUCKETS,
            registry=registry,
        )
        self.tokens = Counter(
            "tokenmesh_tokens_generated",
            "Tokens sent to callers.",
            registry=registry,
        )

    def timer(self) -> StreamTimer:
        """Start timing one stream (now is when its request arrived)."""
        return StreamTimer(self)


class StreamTimer:
    """Observes one stream's TTFT and inter-token gaps as its tokens are sent."""

    __slots__ = ("_last", "_metrics", "_start")

    def __init__(self, metrics: StreamMetrics) -> None:
        self._metrics = metrics
        self._start = time.perf_counter()
        self._last: float | None = None

    def token_sent(self) -> None:
        now = time.perf_counter()
        if self._last is None:
            self._metrics.ttft.observe(now - self._start)
        else:
            self._metrics.itl.observe(now - self._last)
        self._last = now
        self._metrics.tokens.inc()


class MetricsEndpoint:
    """Serves a registry over HTTP at /metrics in a background thread."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        self._registry = registry
        self._host = host
        self._port = port
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> int:
        """Start serving; returns the bound port (useful with port 0), or -1 when disabled."""
        if self._port < 0:
            return -1
        self._server, self._thread = start_http_server(
            self._port, addr=self._host, registry=self._registry
        )
        return int(self._server.server_port)

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
