"""OpenAI's HTTP API (models, completions, chat completions) over the gateway's own pipeline."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import uvicorn
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Tracer
from prometheus_client import CollectorRegistry, Counter, Histogram
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from tokenmesh.common.channels import Dependency
from tokenmesh.common.credentials import ReloadingSslContext
from tokenmesh.common.errors import DependencyError, InvalidArgument, NotFound
from tokenmesh.common.metrics import RPC_BUCKETS, StreamMetrics
from tokenmesh.common.openai_answers import (
    DONE,
    EventStream,
    Shape,
    WholeAnswer,
    error_response,
)
from tokenmesh.common.tenants import enter_tenant
from tokenmesh.common.tokens import DEGRADED_BY_RERANKER, DEGRADED_HEADER
from tokenmesh.common.tracing import extract
from tokenmesh.gateway.auth import KeyStore, resolve_tenant
from tokenmesh.gateway.config import GatewaySettings
from tokenmesh.gateway.limits import TenantLimiter, admit_counted
from tokenmesh.gateway.openai_protocol import ChatCompletionRequest, CompletionRequest, parse
from tokenmesh.gateway.pipeline import Pipeline, PreparedPrompt, Prompt
from tokenmesh.gateway.prompts import Conversation
from tokenmesh.gateway.requests import generation_job
from tokenmesh.gateway.tenant_metrics import TenantMetrics
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc, token_pb2

log = logging.getLogger(__name__)

# How long the served model's name is trusted before the workers are asked again.
MODEL_NAME_TTL_SECONDS = 30.0


class ModelCatalog:
    """The model the workers serve (their served_model_name), asked of a worker through the
    mesh and cached: what /v1/models lists and what a request's `model` must name."""

    def __init__(self, worker: Dependency, timeout: float) -> None:
        self._stub = inference_pb2_grpc.InferenceServiceStub(worker.channel)
        self._timeout = timeout
        self._name: str | None = None
        self._asked = 0.0
        self._max_model_len = 0

    async def name(self) -> str:
        if self._name is None or time.monotonic() - self._asked > MODEL_NAME_TTL_SECONDS:
            try:
                stats = await self._stub.GetEngineStats(
                    inference_pb2.EngineStatsRequest(), timeout=self._timeout
                )
            except grpc.aio.AioRpcError as exc:
                if self._name is not None:
                    return self._name  # the last answer stands while no worker answers
                raise DependencyError(
                    exc.code(), f"no worker answered for the model's name: {exc.details()}"
                ) from exc
            self._name, self._asked = stats.model, time.monotonic()
            self._max_model_len = stats.max_model_len
        return self._name

    async def check(self, requested: str) -> str:
        served = await self.name()
        if requested != served:
            raise ModelNotFound(
                f"the model {requested!r} does not exist; this mesh serves {served!r}"
            )
        return served

    @property
    def max_model_len(self) -> int:
        return self._max_model_len


class ModelNotFound(NotFound):
    field = "model"


@dataclass(frozen=True)
class HttpTenancy:
    """API keys and tenant limits for HTTP requests: the gRPC interceptors' own checks."""

    store: KeyStore | None = None
    limiter: TenantLimiter | None = None
    metrics: TenantMetrics | None = None

    async def admit(self, headers: list[tuple[str, str]]) -> Callable[[], None] | None:
        """Authenticate and admit a request (the tenant becomes the request's); what lets it
        out, or None with keys off."""
        if self.store is None or self.metrics is None or self.limiter is None:
            return None
        tenant = resolve_tenant(self.store, headers, self.metrics)
        enter_tenant(tenant)
        return await admit_counted(self.limiter, self.metrics, tenant)


class HttpMetrics:
    """OpenAI API requests: those this gateway answered, and those it prepared for Envoy to
    take straight from a worker (recorded from Envoy's access log, gateway/accesslog.py)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "tokenmesh_gateway_http_requests_total",
            "OpenAI API requests by route and HTTP status (499: the client went away).",
            ["route", "status"],
            registry=registry,
        )
        self.duration = Histogram(
            "tokenmesh_gateway_http_request_duration_seconds",
            "OpenAI API requests, from the request to the end of the answer.",
            ["route"],
            buckets=RPC_BUCKETS,
            registry=registry,
        )


@dataclass
class Outcome:
    """What became of one request, for its log line, metrics and span."""

    status: int = 200
    error: str | None = None


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class Answer(Response):
    """The answer to one request, written by `work` (which sends the response itself). A
    client that goes away at any point, before the first token or in the middle of the
    stream, cancels `work`, and with it the worker call, which aborts the engine request."""

    def __init__(self, work: Callable[[Send], Awaitable[None]], outcome: Outcome) -> None:
        self._work = work
        self._outcome = outcome

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        work = asyncio.ensure_future(self._work(send))
        gone = asyncio.ensure_future(_until_disconnect(receive))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            # Whether the answer was all sent: once it is, the server reports a disconnect
            # at once, which must not count as the client going away.
            answered = work.done()
            for task in (work, gone):
                task.cancel()
            await asyncio.gather(work, gone, return_exceptions=True)
        if not answered:
            self._outcome.status = 499
            self._outcome.error = "client disconnected"
        elif not work.cancelled() and work.exception() is not None:
            raise work.exception()  # type: ignore[misc]


async def send_json(
    send: Send,
    status: int,
    body: Any,
    headers: list[tuple[bytes, bytes]] = (),  # type: ignore[assignment]
) -> None:
    data = json.dumps(body, separators=(",", ":")).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(data)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": data})


@dataclass(frozen=True)
class PreparedAnswer:
    """A request validated and prepared: its answer's shape, and what the worker gets."""

    shape: Shape
    prompt: Prompt
    sampling: inference_pb2.SamplingParams
    prepared: PreparedPrompt
    headers: list[tuple[bytes, bytes]]

    @property
    def degraded(self) -> bool:
        return self.prepared.degraded


