"""OpenAI's HTTP API (models, completions, chat completions; embeddings and rerank in
pooling.py; vLLM's tokenize and detokenize in tokenize.py) on the gateway token path: each
request admitted as gRPC calls are, prepared as every request is (OpenAIPreparer), and its
answer presented from the worker's tokens by the same code the worker presents it with on the
direct path (common/presentation.py)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Tracer
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Send

from tokenmesh.common.metrics import StreamMetrics
from tokenmesh.common.openai_answers import error_response
from tokenmesh.common.presentation import OpenAIPresenter
from tokenmesh.common.tenants import tenant_models
from tokenmesh.common.tracing import extract
from tokenmesh.gateway.config import GatewaySettings
from tokenmesh.gateway.core.catalog import ModelCatalog
from tokenmesh.gateway.core.pipeline import Pipeline
from tokenmesh.gateway.core.prepare import PreparedCall
from tokenmesh.gateway.core.tenancy.http import HttpTenancy
from tokenmesh.gateway.frontends.calls import GATEWAY_PATH
from tokenmesh.gateway.frontends.openai.http import (
    Answer,
    Finishing,
    HttpMetrics,
    Outcome,
    request_headers,
    send_chunk,
    send_error,
    send_json,
)
from tokenmesh.gateway.frontends.openai.pooling import PoolingApi
from tokenmesh.gateway.frontends.openai.prepare import OpenAIPreparer
from tokenmesh.gateway.frontends.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    parse,
)
from tokenmesh.gateway.frontends.openai.tokenize import TokenizeApi
from tokenmesh.v1 import token_pb2

log = logging.getLogger(__name__)


class OpenAIApi:
    """The routes, each: authenticate and admit, prepare, stream through the pipeline, and
    present the answer in OpenAI's shapes."""

    def __init__(
        self,
        preparer: OpenAIPreparer,
        pipeline: Pipeline,
        settings: GatewaySettings,
        stream_metrics: StreamMetrics,
        catalog: ModelCatalog,
        tenancy: HttpTenancy,
        tracer: Tracer,
        metrics: HttpMetrics,
        serving: Callable[[], bool],
        pooling: PoolingApi | None = None,
        tokenize: TokenizeApi | None = None,
    ) -> None:
        self._serving = serving
        # /v1/embeddings and /v1/rerank, answered by the reranker's model (pooling.py).
        self._pooling = pooling
        # /tokenize and /detokenize, answered by a worker's tokenizer (tokenize.py).
        self._tokenize = tokenize
        self._preparer = preparer
        self._pipeline = pipeline
        self._settings = settings
        self._stream_metrics = stream_metrics
        self._catalog = catalog
        self._tenancy = tenancy
        self._tracer = tracer
        self._metrics = metrics

    def app(self) -> Starlette:
        pooling = self._pooling
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
                *(
                    Route(route, self._observed(route, handler), methods=["POST"])
                    for extra in (pooling, self._tokenize)
                    if extra is not None
                    for route, handler in extra.routes()
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
                context=extract(request_headers(request)),
                kind=SpanKind.SERVER,
            )
            # The span stays current until the answer has been sent (Finishing detaches it):
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
            return Finishing(response, lambda: self._done(route, outcome, started, span, attached))

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
        self._metrics.record(route, outcome.status, GATEWAY_PATH, seconds)
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
        release = await self._tenancy.admit(request_headers(request))
        try:
            served = await self._catalog.cards(tenant_models())
        finally:
            if release is not None:
                release()
        # Every pool's model, and each LoRA adapter as vLLM's server lists one: its parent is
        # the model it adapts. A tenant limited to some models sees those.
        cards: list[dict[str, object]] = []
        for model in served:
            card: dict[str, object] = {
                "id": model.name,
                "object": "model",
                "created": 0,
                "owned_by": "tokenmesh",
                "root": model.name,
                "parent": model.parent,
            }
            if model.max_model_len:
                card["max_model_len"] = model.max_model_len
            cards.append(card)
        if self._pooling is not None and (embedding := await self._pooling.model_card()):
            cards.append(embedding)
        return JSONResponse({"object": "list", "data": cards})

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
        release = await self._tenancy.admit(request_headers(request))
        try:
            call = await self._preparer.prepare(body)
        except BaseException:
            if release is not None:
                release()
            raise
        tokens = self._pipeline.stream(call, self._settings.http_request_timeout_seconds)

        async def answer(send: Send) -> None:
            try:
                await self._present(send, call, tokens, outcome)
            finally:
                if release is not None:
                    release()

        return Answer(answer, outcome)

    async def _present(
        self,
        send: Send,
        call: PreparedCall,
        tokens: AsyncGenerator[token_pb2.Token, None],
        outcome: Outcome,
    ) -> None:
        """The presenter's parts as the HTTP response: an error before the first is the
        response's status; one after it has its event in the stream already."""
        presenter = OpenAIPresenter(call.request)
        parts = presenter.parts(self._timed(tokens))
        async with contextlib.aclosing(parts):
            try:
                first = await anext(parts)
            except Exception as exc:
                await send_error(send, outcome, exc)
                return
            headers = [(k.encode(), v.encode()) for k, v in presenter.headers()]
            if not presenter.stream:
                await send_json(send, 200, first, headers, encoded=True)
                return
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", presenter.content_type.encode()), *headers],
                }
            )
            await send_chunk(send, first)
            try:
                async for data in parts:
                    await send_chunk(send, data)
            except Exception:
                # The presenter sent the error's event; the request still counts its status.
                if presenter.failure is None:
                    raise
                outcome.status, outcome.error = presenter.failure
            await send({"type": "http.response.body", "body": b""})

    async def _timed(
        self, tokens: AsyncGenerator[token_pb2.Token, None]
    ) -> AsyncIterator[token_pb2.Token]:
        """The tokens, timed as the gRPC API's streams are (tokenmesh_ttft_seconds, …)."""
        timer = self._stream_metrics.timer()
        async with contextlib.aclosing(tokens):
            async for token in tokens:
                timer.sent(token)
                yield token
