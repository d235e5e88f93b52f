"""A real OTLP/gRPC trace receiver for tests: the collector's TraceService on a grpc.aio server
in a thread of its own (so it answers whatever the test's event loop is doing)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from grpc import aio
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from tests.support import free_port


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    attributes: dict[str, Any]
    events: dict[str, dict[str, Any]] = field(default_factory=dict)


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


def _attributes(pairs: Any) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs}


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, sink: Callable[[list[ReceivedSpan]], None]) -> None:
        self._sink = sink

    async def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        received = []
        for resource_spans in request.resource_spans:
            service = str(_attributes(resource_spans.resource.attributes).get("service.name"))
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(
                        ReceivedSpan(
                            service=service,
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            kind=span.kind,
                            attributes=_attributes(span.attributes),
                            events={e.name: _attributes(e.attributes) for e in span.events},
                        )
                    )
        self._sink(received)
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpCollector:
    """Receives spans at `address` (give it as a service's OTLP endpoint) and keeps them."""

    def __init__(self) -> None:
        self.port = free_port()
        self._spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: aio.Server | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _keep(self, spans: list[ReceivedSpan]) -> None:
        with self._lock:
            self._spans.extend(spans)

    async def _start(self) -> None:
        self._server = aio.server()
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(
            _TraceService(self._keep), self._server
        )
        self._server.add_insecure_port(self.address)
        await self._server.start()

    def start(self) -> None:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)

    def stop(self) -> None:
        if self._server is not None:
            asyncio.run_coroutine_threadsafe(self._server.stop(0), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def spans(self, trace_id: str) -> list[ReceivedSpan]:
        with self._lock:
            return [span for span in self._spans if span.trace_id == trace_id]

    async def wait_for(
        self, trace_id: str, done: Callable[[list[ReceivedSpan]], bool], within: float = 20.0
    ) -> list[ReceivedSpan]:
        """The trace's spans once done(spans) holds; fails after `within` seconds."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            spans = self.spans(trace_id)
            if done(spans):
                return spans
            await asyncio.sleep(0.05)
        found = [(span.service, span.name) for span in self.spans(trace_id)]
        raise AssertionError(f"trace {trace_id} incomplete after {within}s: {found}")
