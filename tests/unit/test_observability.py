"""Client metrics, trace-context extraction and injection, stream spans and metrics, and the
per-RPC log line, through a real in-process server and channel (spans kept in memory)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc import aio
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from tokenmesh.common.channels import Dependency
from tokenmesh.common.errors import InvalidArgument
from tokenmesh.common.interceptors import standard_interceptors
from tokenmesh.common.logs import TraceIdFilter, configure_logging
from tokenmesh.common.metrics import TOKEN_LOGGER, GrpcClientMetrics, StreamMetrics
from tokenmesh.common.tracing import Tracing
from tokenmesh.gateway.client_interceptors import (
    ClientMetricsInterceptor,
    TraceContextClientInterceptor,
    for_every_arity,
)
from tokenmesh.gateway.core.workers import WorkerClient
from tokenmesh.localmesh.mesh import LocalMesh, LocalMeshSettings
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc, token_pb2

SERVICE = "tokenmesh.v1.InferenceService"
GENERATE = "tokenmesh.v1.InferenceService/Generate"
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


class StreamingServicer(inference_pb2_grpc.InferenceServiceServicer):
    """Behaves according to the prompt: "ok" (3 tokens, usage on the last), "endless" (a token
    every 5 ms until cancelled), "invalid" (INVALID_ARGUMENT before any token)."""

    def __init__(self, stream_metrics: StreamMetrics) -> None:
        self._stream_metrics = stream_metrics
        self.closed = asyncio.Event()

    async def Generate(self, request: Any, context: Any) -> AsyncIterator[token_pb2.Token]:
        timer = self._stream_metrics.timer(context)
        if request.prompt == "invalid":
            raise InvalidArgument("prompt", "is not allowed")
        try:
            index = 0
            while True:
                token = token_pb2.Token(index=index, token_id=index, text="x")
                if request.prompt == "ok" and index == 2:
                    token.finish_reason = token_pb2.FINISH_REASON_LENGTH
                    token.usage.prompt_tokens = 5
                    token.usage.completion_tokens = 3
                timer.sent(token, prompt_tokens=5)
                yield token
                if token.finish_reason:
                    return
                index += 1
                await asyncio.sleep(0.005)
        finally:
            self.closed.set()

    async def GetEngineStats(self, request: Any, context: Any) -> inference_pb2.EngineStats:
        return inference_pb2.EngineStats(running_requests=1)


class Harness:
    def __init__(self) -> None:
        self.spans = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(self.spans))
        self.tracer = provider.get_tracer("test")
        self.server_registry = CollectorRegistry()
        self.client_registry = CollectorRegistry()
        self.stream_metrics = StreamMetrics(self.server_registry, self.tracer, log_tokens=True)
        self.servicer = StreamingServicer(self.stream_metrics)
        self.client_interceptors = [
            *for_every_arity(ClientMetricsInterceptor(GrpcClientMetrics(self.client_registry))),
            *for_every_arity(TraceContextClientInterceptor()),
        ]

    def finished(self, name: str) -> list[ReadableSpan]:
        return [span for span in self.spans.get_finished_spans() if span.name == name]

    def client(self, name: str, method: str, grpc_type: str, **labels: str) -> float:
        values = {"grpc_service": SERVICE, "grpc_method": method, "grpc_type": grpc_type}
        return self.client_registry.get_sample_value(name, {**values, **labels}) or 0.0


@pytest.fixture
async def harness() -> AsyncIterator[tuple[Harness, str]]:
    h = Harness()
    server = aio.server(interceptors=standard_interceptors(h.server_registry, h.tracer))
    inference_pb2_grpc.add_InferenceServiceServicer_to_server(h.servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield h, f"127.0.0.1:{port}"
    await server.stop(0)


async def until(condition: Callable[[], Any], within: float = 10.0) -> Any:
    give_up = time.monotonic() + within
    while time.monotonic() < give_up:
        if result := condition():
            return result
        await asyncio.sleep(0.01)
    raise AssertionError("condition not met in time")


async def test_client_metrics_count_a_stream_and_a_unary_call(harness) -> None:
    h, address = harness
    async with aio.insecure_channel(address, interceptors=h.client_interceptors) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        tokens = [t async for t in stub.Generate(inference_pb2.InferenceRequest(prompt="ok"))]
        assert len(tokens) == 3
        await stub.GetEngineStats(inference_pb2.EngineStatsRequest())
        with pytest.raises(aio.AioRpcError):
            await stub.Generate(inference_pb2.InferenceRequest(prompt="invalid")).read()
    stream = ("Generate", "server_stream")
    await until(lambda: h.client("grpc_client_handled_total", *stream, grpc_code="OK"))
    assert h.client("grpc_client_started_total", *stream) == 2
    assert h.client("grpc_client_stream_msg_sent_total", *stream) == 2
    assert h.client("grpc_client_stream_msg_received_total", *stream) == 3
    await until(
        lambda: h.client("grpc_client_handled_total", *stream, grpc_code="INVALID_ARGUMENT")
    )
    assert h.client("grpc_client_handling_seconds_count", *stream) == 2
    unary = ("GetEngineStats", "unary")
    await until(lambda: h.client("grpc_client_handled_total", *unary, grpc_code="OK"))
    assert h.client("grpc_client_stream_msg_received_total", *unary) == 1
    assert h.client("grpc_client_stream_msg_sent_total", *unary) == 1


async def test_closing_the_gateway_worker_stream_cancels_the_call_through_the_interceptors(
    harness,
) -> None:
    h, address = harness
    worker = Dependency("worker", address, 4 * 1024 * 1024, h.client_interceptors)
    try:
        tokens = WorkerClient(worker, 2.0).stream(
            inference_pb2.InferenceRequest(prompt="endless"), None
        )
        assert (await anext(tokens)).index == 0
        await tokens.aclose()
        # The server-side handler is closed because the call was cancelled, not left running.
        await asyncio.wait_for(h.servicer.closed.wait(), 5)
        stream = ("Generate", "server_stream")
        await until(lambda: h.client("grpc_client_handled_total", *stream, grpc_code="CANCELLED"))
        assert h.client("grpc_client_started_total", *stream) == 1
    finally:
        await worker.close()
    (span,) = await until(lambda: h.finished(GENERATE))
    assert [event.name for event in span.events] == ["cancelled"]
    assert span.attributes["rpc.grpc.status_code"] == grpc.StatusCode.CANCELLED.value[0]


async def test_server_span_continues_the_callers_traceparent(harness) -> None:
    h, address = harness
    async with aio.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        request = inference_pb2.InferenceRequest(prompt="ok")
        async for _ in stub.Generate(request, metadata=(("traceparent", TRACEPARENT),)):
            pass
        async for _ in stub.Generate(request):
            pass
    spans = await until(lambda: len(h.finished(GENERATE)) == 2 and h.finished(GENERATE))
    continued, fresh = spans
    assert trace.format_trace_id(continued.context.trace_id) == TRACE_ID
    assert continued.parent is not None
    assert trace.format_span_id(continued.parent.span_id) == PARENT_ID
    assert continued.kind is trace.SpanKind.SERVER
    assert continued.attributes["rpc.grpc.status_code"] == 0
    # The next RPC on the server starts its own trace: nothing leaks between RPCs.
    assert fresh.parent is None
    assert fresh.context.trace_id != continued.context.trace_id


async def test_client_injects_the_current_span_as_traceparent(harness) -> None:
    h, address = harness
    async with aio.insecure_channel(address, interceptors=h.client_interceptors) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        with h.tracer.start_as_current_span("caller") as caller:
            await stub.GetEngineStats(inference_pb2.EngineStatsRequest())
    (server,) = await until(lambda: h.finished("tokenmesh.v1.InferenceService/GetEngineStats"))
    assert server.context.trace_id == caller.get_span_context().trace_id
    assert server.parent is not None and server.parent.span_id == caller.get_span_context().span_id


async def test_stream_spans_and_metrics_of_a_finished_stream(harness) -> None:
    h, address = harness
    async with aio.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        async for _ in stub.Generate(inference_pb2.InferenceRequest(prompt="ok")):
            pass
    (server,) = await until(lambda: h.finished(GENERATE))
    (prefill,) = await until(lambda: h.finished("queue_prefill"))
    (decode,) = await until(lambda: h.finished("decode"))
    for phase in (prefill, decode):
        assert phase.parent is not None and phase.parent.span_id == server.context.span_id
    assert prefill.end_time <= decode.start_time
    assert decode.attributes["tokenmesh.finish_reason"] == "FINISH_REASON_LENGTH"
    assert decode.attributes["tokenmesh.completion_tokens"] == 3
    assert prefill.attributes["tokenmesh.prompt_tokens"] == 5
    registry = h.server_registry
    assert registry.get_sample_value("tokenmesh_prompt_tokens_total") == 5
    assert registry.get_sample_value("tokenmesh_tokens_generated_total") == 3
    count = "tokenmesh_request_duration_seconds_count"
    assert await until(lambda: registry.get_sample_value(count, {"grpc_code": "OK"})) == 1


async def test_cancelled_stream_records_the_event_and_its_duration(harness) -> None:
    h, address = harness
    async with aio.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        call = stub.Generate(inference_pb2.InferenceRequest(prompt="endless"))
        await call.read()
        await call.read()
        call.cancel()
    (decode,) = await until(lambda: h.finished("decode"))
    (event,) = decode.events
    assert event.name == "cancelled" and event.attributes["tokenmesh.reason"] == "cancelled"
    count = "tokenmesh_request_duration_seconds_count"
    registry = h.server_registry
    assert await until(lambda: registry.get_sample_value(count, {"grpc_code": "CANCELLED"})) == 1


async def test_deadline_is_recorded_as_deadline_exceeded(harness) -> None:
    h, address = harness
    async with aio.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        # Long enough for the handler to have started on a busy machine.
        call = stub.Generate(inference_pb2.InferenceRequest(prompt="endless"), timeout=1.0)
        with pytest.raises(aio.AioRpcError):
            async for _ in call:
                pass
    (decode,) = await until(lambda: h.finished("decode"))
    assert decode.events[0].attributes["tokenmesh.reason"] == "deadline_exceeded"
    (server,) = await until(lambda: h.finished(GENERATE))
    assert server.status.status_code is trace.StatusCode.ERROR


async def test_one_log_line_per_rpc_with_code_duration_tokens_and_trace_id(
    harness, caplog: pytest.LogCaptureFixture
) -> None:
    _, address = harness
    caplog.set_level(logging.INFO, logger="tokenmesh.common.interceptors")
    async with aio.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        request = inference_pb2.InferenceRequest(prompt="ok")
        metadata = (("traceparent", TRACEPARENT), ("x-request-id", "req-1"))
        began = time.time_ns() // 1000
        async for _ in stub.Generate(request, metadata=metadata):
            pass
        with pytest.raises(aio.AioRpcError):
            await stub.Generate(inference_pb2.InferenceRequest(prompt="invalid")).read()

    def lines() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.name == "tokenmesh.common.interceptors"]

    ok, invalid = await until(lambda: len(lines()) == 2 and lines())
    assert ok.method == "/tokenmesh.v1.InferenceService/Generate"
    assert ok.grpc_code == "OK" and invalid.grpc_code == "INVALID_ARGUMENT"
    assert ok.duration_ms >= 0 and ok.messages_sent == 3
    assert (ok.prompt_tokens, ok.completion_tokens) == (5, 3)
    assert ok.trace_id == TRACE_ID
    assert not hasattr(invalid, "completion_tokens")
    # Envoy's request id, and when the handler began: the line joins Envoy's of the request.
    assert ok.request_id == "req-1" and not hasattr(invalid, "request_id")
    assert began <= ok.start_unix_us <= invalid.start_unix_us


async def test_per_token_debug_lines_when_log_tokens_is_on(
    harness, caplog: pytest.LogCaptureFixture
) -> None:
    _, address = harness
    caplog.set_level(logging.DEBUG, logger=TOKEN_LOGGER)
    async with aio.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        async for _ in stub.Generate(inference_pb2.InferenceRequest(prompt="ok")):
            pass
    records = [r for r in caplog.records if r.name == TOKEN_LOGGER]
    assert [r.index for r in records] == [0, 1, 2]
    assert all(r.levelno == logging.DEBUG and r.sent_unix_nanos > 0 for r in records)


def test_tracing_off_without_an_endpoint_and_on_with_one() -> None:
    off = Tracing("tokenmesh-test", None)
    assert not off.enabled
    assert not off.tracer.start_span("x").get_span_context().is_valid
    on = Tracing("tokenmesh-test", "127.0.0.1:1")
    assert on.enabled
    assert on.tracer.start_span("x").get_span_context().is_valid
    asyncio.run(on.shutdown())


def test_log_records_get_the_current_trace_id() -> None:
    provider = TracerProvider()
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "m", None, None)
    with provider.get_tracer("t").start_as_current_span("s") as span:
        assert TraceIdFilter().filter(record)
    assert record.trace_id == trace.format_trace_id(span.get_span_context().trace_id)
    outside = logging.LogRecord("x", logging.INFO, __file__, 1, "m", None, None)
    TraceIdFilter().filter(outside)
    assert not hasattr(outside, "trace_id")


def test_json_log_line_carries_the_rpc_fields_and_trace_id(
    capsys: pytest.CaptureFixture[str],
) -> None:
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    provider = TracerProvider()
    try:
        configure_logging("INFO", "json")
        with provider.get_tracer("t").start_as_current_span("s") as span:
            logging.getLogger("tokenmesh.common.interceptors").info(
                "rpc done", extra={"method": "/a.B/C", "grpc_code": "OK", "duration_ms": 1.5}
            )
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)
    line = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert line["method"] == "/a.B/C" and line["grpc_code"] == "OK"
    assert line["level"] == "INFO" and line["duration_ms"] == 1.5
    assert line["trace_id"] == trace.format_trace_id(span.get_span_context().trace_id)


def test_local_mesh_sends_the_otlp_endpoint_to_every_traced_service(tmp_path: Path) -> None:
    local_mesh = LocalMesh(
        LocalMeshSettings(otlp_endpoint="127.0.0.1:4317", workers=1, adapter_pool=False),
        root=tmp_path,
    )
    traced = {
        program.name: value
        for program in local_mesh.programs
        for key, value in program.env.items()
        if key.endswith("_OTLP_ENDPOINT")
    }
    assert traced == {
        "worker-0": "127.0.0.1:4317",
        "reranker": "127.0.0.1:4317",
        "gateway-0": "127.0.0.1:4317",
        "gateway-1": "127.0.0.1:4317",
    }
    untraced = LocalMesh(LocalMeshSettings(workers=1), root=tmp_path)
    assert not any("OTLP" in key for program in untraced.programs for key in program.env)


def test_stream_metrics_by_model_label_each_streams_series_with_its_model() -> None:
    registry = CollectorRegistry()
    metrics = StreamMetrics(registry, by_model=True)
    for model, tokens in (("base", 3), ("sql", 2), ("sql", 4)):
        timer = metrics.timer(model=model)
        for _ in range(tokens - 1):
            timer.sent(token_pb2.Token(text="x"))
        timer.sent(
            token_pb2.Token(
                text="x",
                finish_reason=token_pb2.FINISH_REASON_LENGTH,
                usage=token_pb2.Usage(prompt_tokens=5),
            )
        )

    def value(name: str, model: str) -> float | None:
        return registry.get_sample_value(name, {"model": model})

    assert value("tokenmesh_tokens_generated_total", "base") == 3
    assert value("tokenmesh_tokens_generated_total", "sql") == 6
    assert value("tokenmesh_prompt_tokens_total", "sql") == 10
    assert value("tokenmesh_ttft_seconds_count", "sql") == 2
    assert value("tokenmesh_ttft_seconds_count", "base") == 1
    # Without the label, the same series unlabelled.
    plain = CollectorRegistry()
    StreamMetrics(plain).timer().sent(token_pb2.Token(text="x"))
    assert plain.get_sample_value("tokenmesh_tokens_generated_total") == 1