@dataclass
class Job:
    """One request, validated: its shape, and the pipeline's tokens for it."""

    shape: Shape
    tokens: AsyncGenerator[token_pb2.Token, None]
    prepared: PreparedPrompt
    logprobs: bool
    include_usage: bool
    release: Callable[[], None] | None
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)


class OpenAIApi:
    """The routes, each: authenticate and admit as gRPC calls are, validate with the same
    limits, prepare (rerank) and stream through the same pipeline, answer in OpenAI's shapes."""

    def __init__(
        self,
        pipeline: Pipeline,
        settings: GatewaySettings,
        stream_metrics: StreamMetrics,
        catalog: ModelCatalog,
        tenancy: HttpTenancy,
        tracer: Tracer,
        metrics: HttpMetrics,
        serving: Callable[[], bool],
    ) -> None:
        self._serving = serving
        self._pipeline = pipeline
        self._settings = settings
        self._stream_metrics = stream_metrics
        self._catalog = catalog
        self._tenancy = tenancy
        self._tracer = tracer
        self._metrics = metrics

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/models", self._observed("/v1/models", self.models), methods=["GET"]),
                Route(
                    "/v1/completions",
                    self._observed("/v1/completions", self.completions),
                    methods=["POST"],
                ),
                Route(
                    "/v1/chat/completions",
                    self._observed("/v1/chat/completions", self.chat_completions),
                    methods=["POST"],
                ),
                Route("/health", self.health, methods=["GET"]),
            ]
        )

    async def health(self, request: Request) -> Response:
        """Envoy's health check of this port: the gateway's gRPC health, as HTTP."""
        if self._serving():
            return Response(b"SERVING", media_type="text/plain")
        return Response(b"NOT_SERVING", 503, media_type="text/plain")

    def _observed(
        self, route: str, handler: Callable[[Request, Outcome], Awaitable[Response]]
    ) -> Callable[[Request], Awaitable[Response]]:
        """The route with its span, log line and metrics, all ended when the answer has been
        sent (a streamed answer's last chunk), not when the handler returns."""

        async def endpoint(request: Request) -> Response:
            outcome = Outcome()
            started = time.perf_counter()
            span = self._tracer.start_span(
                f"{request.method} {route}",
                context=extract(_headers(request)),
                kind=SpanKind.SERVER,
            )
            # The span stays current until the answer has been sent (_Finishing detaches it):
            # the worker call, made while streaming, is its child.
            attached = otel_context.attach(trace.set_span_in_context(span))
            try:
                response = await handler(request, outcome)
            except Exception as exc:  # errors before the answer began
                status, body, extra = error_response(exc)
                outcome.status, outcome.error = status, body["error"]["message"]
                response = JSONResponse(
                    body, status, headers={k.decode(): v.decode() for k, v in extra}
                )
            return _Finishing(response, lambda: self._done(route, outcome, started, span, attached))

        return endpoint

    def _done(
        self,
        route: str,
        outcome: Outcome,
        started: float,
        span: trace.Span,
        attached: object,
    ) -> None:
        otel_context.detach(attached)  # type: ignore[arg-type]
        seconds = time.perf_counter() - started
        self._metrics.requests.labels(route, str(outcome.status)).inc()
        self._metrics.duration.labels(route).observe(seconds)
        span.set_attribute("http.response.status_code", outcome.status)
        if outcome.status >= 500:
            span.set_status(trace.StatusCode.ERROR, outcome.error)
        span.end()
        level = logging.INFO if outcome.status < 500 else logging.WARNING
        log.log(
            level,
            "http %s %d %.1f ms",
            route,
            outcome.status,
            seconds * 1000,
            extra={"route": route, "status": outcome.status, "error": outcome.error},
        )

    async def models(self, request: Request, outcome: Outcome) -> Response:
        release = await self._tenancy.admit(_headers(request))
        try:
            name = await self._catalog.name()
        finally:
            if release is not None:
                release()
        card = {"id": name, "object": "model", "created": 0, "owned_by": "tokenmesh"}
        if self._catalog.max_model_len:
            card["max_model_len"] = self._catalog.max_model_len
        return JSONResponse({"object": "list", "data": [card]})

    async def completions(self, request: Request, outcome: Outcome) -> Response:
        body = parse(CompletionRequest, await request.body())
        return await self._answer(request, body, outcome)

    async def chat_completions(self, request: Request, outcome: Outcome) -> Response:
        body = parse(ChatCompletionRequest, await request.body())
        return await self._answer(request, body, outcome)

    async def _answer(
        self,
        request: Request,
        body: CompletionRequest | ChatCompletionRequest,
        outcome: Outcome,
    ) -> Response:
        release = await self._tenancy.admit(_headers(request))
        try:
            job = await self._job(body, release)
        except BaseException:
            if release is not None:
                release()
            raise
        if body.stream:
            return Answer(lambda send: self._stream(send, job, outcome), outcome)
        return Answer(lambda send: self._whole(send, job, outcome), outcome)

    async def _job(
        self, body: CompletionRequest | ChatCompletionRequest, release: Callable[[], None] | None
    ) -> Job:
        answer = await self.prepare(body)
        tokens = self._pipeline.stream(
            answer.prompt, answer.sampling, self._settings.http_request_timeout_seconds
        )
        return Job(
            shape=answer.shape,
            tokens=tokens,
            prepared=answer.prepared,
            logprobs=answer.sampling.logprobs,
            include_usage=body.include_usage,
            release=release,
            headers=answer.headers,
        )

    async def prepare(self, body: CompletionRequest | ChatCompletionRequest) -> PreparedAnswer:
        """Validate a request with the gRPC API's limits and prepare its prompt (reranked
        context, the conversation for the chat template): for this API's own answers and for
        the workers' (the edge's external processor)."""
        settings = self._settings
        chat = isinstance(body, ChatCompletionRequest)
        model = await self._catalog.check(body.model)
        generate = body.generate_request(settings.max_tokens_cap)
        if isinstance(body, ChatCompletionRequest):
            # Named as the caller wrote them, before the last user message is checked as the
            # Generate's prompt.
            if len(body.messages) > settings.max_chat_messages:
                raise InvalidArgument(
                    "messages",
                    f"more than the limit of {settings.max_chat_messages} messages",
                )
            for position, message in enumerate(body.messages):
                size = len(message.text().encode())
                if size > settings.max_chat_message_bytes:
                    raise InvalidArgument(
                        f"messages[{position}].content",
                        f"{size} bytes, more than the limit of {settings.max_chat_message_bytes}",
                    )
        job = generation_job(generate, settings)
        prepared = await self._pipeline.prepare(job, settings.http_request_timeout_seconds)
        extra: dict[str, Any] = {}
        headers: list[tuple[bytes, bytes]] = []
        if prepared.degraded or prepared.warnings:
            extra["tokenmesh"] = {
                "degraded": DEGRADED_BY_RERANKER if prepared.degraded else None,
                "warnings": list(prepared.warnings),
            }
        if prepared.degraded:
            headers.append((DEGRADED_HEADER.encode(), DEGRADED_BY_RERANKER.encode()))
        prompt: Prompt = prepared.prompt
        if isinstance(body, ChatCompletionRequest):
            # No plain fallback: a model without a chat template refuses a chat, as vLLM does.
            prompt = Conversation(
                body.conversation(prepared.context_question if prepared.documents else None)
            )
            # Without a limit, as vLLM's server: up to what the context leaves.
            job.sampling.max_tokens_within_context = body.max_tokens_named is None
        return PreparedAnswer(
            Shape.new(chat, model, extra), prompt, job.sampling, prepared, headers
        )

    async def _stream(self, send: Send, job: Job, outcome: Outcome) -> None:
        events = EventStream(job.shape, job.logprobs, job.include_usage)
        timer = self._stream_metrics.timer()
        try:
            async with contextlib.aclosing(job.tokens) as tokens:
                # The first token before the response: a request the worker refuses (or no
                # worker) gets its HTTP status, not a 200 with an error inside.
                try:
                    token = await anext(tokens, None)
                except Exception as exc:
                    await self._fail(send, exc, outcome)
                    return
                await send(
                    {
                        "type": "http.response.start",
                        "status": 200,
                        "headers": [
                            (b"content-type", b"text/event-stream"),
                            (b"cache-control", b"no-cache"),
                            *job.headers,
                        ],
                    }
                )
                if start := events.start():
                    await _chunk(send, start)
                ended = False
                try:
                    while token is not None:
                        data = events.token(token)
                        timer.sent(token)
                        if token.finish_reason:
                            ended = True
                            await send({"type": "http.response.body", "body": data})
                            break
                        await _chunk(send, data)
                        token = await anext(tokens, None)
                except Exception as exc:
                    # The answer has begun: the error goes in the stream, as vLLM's does.
                    status, body, _ = error_response(exc)
                    outcome.status, outcome.error = status, body["error"]["message"]
                    await send({"type": "http.response.body", "body": events.failed(body)})
                    ended = True
                if not ended:
                    await send({"type": "http.response.body", "body": DONE, "more_body": False})
        finally:
            if job.release is not None:
                job.release()

    async def _whole(self, send: Send, job: Job, outcome: Outcome) -> None:
        answer = WholeAnswer(job.shape, job.logprobs)
        timer = self._stream_metrics.timer()
        try:
            async with contextlib.aclosing(job.tokens) as tokens:
                async for token in tokens:
                    answer.add(token)
                    timer.sent(token)
        except Exception as exc:
            await self._fail(send, exc, outcome)
            return
        finally:
            if job.release is not None:
                job.release()
        await send_json(send, 200, answer.body(), job.headers)

    async def _fail(self, send: Send, exc: Exception, outcome: Outcome) -> None:
        status, body, headers = error_response(exc)
        outcome.status, outcome.error = status, body["error"]["message"]
        await send_json(send, status, body, headers)


