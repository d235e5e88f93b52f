"""An OpenAI completion or chat completion prepared as every other request is (core/prepare.py),
for the gateway's HTTP API and for the edge's external processor alike."""

from __future__ import annotations

from tokenmesh.common.errors import InvalidArgument
from tokenmesh.common.openai_answers import Shape
from tokenmesh.common.sampling import check_batch, check_tools
from tokenmesh.common.tenants import tenant_models
from tokenmesh.gateway.config import GatewaySettings
from tokenmesh.gateway.core.catalog import ModelCatalog
from tokenmesh.gateway.core.documents import Prompt
from tokenmesh.gateway.core.prepare import PreparedCall, Preparer
from tokenmesh.gateway.core.prompts import Conversation
from tokenmesh.gateway.core.requests import question, sampling_params
from tokenmesh.gateway.frontends.openai.protocol import ChatCompletionRequest, CompletionRequest
from tokenmesh.v1 import inference_pb2


class OpenAIPreparer:
    """Validates a request with the gRPC API's limits (the model it names, its messages, the
    Generate its last user message amounts to) and prepares its prompt: the reranked context,
    the conversation for the model's chat template, the answer's identity and time limit."""

    def __init__(self, preparer: Preparer, catalog: ModelCatalog, settings: GatewaySettings):
        self._preparer = preparer
        self._catalog = catalog
        self._settings = settings

    async def prepare(self, body: CompletionRequest | ChatCompletionRequest) -> PreparedCall:
        settings = self._settings
        model = body.model
        served = await self._catalog.resolve(model, tenant_models())
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
                size = message.size()
                if size > settings.max_chat_message_bytes:
                    raise InvalidArgument(
                        f"messages[{position}].content",
                        f"{size} bytes, more than the limit of {settings.max_chat_message_bytes}",
                    )
        tools = body.tool_calling() if isinstance(body, ChatCompletionRequest) else None
        if tools is not None:
            check_tools("tools", tools, settings)
        limit = settings.http_request_timeout_seconds
        batch = body.batch() if isinstance(body, CompletionRequest) else None
        if batch is not None:
            # Several prompts, or token ids: no documents to rank against one question.
            if body.documents:
                raise InvalidArgument("documents", "need one text prompt, not a list or ids")
            sampling = sampling_params(generate, settings)
            if batch.prompts:
                check_batch(batch.prompts, sampling.n, settings, settings.max_prompt_bytes)
            return self._preparer.call(
                batch, sampling, None, answer_of(body, model, limit), served=served
            )
        asked = question(generate, settings)
        context = await self._preparer.context(asked, limit)
        prompt: Prompt = context.prompt
        if isinstance(body, ChatCompletionRequest):
            # No plain fallback: a model without a chat template refuses a chat, as vLLM does.
            prompt = Conversation(
                body.conversation(context.context_question if context.documents else None),
                tools=tools,
            )
            # Without a limit, as vLLM's server: up to what the context leaves.
            asked.sampling.max_tokens_within_context = body.max_tokens_named is None
        return self._preparer.call(
            prompt, asked.sampling, context, answer_of(body, model, limit), served=served
        )


def answer_of(
    body: CompletionRequest | ChatCompletionRequest, model: str, limit: float
) -> inference_pb2.OpenAIAnswer:
    """The answer's identity and options, and its whole time limit from when the worker takes
    it: a stream then ends with the deadline error as its last event, whichever process
    presents it."""
    answer = Shape.new_answer(
        isinstance(body, ChatCompletionRequest), model, body.stream, body.include_usage
    )
    answer.time_limit_seconds = limit
    return answer
