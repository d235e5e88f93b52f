"""A request prepared once, whatever path its tokens then take: validated, its documents chosen
(or the reranker's failure noted), its prompt or conversation built, its sampling checked,
the worker's request and the routing of it decided. Every front end prepares through here,
and whoever presents the answer (the worker on the direct path, a gateway on its own) reads
the same PreparedCall (common/presentation.py)."""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass

from opentelemetry import trace

from tokenmesh.common.tenants import tenant_models
from tokenmesh.common.tokens import AFFINITY_HEADER, WORKER_HEADER
from tokenmesh.gateway.config import GatewaySettings
from tokenmesh.gateway.core.catalog import ModelCatalog, Served, pool_metadata
from tokenmesh.gateway.core.documents import ContextPrompt, DocumentSelector, Prompt
from tokenmesh.gateway.core.picker import EndpointPicker, header_value
from tokenmesh.gateway.core.prefix_key import affinity_key
from tokenmesh.gateway.core.prompts import Conversation, PromptBatch
from tokenmesh.gateway.core.requests import Question
from tokenmesh.v1 import inference_pb2

# Where prompts go when GatewaySettings.log_prompts is on (and nowhere otherwise).
PROMPT_LOGGER = "tokenmesh.gateway.prompts"
# A call's model when it names none: the default pool's, without an adapter.
DEFAULT_MODEL = Served("")


@dataclass(frozen=True)
class PreparedCall:
    """What the worker gets (the prompt or conversation, sampling, the first token's warnings,
    the degraded marker, an OpenAI answer's identity and options) and how Envoy is to choose
    that worker."""

    request: inference_pb2.InferenceRequest
    # The prompt's prefix-affinity key (worker_routing prefix hashes it).
    affinity_key: str
    # The workers the endpoint picker named, best first (worker_routing picker; else none).
    workers: tuple[str, ...] = ()
    # The caller's documents used as context, best first.
    used_document_indices: tuple[int, ...] = ()
    # The pool of workers that serves its model ("": the default pool).
    pool: str = ""

    @property
    def degraded(self) -> bool:
        return bool(self.request.degraded)

    def routing_headers(self) -> list[tuple[str, str]]:
        """The headers Envoy chooses the worker by (x-tokenmesh-pool, x-tokenmesh-affinity,
        x-tokenmesh-worker)."""
        headers = [*pool_metadata(self.pool), (AFFINITY_HEADER, self.affinity_key)]
        if self.workers:
            headers.append((WORKER_HEADER, header_value(list(self.workers))))
        return headers


class Preparer:
    """Prepares every request a front end takes: a question with documents (Generate,
    GetAnswer, OpenAI completions), or a prompt of the gateway's own making (Summarize, a Chat
    turn, an OpenAI conversation)."""

    def __init__(
        self,
        selector: DocumentSelector,
        settings: GatewaySettings,
        catalog: ModelCatalog,
        picker: EndpointPicker | None = None,
    ) -> None:
        self._selector = selector
        self._catalog = catalog
        # Names the workers for each request (worker_routing picker); None: Envoy alone picks.
        self._picker = picker
        self._affinity_chars = settings.affinity_prefix_chars
        self._prompt_log = logging.getLogger(PROMPT_LOGGER) if settings.log_prompts else None

    async def context(self, question: Question, remaining: float | None) -> ContextPrompt:
        """The question with the documents chosen as its context (reranked; in their given
        order with a warning when the reranker fails)."""
        selection = await self._selector.select(
            question.prompt, question.documents, question.top_k_documents, remaining
        )
        return ContextPrompt(
            question=question.prompt,
            documents=tuple(question.documents[index] for index in selection.indices),
            used_document_indices=selection.indices,
            warnings=selection.warnings,
        )

    async def question(self, question: Question, remaining: float | None) -> PreparedCall:
        """A gRPC question: its model (empty: the mesh's model) checked, for the tenant too,
        then prepared."""
        served = await self._catalog.resolve(question.model, tenant_models())
        context = await self.context(question, remaining)
        return self.call(context.prompt, question.sampling, context, served=served)

    def call(
        self,
        prompt: Prompt,
        sampling: inference_pb2.SamplingParams,
        context: ContextPrompt | None = None,
        openai: inference_pb2.OpenAIAnswer | None = None,
        served: Served = DEFAULT_MODEL,
    ) -> PreparedCall:
        """The call for a prompt (or a conversation, which the worker renders with the model's
        chat template) and its context's warnings, to the pool that serves its model and
        answered by its adapter, if it names one; logged when log_prompts is on."""
        model = served.adapter
        request = inference_pb2.InferenceRequest(
            request_id=uuid.uuid4().hex[:16], sampling=sampling, openai=openai, model=model
        )
        if isinstance(prompt, str):
            request.prompt = prompt
        elif isinstance(prompt, PromptBatch):
            request.prompts.extend(prompt.prompts)
            request.prompt_token_ids.extend(prompt.token_ids)
        else:
            request.messages.extend(prompt.messages)
            request.prompt = prompt.fallback
            if prompt.tools is not None:
                request.tools.CopyFrom(prompt.tools)
        used: tuple[int, ...] = ()
        if context is not None:
            request.warnings.extend(context.warnings)
            request.degraded = context.degraded
            used = context.used_document_indices
        if self._prompt_log is not None:
            logged: object = prompt
            if isinstance(prompt, Conversation):
                logged = [(m.role, m.content) for m in prompt.messages]
            elif isinstance(prompt, PromptBatch):
                logged = [item.text or list(item.token_ids) for item in prompt.items]
            # The engine's id of the request, not the RPC line's request_id (Envoy's).
            self._prompt_log.info(
                "prompt", extra={"engine_request_id": request.request_id, "prompt": logged}
            )
        # An adapter's prefix cache is its own in vLLM: its key differs from the model's.
        key = affinity_key(prompt, self._affinity_chars, model)
        span = trace.get_current_span()
        span.set_attribute("tokenmesh.affinity_key", key)
        if served.pool:
            span.set_attribute("tokenmesh.pool", served.pool)
        workers = (
            ()
            if self._picker is None
            else tuple(self._picker.pick(key, served.pool, served.adapter))
        )
        if workers:
            span.set_attribute("tokenmesh.picked_workers", workers)
        return PreparedCall(request, key, workers, used, served.pool)