async def _chunk(send: Send, data: bytes) -> None:
    await send({"type": "http.response.body", "body": data, "more_body": True})


def _headers(request: Request) -> list[tuple[str, str]]:
    return [(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.headers.raw]


class _Finishing(Response):
    """A response that calls `done` once it has been sent (or its sending failed)."""

    def __init__(self, inner: Response, done: Callable[[], None]) -> None:
        self._inner = inner
        self._done = done

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self._inner(scope, receive, send)
        finally:
            self._done()


class _HostedServer(uvicorn.Server):
    """uvicorn inside the service host: the host owns the signals and the shutdown."""

    @contextlib.contextmanager
    def capture_signals(self):  # type: ignore[no-untyped-def]
        yield


@dataclass
class HttpServer:
    """uvicorn serving the OpenAI API on the gateway's event loop. Starlette (routing, request
    bodies) on uvicorn with httptools is what vLLM's own OpenAI server stands on, kept up by
    the same people as the ASGI spec; neither touches a streamed token: each chunk is written
    by Answer straight to the ASGI send, whose wait for the transport (uvicorn's flow control)
    holds the worker's stream back when a client reads slowly. With the TLS files (the
    gateway's tls_* settings, as on its gRPC port) it speaks only TLS and refuses clients
    without a certificate signed by tls_client_ca_file (Envoy's, mTLS)."""

    app: Starlette
    host: str
    port: int
    grace_seconds: float
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    tls_client_ca_file: Path | None = None
    # How often the TLS files are looked at (a stat each) for a renewed certificate.
    tls_check_seconds: float = 5.0
    _server: uvicorn.Server | None = None
    _task: asyncio.Task[None] | None = None
    _tls_watch: asyncio.Task[None] | None = None

    async def start(self) -> int:
        config = uvicorn.Config(
            self.app,
            host=self.host,
            port=self.port,
            loop="none",
            http="httptools",
            lifespan="off",
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=max(1, int(self.grace_seconds)),
            # Unset (the default): plaintext. The settings come all three or none.
            ssl_certfile=self.tls_cert_file,
            ssl_keyfile=self.tls_key_file,
            ssl_ca_certs=self.tls_client_ca_file,
            ssl_cert_reqs=ssl.CERT_NONE if self.tls_client_ca_file is None else ssl.CERT_REQUIRED,
        )
        self._server = _HostedServer(config)
        self._task = asyncio.create_task(self._server.serve(), name="openai-http")
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise RuntimeError("the OpenAI API server stopped before it started")
            await asyncio.sleep(0.01)
        sockets = [s for server in self._server.servers for s in server.sockets]
        if config.ssl is not None:
            assert self.tls_cert_file and self.tls_key_file and self.tls_client_ca_file
            context = ReloadingSslContext(
                config.ssl, self.tls_cert_file, self.tls_key_file, self.tls_client_ca_file
            )
            self._tls_watch = asyncio.create_task(self._watch_tls(context), name="openai-tls")
        return int(sockets[0].getsockname()[1])

    async def _watch_tls(self, context: ReloadingSslContext) -> None:
        while True:
            await asyncio.sleep(self.tls_check_seconds)
            context.reload()

    async def stop(self) -> None:
        if self._tls_watch is not None:
            self._tls_watch.cancel()
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        with contextlib.suppress(Exception):
            await self._task
