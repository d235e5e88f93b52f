"""Server interceptors shared by every service: error mapping and the standard gRPC metrics.

Handlers must be coroutines (unary responses) or async generators (streamed responses), the
grpc.aio idioms this code base uses; the wrappers below keep that shape.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from grpc import aio
from prometheus_client import CollectorRegistry

from tokenmesh.common.errors import ServiceError
from tokenmesh.common.metrics import GrpcServerMetrics, MethodMetrics

log = logging.getLogger(__name__)

UnaryBehaviour = Callable[[Any, aio.ServicerContext[Any, Any]], Awaitable[Any]]
StreamBehaviour = Callable[[Any, aio.ServicerContext[Any, Any]], AsyncIterator[Any]]


def rpc_type(handler: grpc.RpcMethodHandler) -> str:
    """The grpc_type label value for a handler: unary, client_stream, server_stream, bidi_stream."""
    if handler.request_streaming and handler.response_streaming:
        return "bidi_stream"
    if handler.request_streaming:
        return "client_stream"
    if handler.response_streaming:
        return "server_stream"
    return "unary"


async def close(responses: AsyncIterator[Any]) -> None:
    """Close a handler's response generator now. When gRPC closes a wrapper (the caller went
    away while it was paused at a yield), `async for` would leave the inner generator open
    until garbage collection; its cleanup, such as aborting engine work, must run at once."""
    aclose = getattr(responses, "aclose", None)
    if aclose is not None:
        await aclose()


def rewrap(
    handler: grpc.RpcMethodHandler,
    wrap_unary: Callable[[UnaryBehaviour], UnaryBehaviour],
    wrap_stream: Callable[[StreamBehaviour], StreamBehaviour],
) -> grpc.RpcMethodHandler:
    """A copy of handler whose behaviour is wrapped: wrap_unary for unary responses,
    wrap_stream for streamed responses."""
    serializers = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(wrap_unary(handler.unary_unary), **serializers)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(wrap_unary(handler.stream_unary), **serializers)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(
            wrap_stream(handler.unary_stream), **serializers
        )
    return grpc.stream_stream_rpc_method_handler(wrap_stream(handler.stream_stream), **serializers)


async def _abort_for(exc: Exception, context: aio.ServicerContext[Any, Any], method: str) -> None:
    """End the RPC with the status that exc stands for."""
    if isinstance(exc, ServiceError):
        await context.abort(exc.code, exc.message)
    log.exception("unhandled error in %s", method)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")


class ErrorMappingInterceptor(aio.ServerInterceptor):
    """Turns ServiceError into its status code and any other exception into INTERNAL, so
    handlers raise domain errors and never pick status codes themselves."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method

        def wrap_unary(behaviour: UnaryBehaviour) -> UnaryBehaviour:
            async def unary(request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
                try:
                    return await behaviour(request, context)
                except aio.AbortError:
                    raise
                except Exception as exc:
                    await _abort_for(exc, context, method)

            return unary

        def wrap_stream(behaviour: StreamBehaviour) -> StreamBehaviour:
            async def stream(request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
                responses = behaviour(request, context)
                try:
                    async for response in responses:
                        yield response
                except aio.AbortError:
                    raise
                except Exception as exc:
                    await _abort_for(exc, context, method)
                finally:
                    await close(responses)

            return stream

        return rewrap(handler, wrap_unary, wrap_stream)


# A caller whose deadline passes resets the stream itself, usually a moment before the server's
# own deadline timer fires; a cancel this close to the deadline is the deadline passing.
DEADLINE_SLACK_SECONDS = 0.1


class Deadline:
    """An RPC's deadline, read when the RPC starts (the context's view of it is not reliable
    once the RPC has been cancelled), to tell later whether a cancel was the deadline."""

    __slots__ = ("_at",)

    def __init__(self, context: aio.ServicerContext[Any, Any]) -> None:
        remaining = context.time_remaining()
        self._at = None if remaining is None else time.monotonic() + remaining

    def passed(self) -> bool:
        """Whether the deadline has (all but) passed."""
        return self._at is not None and time.monotonic() >= self._at - DEADLINE_SLACK_SECONDS


def _final_code(
    context: aio.ServicerContext[Any, Any], deadline: Deadline, exc: BaseException | None
) -> str:
    """The status code an RPC ended with, as the grpc_code label value."""
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        return "DEADLINE_EXCEEDED" if deadline.passed() else "CANCELLED"
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return str(code.name)
    if exc is not None and not isinstance(exc, aio.AbortError):
        return "UNKNOWN"
    return "OK"


class _CountingIterator:
    """Wraps a request stream to count received messages."""

    def __init__(self, requests: AsyncIterator[Any], metrics: MethodMetrics) -> None:
        self._requests = requests
        self._metrics = metrics

    def __aiter__(self) -> _CountingIterator:
        return self

    async def __anext__(self) -> Any:
        message = await self._requests.__anext__()
        self._metrics.received.inc()
        return message


class GrpcMetricsInterceptor(aio.ServerInterceptor):
    """Records grpc_server_started/handled/msg_sent/msg_received/handling_seconds per method,
    the names and labels of go-grpc-prometheus so standard dashboards work unchanged."""

    def __init__(self, metrics: GrpcServerMetrics) -> None:
        self._metrics = metrics

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        metrics = self._metrics.for_method(handler_call_details.method, rpc_type(handler))
        request_streaming = handler.request_streaming

        def counted(request: Any) -> Any:
            if request_streaming:
                return _CountingIterator(request, metrics)
            metrics.received.inc()
            return request

        def wrap_unary(behaviour: UnaryBehaviour) -> UnaryBehaviour:
            async def unary(request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
                metrics.started.inc()
                start = time.perf_counter()
                deadline = Deadline(context)
                error: BaseException | None = None
                try:
                    response = await behaviour(counted(request), context)
                    metrics.sent.inc()
                    return response
                except BaseException as exc:
                    error = exc
                    raise
                finally:
                    code = _final_code(context, deadline, error)
                    metrics.finish(code, time.perf_counter() - start)

            return unary

        def wrap_stream(behaviour: StreamBehaviour) -> StreamBehaviour:
            async def stream(request: Any, context: aio.ServicerContext[Any, Any]) -> Any:
                metrics.started.inc()
                start = time.perf_counter()
                deadline = Deadline(context)
                error: BaseException | None = None
                responses = behaviour(counted(request), context)
                try:
                    async for response in responses:
                        metrics.sent.inc()
                        yield response
                except BaseException as exc:
                    error = exc
                    raise
                finally:
                    await close(responses)
                    code = _final_code(context, deadline, error)
                    metrics.finish(code, time.perf_counter() - start)

            return stream

        return rewrap(handler, wrap_unary, wrap_stream)


def standard_interceptors(registry: CollectorRegistry) -> list[aio.ServerInterceptor]:
    """Every service's interceptors, outermost first: metrics see the final status code that
    error mapping produced."""
    return [GrpcMetricsInterceptor(GrpcServerMetrics(registry)), ErrorMappingInterceptor()]
