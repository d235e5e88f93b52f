"""LLMService on the gateway token path: prepare each call, relay the worker's tokens (the
first carries the preparation's warnings: the worker adds them), and mark a degraded answer
as the worker marks it on the direct path (common/presentation.py)."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, TypeAlias

from grpc import aio

from tokenmesh.common.errors import InvalidArgument
from tokenmesh.common.metrics import StreamMetrics
from tokenmesh.common.presentation import stream_trailers
from tokenmesh.common.tokens import ends_stream
from tokenmesh.common.validation import check_text
from tokenmesh.gateway.config import GatewaySettings
from tokenmesh.gateway.core.documents import Prompt
from tokenmesh.gateway.core.pipeline import Pipeline
from tokenmesh.gateway.core.prepare import PreparedCall, Preparer
from tokenmesh.gateway.core.prompts import summary_request
from tokenmesh.gateway.core.requests import question, sampling_params
from tokenmesh.gateway.frontends.chat import ChatSession
from tokenmesh.v1 import inference_pb2, llm_pb2, llm_pb2_grpc, token_pb2

Context: TypeAlias = aio.ServicerContext[Any, Any]


def mark(context: Context, call: PreparedCall, resumed: int = 0) -> None:
    """The stream's trailers (common/presentation.py): the degraded marker, and how many times
    it moved to another worker."""
    trailers = stream_trailers(call.request, resumed)
    if trailers:
        context.set_trailing_metadata(trailers)


async def marked(
    context: Context, call: PreparedCall, tokens: AsyncIterator[token_pb2.Token]
) -> AsyncGenerator[token_pb2.Token, None]:
    """The stream's tokens, its trailers marked from the start and again once it moved to
    another worker (a whole answer's too: GetAnswer, Summarize)."""
    mark(context, call)
    async for token in tokens:
        if token.resumed:
            mark(context, call, token.resumed)
        yield token


async def collect(tokens: AsyncIterator[token_pb2.Token]) -> llm_pb2.Answer:
    """A whole answer from a token stream (its warnings are the first token's): the first
    choice's text and finish as the answer's, and every choice when there are several."""
    texts: dict[int, list[str]] = {}
    reasons: dict[int, int] = {}
    answer = llm_pb2.Answer()
    first = True
    async for token in tokens:
        if first:
            answer.warnings.extend(token.warnings)
            first = False
        texts.setdefault(token.choice, []).append(token.text)
        if token.finish_reason:
            reasons[token.choice] = token.finish_reason
        if ends_stream(token):
            answer.usage.CopyFrom(token.usage)
    answer.text = "".join(texts.get(0, ()))
    answer.finish_reason = reasons.get(0, token_pb2.FINISH_REASON_UNSPECIFIED)  # type: ignore[assignment]
    if len(texts) > 1:
        for index in sorted(texts):
            answer.choices.add(
                index=index,
                text="".join(texts[index]),
                finish_reason=reasons.get(index, token_pb2.FINISH_REASON_UNSPECIFIED),
            )
    return answer


class PreparedStreams:
    """Prompts of the gateway's own making (a Chat turn's conversation), prepared and
    streamed."""

    def __init__(self, preparer: Preparer, pipeline: Pipeline) -> None:
        self._preparer = preparer
        self._pipeline = pipeline

    def stream(
        self, prompt: Prompt, sampling: inference_pb2.SamplingParams, remaining: float | None
    ) -> AsyncGenerator[token_pb2.Token, None]:
        return self._pipeline.stream(self._preparer.call(prompt, sampling), remaining)


class LLMServicer(llm_pb2_grpc.LLMServiceServicer):
    def __init__(
        self,
        preparer: Preparer,
        pipeline: Pipeline,
        settings: GatewaySettings,
        stream_metrics: StreamMetrics,
    ) -> None:
        self._preparer = preparer
        self._pipeline = pipeline
        self._settings = settings
        self._stream_metrics = stream_metrics

    async def Generate(
        self, request: llm_pb2.GenerateRequest, context: Context
    ) -> AsyncIterator[token_pb2.Token]:
        timer = self._stream_metrics.timer(context)
        asked = question(request, self._settings)
        call = await self._preparer.question(asked, context.time_remaining())
        tokens = self._pipeline.stream(call, context.time_remaining())
        async for token in marked(context, call, tokens):
            timer.sent(token)
            yield token

    async def GetAnswer(self, request: llm_pb2.Query, context: Context) -> llm_pb2.Answer:
        asked = question(request, self._settings)
        call = await self._preparer.question(asked, context.time_remaining())
        tokens = self._pipeline.stream(call, context.time_remaining())
        answer = await collect(marked(context, call, tokens))
        answer.used_document_indices.extend(call.used_document_indices)
        return answer

    async def Summarize(
        self, request_iterator: AsyncIterator[llm_pb2.DocumentChunk], context: Context
    ) -> llm_pb2.Answer:
        settings = self._settings
        first: llm_pb2.DocumentChunk | None = None
        sampling: inference_pb2.SamplingParams | None = None
        parts: list[str] = []
        size = 0
        async for chunk in request_iterator:
            if first is None:
                # The options are checked as they arrive, not after the whole text.
                first = chunk
                sampling = sampling_params(first, settings)
                check_text("instruction", first.instruction, settings.max_prompt_bytes, False)
            if len(parts) >= settings.max_summarize_chunks:
                raise InvalidArgument(
                    "chunks", f"more than the limit of {settings.max_summarize_chunks} chunks"
                )
            size += len(chunk.text.encode())
            if size > settings.max_summarize_bytes:
                raise InvalidArgument(
                    "text",
                    f"the chunks add up to more than the limit of {settings.max_summarize_bytes} "
                    "bytes",
                )
            parts.append(chunk.text)
        if first is None or sampling is None or not size:
            raise InvalidArgument("text", "no text received before the stream was closed")
        instruction = first.instruction or settings.summarize_instruction
        check_text("instruction", instruction, settings.max_prompt_bytes)
        call = self._preparer.call(summary_request(instruction, "".join(parts)), sampling)
        tokens = self._pipeline.stream(call, context.time_remaining())
        return await collect(marked(context, call, tokens))

    async def Chat(
        self, request_iterator: AsyncIterator[llm_pb2.ChatMessage], context: Context
    ) -> AsyncIterator[llm_pb2.ChatEvent]:
        streams = PreparedStreams(self._preparer, self._pipeline)
        session = ChatSession(streams, self._settings, context)
        async for event in session.run(request_iterator):
            yield event
