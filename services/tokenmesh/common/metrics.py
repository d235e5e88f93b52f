"""Prometheus metrics shared by the services: the standard gRPC server and client sets, LLM
stream timing, and the HTTP endpoint that serves them. Every metric lives in a registry passed
in, never the process-global one, so tests and multiple servers in one process do not collide."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any
from wsgiref.simple_server import WSGIServer

from grpc import aio
from opentelemetry import context as otel_context
from opentelemetry.trace import Span, Tracer
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

from tokenmesh.common.outcome import INTERRUPTED, Deadline, final_code
from tokenmesh.common.tokens import token_count
from tokenmesh.v1 import token_pb2

# The logger of the per-token DEBUG lines (the log_tokens setting).
TOKEN_LOGGER = "tokenmesh.tokens"

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


class _GrpcMetricSet:
    """grpc_<side>_* metrics with go-grpc-prometheus names and labels, side being server or
    client: started, handled (by code), messages sent and received, and handling seconds."""

    def __init__(self, registry: CollectorRegistry, side: str) -> None:
        labels = ("grpc_type", "grpc_service", "grpc_method")
        where = f"on the {side}"
        self._started = Counter(
            f"grpc_{side}_started", f"RPCs started {where}.", labels, registry=registry
        )
        self._handled = Counter(
            f"grpc_{side}_handled",
            f"RPCs completed {where}, by status code.",
            (*labels, "grpc_code"),
            registry=registry,
        )
        self._sent = Counter(
            f"grpc_{side}_stream_msg_sent",
            f"Messages sent {where}.",
            labels,
            registry=registry,
        )
        self._received = Counter(
            f"grpc_{side}_stream_msg_received",
            f"Messages received {where}.",
            labels,
            registry=registry,
        )
        self._seconds = Histogram(
            f"grpc_{side}_handling_seconds",
            f"Time from RPC start to its end {where}.",
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


class GrpcServerMetrics(_GrpcMetricSet):
    """grpc_server_* metrics with go-grpc-prometheus names and labels."""

    def __init__(self, registry: CollectorRegistry) -> None:
        super().__init__(registry, "server")


class GrpcClientMetrics(_GrpcMetricSet):
    """grpc_client_* metrics (go-grpc-prometheus names), for calls to other services."""

    def __init__(self, registry: CollectorRegistry) -> None:
        super().__init__(registry, "client")


class StreamMetrics:
    """Token streams' timing and token counts (time to first token, inter-token latency, whole
    request duration, prompt and generated tokens); optionally each stream's queue_prefill and
    decode spans, and a DEBUG log line per token sent."""

    def __init__(
        self,
        registry: CollectorRegistry,
        tracer: Tracer | None = None,
        log_tokens: bool = False,
        by_model: bool = False,
    ) -> None:
        # by_model: every series has a `model` label, the model or adapter a stream names (the
        # workers', where every stream ends up whatever its path; bounded by what they serve).
        model = ["model"] if by_model else []
        self.by_model = by_model
        self.ttft = Histogram(
            "tokenmesh_ttft_seconds",
            "Time from receiving a request to sending its first token.",
            model,
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.itl = Histogram(
            "tokenmesh_inter_token_latency_seconds",
            "Time between consecutive tokens sent on one stream.",
            model,
            buckets=ITL_BUCKETS,
            registry=registry,
        )
        self.tokens = Counter(
            "tokenmesh_tokens_generated",
            "Tokens sent to callers.",
            model,
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "tokenmesh_prompt_tokens",
            "Prompt tokens of token streams (the worker counts them as a request's first token "
            "is sent; the gateway from the usage reported on a stream's last token).",
            model,
            registry=registry,
        )
        self.duration = Histogram(
            "tokenmesh_request_duration_seconds",
            "Time from receiving a token-stream request to its end, by gRPC status code.",
            ["grpc_code", *model],
            buckets=RPC_BUCKETS,
            registry=registry,
        )
        self._tracer = tracer
        self._token_log: logging.Logger | None = None
        if log_tokens:
            self._token_log = logging.getLogger(TOKEN_LOGGER)
            # The setting asks for these lines whatever the service's log level.
            self._token_log.setLevel(logging.DEBUG)

    def timer(
        self, context: aio.ServicerContext[Any, Any] | None = None, model: str = ""
    ) -> StreamTimer:
        """Start timing one stream (now is when its request arrived) of `model` (with
        by_model). With the RPC's context, the stream's duration and end are recorded when the
        RPC ends, however it ends."""
        return StreamTimer(self, context, self._tracer, self._token_log, model)

    def series(self, model: str) -> _Series:
        """The series one stream of `model` adds to, resolved once."""
        if not self.by_model:
            return _Series(self.ttft, self.itl, self.tokens, self.prompt_tokens, ())
        return _Series(
            self.ttft.labels(model),
            self.itl.labels(model),
            self.tokens.labels(model),
            self.prompt_tokens.labels(model),
            (model,),
        )


@dataclass(frozen=True)
class _Series:
    """One stream's series: its model's, or the unlabelled ones."""

    ttft: Histogram
    itl: Histogram
    tokens: Counter
    prompt_tokens: Counter
    # The duration's labels after its grpc_code.
    model: tuple[str, ...]


class StreamTimer:
    """Observes one stream: TTFT and inter-token gaps as its tokens are sent, its prompt tokens,
    and (with a tracer) a queue_prefill span up to the first token and a decode span after it.
    Everything optional is decided here, once per stream, never per token."""

    __slots__ = (
        "_completion_tokens",
        "_deadline",
        "_finished",
        "_last",
        "_metrics",
        "_parent",
        "_phase",
        "_prompt_counted",
        "_series",
        "_start",
        "_token_log",
        "_tracer",
    )

    def __init__(
        self,
        metrics: StreamMetrics,
        context: aio.ServicerContext[Any, Any] | None = None,
        tracer: Tracer | None = None,
        token_log: logging.Logger | None = None,
        model: str = "",
    ) -> None:
        self._metrics = metrics
        self._series = metrics.series(model)
        self._start = time.perf_counter()
        self._last: float | None = None
        self._prompt_counted = False
        # Whether the stream's last token (the one with a finish reason) was sent.
        self._finished = False
        self._completion_tokens = 0
        self._token_log = token_log
        self._tracer = tracer
        self._parent: otel_context.Context | None = None
        self._phase: Span | None = None
        self._deadline: Deadline | None = None
        if tracer is not None:
            self._parent = otel_context.get_current()
            self._phase = tracer.start_span("queue_prefill", context=self._parent)
        if context is not None:
            self._deadline = Deadline.of(context)
            context.add_done_callback(self._rpc_done)

    def token_sent(self, count: int = 1) -> None:
        """A message of `count` tokens was sent: the gap since the last message is its first
        token's, and the tokens that came with it follow at no gap."""
        now = time.perf_counter()
        series = self._series
        itl = series.itl
        if self._last is None:
            series.ttft.observe(now - self._start)
            if self._tracer is not None:
                self._next_phase()
        else:
            itl.observe(now - self._last)
        for _ in range(count - 1):
            itl.observe(0.0)
        self._last = now
        self._completion_tokens += count
        series.tokens.inc(count)
        if self._token_log is not None:
            self._token_log.debug(
                "token sent",
                extra={
                    "index": self._completion_tokens - count,
                    "tokens": count,
                    "sent_unix_nanos": time.time_ns(),
                    "since_request_seconds": round(now - self._start, 6),
                },
            )

    def sent(
        self, token: token_pb2.Token, tokens: int | None = None, prompt_tokens: int | None = None
    ) -> None:
        """A Token message was sent: times its tokens (`tokens`, or as many as it holds; none
        for an end-only message); counts the prompt's tokens once, from prompt_tokens or from
        the usage on the last message."""
        if prompt_tokens is None and token.finish_reason:
            prompt_tokens = token.usage.prompt_tokens
        if prompt_tokens is not None and not self._prompt_counted:
            self._prompt_counted = True
            self._series.prompt_tokens.inc(prompt_tokens)
            if self._phase is not None:
                self._phase.set_attribute("tokenmesh.prompt_tokens", prompt_tokens)
        count = token_count(token) if tokens is None else tokens
        if count:
            self.token_sent(count)
        if token.finish_reason:
            self._finished = True
        if token.finish_reason and self._phase is not None:
            reason = token_pb2.FinishReason.Name(token.finish_reason)
            self._phase.set_attribute("tokenmesh.finish_reason", reason)
            if token.finish_reason == token_pb2.FINISH_REASON_ABORTED:
                self._phase.add_event("aborted")

    def _next_phase(self) -> None:
        """First token: queue_prefill ends, decode begins."""
        assert self._tracer is not None and self._phase is not None
        self._phase.end()
        self._phase = self._tracer.start_span("decode", context=self._parent)

    def _rpc_done(self, context: aio.ServicerContext[Any, Any]) -> None:
        # An error has its code by now (the error-mapping interceptor aborted with it), but a
        # cancel is not always marked on the context yet: a token stream that ends without an
        # error and without its last token was cut short by the caller or the deadline.
        assert self._deadline is not None
        outcome = final_code(
            context, self._deadline, cut_short=context.cancelled() or not self._finished
        )
        duration = self._metrics.duration.labels(outcome, *self._series.model)
        duration.observe(time.perf_counter() - self._start)
        if self._phase is not None:
            self._phase.set_attribute("tokenmesh.completion_tokens", self._completion_tokens)
            if outcome in INTERRUPTED:
                self._phase.add_event("cancelled", {"tokenmesh.reason": outcome.lower()})
            self._phase.end()
            self._phase = None


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
