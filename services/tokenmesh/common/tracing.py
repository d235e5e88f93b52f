"""OpenTelemetry tracing: a TracerProvider per service exporting over OTLP/gRPC; traceparent."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Sequence

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)

# W3C trace context (`traceparent`, `tracestate`), the headers Envoy and most tracers use.
PROPAGATOR = TraceContextTextMapPropagator()
TRACEPARENT = "traceparent"


class Tracing:
    """One service's tracing: on when an OTLP endpoint is set (a TracerProvider of its own, spans
    batched to the endpoint), off otherwise (a no-op tracer: no exporter, no spans recorded)."""

    def __init__(self, service_name: str, otlp_endpoint: str | None) -> None:
        self.service_name = service_name
        self._provider: TracerProvider | None = None
        self.tracer: Tracer = trace.NoOpTracer()
        if otlp_endpoint:
            self._provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service_name}))
            exporter = OTLPSpanExporter(
                endpoint=otlp_endpoint, insecure=not otlp_endpoint.startswith("https://")
            )
            # Batch delay, queue and batch sizes follow the standard OTEL_BSP_* variables.
            self._provider.add_span_processor(BatchSpanProcessor(exporter))
            self.tracer = self._provider.get_tracer("tokenmesh")

    @property
    def enabled(self) -> bool:
        return self._provider is not None

    async def shutdown(self) -> None:
        """Export the spans still queued, then stop (blocking work, so in a thread)."""
        if self._provider is not None:
            await asyncio.to_thread(self._provider.shutdown)
            self._provider = None


def extract(metadata: Iterable[tuple[str, str | bytes]] | None) -> otel_context.Context | None:
    """The trace context a caller sent in gRPC metadata, or None when it sent none."""
    if not metadata:
        return None
    carrier = {key: value for key, value in metadata if isinstance(value, str)}
    if TRACEPARENT not in carrier:
        return None
    return PROPAGATOR.extract(carrier)


def outgoing_metadata() -> Sequence[tuple[str, str]]:
    """`traceparent` (and `tracestate`) for the current span, to send with a call."""
    carrier: dict[str, str] = {}
    PROPAGATOR.inject(carrier)
    return tuple(carrier.items())


def trace_id_hex(span: trace.Span | None = None) -> str | None:
    """The trace id of span (default: the current span) as 32 hex digits, None when untraced."""
    context = (span or trace.get_current_span()).get_span_context()
    return trace.format_trace_id(context.trace_id) if context.is_valid else None
