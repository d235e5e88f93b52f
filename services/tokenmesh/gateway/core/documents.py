"""Context documents for a question: ranked by the reranker behind a circuit breaker, or in
their given order with a warning when it fails (a degraded answer, never a broken one)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeAlias

import grpc
from grpc import aio
from opentelemetry import trace
from opentelemetry.trace import Tracer
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tokenmesh.common.channels import Dependency
from tokenmesh.common.metrics import RPC_BUCKETS
from tokenmesh.common.tokens import DEGRADED_BY_RERANKER
from tokenmesh.gateway.config import GatewaySettings
from tokenmesh.gateway.core.breaker import CircuitBreaker, CircuitOpenError, CircuitState
from tokenmesh.gateway.core.prompts import (
    Conversation,
    PromptBatch,
    context_question,
    message,
    with_context,
)
from tokenmesh.v1 import rerank_pb2, rerank_pb2_grpc

log = logging.getLogger(__name__)
# A prompt's text, a conversation for the worker to render with the model's chat template, or
# a batch of prompts.
Prompt: TypeAlias = str | Conversation | PromptBatch

# Reranker outcomes that count against its circuit: it is down, slow or broken. A rejected
# request (INVALID_ARGUMENT) or a caller who went away says nothing about its health.
BREAKER_FAILURES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)


class DocumentMetrics:
    """The reranker's circuit, the time spent choosing documents, and answers made without
    the reranker."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.circuit_state = Gauge(
            "tokenmesh_reranker_circuit_state",
            "Reranker circuit: 0 closed, 1 half-open, 2 open.",
            registry=registry,
        )
        self.circuit_transitions = Counter(
            "tokenmesh_reranker_circuit_transitions",
            "Reranker circuit state changes, by the state entered.",
            ["to"],
            registry=registry,
        )
        self.degraded = Counter(
            "tokenmesh_degraded_responses",
            "Responses served without a dependency, by reason.",
            ["reason"],
            registry=registry,
        )
        self.rerank_seconds = Histogram(
            "tokenmesh_gateway_rerank_seconds",
            "Time the gateway spent choosing context documents (reranker call or fallback).",
            buckets=RPC_BUCKETS,
            registry=registry,
        )

    def on_transition(self, old: CircuitState, new: CircuitState) -> None:
        self.circuit_state.set(int(new))
        self.circuit_transitions.labels(to=new.name.lower()).inc()
        log.warning("reranker circuit %s -> %s", old.name, new.name)


@dataclass(frozen=True)
class Selection:
    """The documents chosen as context (indexes into the request's documents, best first)."""

    indices: tuple[int, ...]
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True)
class ContextPrompt:
    """A question with the documents chosen as its context."""

    question: str
    documents: tuple[str, ...]
    used_document_indices: tuple[int, ...]
    warnings: tuple[str, ...] = field(default=())

    @property
    def degraded(self) -> str:
        """The dependency the prompt was made without ("reranker"), or ""."""
        return DEGRADED_BY_RERANKER if self.warnings else ""

    @property
    def context_question(self) -> str:
        """The question with its context, as a user message for a chat template."""
        return context_question(self.question, self.documents)

    @property
    def prompt(self) -> Prompt:
        """What the worker gets: the question alone as text; with context, one user message
        for the model's chat template, the plain context prompt as its fallback."""
        if not self.documents:
            return self.question
        return Conversation(
            (message("user", self.context_question),), with_context(self.question, self.documents)
        )


def remaining_after_margin(remaining: float | None, margin: float) -> float | None:
    """The time a dependency call may take, given the caller's remaining deadline."""
    if remaining is None:
        return None
    return max(remaining - margin, 0.001)


class DocumentSelector:
    """Ranks documents with the reranker behind a circuit breaker; on failure or an open
    circuit, falls back to the documents' given order and says so in a warning."""

    def __init__(
        self,
        reranker: Dependency,
        breaker: CircuitBreaker,
        metrics: DocumentMetrics,
        settings: GatewaySettings,
        tracer: Tracer,
    ) -> None:
        self._reranker = reranker
        self._stub = rerank_pb2_grpc.RerankServiceStub(reranker.channel)
        self._breaker = breaker
        self._metrics = metrics
        self._settings = settings
        self._tracer = tracer

    async def select(
        self, query: str, documents: Sequence[str], top_k: int, remaining: float | None
    ) -> Selection:
        if not documents:
            return Selection(())
        top_k = min(top_k, len(documents))
        attributes = {"tokenmesh.documents": len(documents), "tokenmesh.top_k": top_k}
        with (
            self._metrics.rerank_seconds.time(),
            self._tracer.start_as_current_span("rerank", attributes=attributes),
        ):
            try:
                self._breaker.acquire()
            except CircuitOpenError as refused:
                return self._fallback(top_k, "reranker_circuit_open", str(refused))
            timeout = self._settings.reranker_timeout_seconds
            budget = remaining_after_margin(remaining, self._settings.deadline_margin_seconds)
            if budget is not None:
                timeout = min(timeout, budget)
            try:
                reply = await self._stub.Rerank(
                    rerank_pb2.RerankRequest(query=query, documents=documents, top_k=top_k),
                    timeout=timeout,
                )
            except asyncio.CancelledError:
                self._breaker.release()
                raise
            except aio.AioRpcError as err:
                if err.code() in BREAKER_FAILURES:
                    self._breaker.record_failure()
                else:
                    self._breaker.release()
                if err.code() is grpc.StatusCode.INVALID_ARGUMENT:
                    raise self._reranker.error(err) from err
                reason = (
                    "reranker_timeout"
                    if err.code() is grpc.StatusCode.DEADLINE_EXCEEDED
                    else "reranker_error"
                )
                return self._fallback(top_k, reason, f"{err.code().name}: {err.details()}")
            self._breaker.record_success()
        return Selection(tuple(result.index for result in reply.results))

    def _fallback(self, top_k: int, reason: str, detail: str) -> Selection:
        self._metrics.degraded.labels(reason=reason).inc()
        # Called within the rerank span: the answer goes on without the reranker.
        trace.get_current_span().add_event(
            "degraded", {"tokenmesh.reason": reason, "tokenmesh.detail": detail}
        )
        return Selection(tuple(range(top_k)), (f"reranker_unavailable: {detail}",))
