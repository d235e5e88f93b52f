"""The gateway's core: choose context documents (degrading when the reranker fails), build the
prompt, stream tokens from a worker. Transport-agnostic apart from the gRPC clients it holds."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TypeAlias

import grpc
from grpc import aio
from opentelemetry import trace
from opentelemetry.trace import Tracer
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tokenmesh.common.channels import Dependency
from tokenmesh.common.errors import DependencyError
from tokenmesh.common.metrics import RPC_BUCKETS
from tokenmesh.common.outcome import Deadline
from tokenmesh.common.tenants import TENANT_HEADER, current_tenant
from tokenmesh.common.tokens import (
    AFFINITY_HEADER,
    UPSTREAM_HEADER,
    WORKER_HEADER,
    merge,
    token_count,
)
from tokenmesh.gateway.affinity import affinity_key
from tokenmesh.gateway.breaker import CircuitBreaker, CircuitOpenError, CircuitState
from tokenmesh.gateway.config import GatewaySettings
from tokenmesh.gateway.picker import EndpointPicker, header_value
from tokenmesh.gateway.prompts import Conversation, context_question, message, with_context
from tokenmesh.gateway.quota import QuotaMeter
from tokenmesh.gateway.requests import GenerationJob
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc, rerank_pb2, rerank_pb2_grpc, token_pb2

log = logging.getLogger(__name__)
# Where prompts go when GatewaySettings.log_prompts is on (and nowhere otherwise).
PROMPT_LOGGER = "tokenmesh.gateway.prompts"
# A prompt's text, or a conversation for the worker to render with the model's chat template.
Prompt: TypeAlias = str | Conversation

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


class GatewayMetrics:
    """The reranker circuit and degraded-answer metrics of the gateway."""

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
class PreparedPrompt:
    """A question with the documents chosen as its context."""

    question: str
    documents: tuple[str, ...]
    used_document_indices: tuple[int, ...]
    warnings: tuple[str, ...] = field(default=())

    @property
    def degraded(self) -> bool:
        return bool(self.warnings)

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
        metrics: GatewayMetrics,
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


class ReadAhead:
    """Reads a worker call's messages while the gateway is still writing the last one to its
    caller, and merges those that arrive meanwhile (`next` takes them): each token goes on the
    moment it can, alone while the caller keeps up, and no timer holds any back. A merged
    message holds at most `per_message` tokens (one worker message is never split), and past
    `limit` tokens waiting it stops reading, so a stalled caller holds the worker back through
    HTTP/2 flow control instead of the gateway buffering its stream."""

    def __init__(self, call: AsyncIterator[token_pb2.Token], limit: int, per_message: int) -> None:
        self._limit = limit
        self._per_message = per_message
        self._waiting: deque[token_pb2.Token] = deque()
        self._waiting_tokens = 0
        self._error: Exception | None = None
        self._ended = False
        self._arrived = asyncio.Event()
        self._room = asyncio.Event()
        self._room.set()
        self._reader = asyncio.create_task(self._read(call))

    async def _read(self, call: AsyncIterator[token_pb2.Token]) -> None:
        try:
            async for token in call:
                count = token_count(token)
                last = self._waiting[-1] if self._waiting else None
                if last is not None and token_count(last) + count <= self._per_message:
                    merge(last, token)
                else:
                    self._waiting.append(token)
                self._waiting_tokens += count
                self._arrived.set()
                if self._waiting_tokens >= self._limit:
                    self._room.clear()
                    await self._room.wait()
        except Exception as error:  # the call's failure is the stream's, raised by next()
            self._error = error
        finally:
            self._ended = True
            self._arrived.set()

    async def next(self) -> token_pb2.Token | None:
        """What arrived since the last call (merged, up to per_message tokens); None at the
        end."""
        while not self._waiting:
            if self._ended:
                if self._error is not None:
                    raise self._error
                return None
            self._arrived.clear()
            await self._arrived.wait()
        token = self._waiting.popleft()
        self._waiting_tokens -= token_count(token)
        self._room.set()
        return token

    def close(self) -> None:
        self._reader.cancel()


async def record_upstream(call: aio.UnaryStreamCall) -> None:
    """The worker Envoy chose for the call (its answer's x-tokenmesh-upstream), on the current
    span: with the affinity key, the routing decision."""
    for name, value in await call.initial_metadata() or ():
        if name == UPSTREAM_HEADER:
            trace.get_current_span().set_attribute("tokenmesh.worker", str(value))


class WorkerClient:
    """Streams tokens from a worker; cancelling the stream cancels the worker call, which
    aborts the engine request."""

    def __init__(
        self,
        worker: Dependency,
        connect_timeout: float,
        max_coalesced: int = 256,
        max_message_tokens: int = 64,
    ) -> None:
        self._worker = worker
        self._stub = inference_pb2_grpc.InferenceServiceStub(worker.channel)
        self._connect_timeout = connect_timeout
        self._max_coalesced = max_coalesced
        self._max_message_tokens = max_message_tokens

    async def stream(
        self,
        request: inference_pb2.InferenceRequest,
        time_limit: float | None,
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> AsyncGenerator[token_pb2.Token, None]:
        connect_within = self._connect_timeout
        if time_limit is not None:
            connect_within = min(connect_within, time_limit)
        await self._worker.ensure_connected(connect_within)
        # A call that fails (all but) at its deadline failed because of it: Envoy enforces the
        # same deadline (grpc-timeout) and resets the stream when it passes.
        deadline = Deadline(time_limit)
        call = self._stub.Generate(request, timeout=time_limit, metadata=metadata or None)
        ahead = ReadAhead(call, self._max_coalesced, self._max_message_tokens)
        received = 0
        try:
            while (token := await ahead.next()) is not None:
                if not received:
                    await record_upstream(call)
                received += token_count(token)
                yield token
        except aio.AioRpcError as err:
            # Failed before its first token, it was retried by Envoy already; after, it cannot
            # be (the caller has tokens), and the message says how far it got.
            during = f"after {received} tokens" if received else ""
            if deadline.passed():
                raise DependencyError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"worker: deadline exceeded {during or 'before the first token'}",
                ) from err
            raise self._worker.error(err, during) from err
        finally:
            ahead.close()
            # The caller went away (or stopped reading) before the worker's end: cancel the
            # call, which aborts the engine request. A finished call is left as it is.
            if not call.done():
                call.cancel()


class Pipeline:
    """Question (+ documents) in, tokens out."""

    def __init__(
        self,
        selector: DocumentSelector,
        worker: WorkerClient,
        settings: GatewaySettings,
        meter: QuotaMeter | None = None,
        picker: EndpointPicker | None = None,
    ) -> None:
        self._selector = selector
        # Names the workers for each request (worker_routing picker); None: Envoy alone picks.
        self._picker = picker
        self._worker = worker
        self._margin = settings.deadline_margin_seconds
        self._affinity_chars = settings.affinity_prefix_chars
        # Token quotas (auth on); None: tokens are not metered.
        self._meter = meter
        self._prompt_log = logging.getLogger(PROMPT_LOGGER) if settings.log_prompts else None

    async def prepare(self, job: GenerationJob, remaining: float | None) -> PreparedPrompt:
        selection = await self._selector.select(
            job.prompt, job.documents, job.top_k_documents, remaining
        )
        return PreparedPrompt(
            question=job.prompt,
            documents=tuple(job.documents[index] for index in selection.indices),
            used_document_indices=selection.indices,
            warnings=selection.warnings,
        )

    def worker_request(
        self, prompt: Prompt, sampling: inference_pb2.SamplingParams
    ) -> inference_pb2.InferenceRequest:
        """The request a worker gets for this prompt, or conversation (which the worker renders
        with the model's chat template); logged when log_prompts is on."""
        request = inference_pb2.InferenceRequest(
            request_id=uuid.uuid4().hex[:16], sampling=sampling
        )
        if isinstance(prompt, str):
            request.prompt = prompt
        else:
            request.messages.extend(prompt.messages)
            request.prompt = prompt.fallback
        if self._prompt_log is not None:
            logged = (
                prompt
                if isinstance(prompt, str)
                else [(m.role, m.content) for m in prompt.messages]
            )
            self._prompt_log.info(
                "prompt", extra={"request_id": request.request_id, "prompt": logged}
            )
        return request

    def routing(self, prompt: Prompt) -> tuple[str, list[str]]:
        """How Envoy is to choose the prompt's worker: its prefix-affinity key
        (x-tokenmesh-affinity) and the workers the endpoint picker names for it
        (x-tokenmesh-worker; none without a picker), both on the current span too."""
        key = affinity_key(prompt, self._affinity_chars)
        span = trace.get_current_span()
        span.set_attribute("tokenmesh.affinity_key", key)
        workers = [] if self._picker is None else self._picker.pick(key)
        if workers:
            span.set_attribute("tokenmesh.picked_workers", workers)
        return key, workers

    @property
    def metered(self) -> bool:
        """Whether tokens are charged to quotas (then the gateway must see every token)."""
        return self._meter is not None

    def stream(
        self,
        prompt: Prompt,
        sampling: inference_pb2.SamplingParams,
        remaining: float | None,
    ) -> AsyncGenerator[token_pb2.Token, None]:
        """The worker's tokens. For the RPC's tenant (set by the auth interceptor in the RPC's
        context; none with auth off), they are charged to its quota and the worker is told
        whose request it is (x-tenant-id: the gateway's own metadata, never a caller's); the
        prompt's prefix-affinity key and picked workers go with the call for Envoy's choice of
        worker."""
        tenant = current_tenant()
        request = self.worker_request(prompt, sampling)
        time_limit = remaining_after_margin(remaining, self._margin)
        key, workers = self.routing(prompt)
        metadata = [(AFFINITY_HEADER, key)]
        if workers:
            metadata.append((WORKER_HEADER, header_value(workers)))
        if tenant is None:
            return self._worker.stream(request, time_limit, tuple(metadata))
        metadata.append((TENANT_HEADER, tenant.id))
        tokens = self._worker.stream(request, time_limit, tuple(metadata))
        return tokens if self._meter is None else self._meter.metered(tenant, tokens)
