"""LLMService RPC handlers: validate, prepare the prompt, stream or collect the worker's tokens."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, TypeAlias

from grpc import aio

from tokenmesh.common.errors import InvalidArgument, ResourceExhausted
from tokenmesh.common.metrics import StreamMetrics
from tokenmesh.common.tokens import DEGRADED_BY_RERANKER, DEGRADED_HEADER, token_count
from tokenmesh.common.validation import check_text
from tokenmesh.gateway.config import GatewaySettings
from tokenmesh.gateway.pipeline import Pipeline, PreparedPrompt
from tokenmesh.gateway.prompts import ChatHistory, ChatTurn, summary_request
from tokenmesh.gateway.requests import generation_job, sampling_params
from tokenmesh.v1 import inference_pb2, llm_pb2, llm_pb2_grpc, token_pb2

Context: TypeAlias = aio.ServicerContext[Any, Any]


def flag_degraded(context: Context, prepared: PreparedPrompt) -> None:
    if prepared.degraded:
        context.set_trailing_metadata(((DEGRADED_HEADER, DEGRADED_BY_RERANKER),))


async def collect(
    tokens: AsyncIterator[token_pb2.Token], warnings: tuple[str, ...] = ()
) -> llm_pb2.Answer:
    """A whole answer from a token stream."""
    parts: list[str] = []
    answer = llm_pb2.Answer(warnings=warnings)
    async for token in tokens:
        parts.append(token.text)
        if token.finish_reason:
            answer.finish_reason = token.finish_reason
            answer.usage.CopyFrom(token.usage)
    answer.text = "".join(parts)
    return answer


class LLMServicer(llm_pb2_grpc.LLMServiceServicer):
    def __init__(
        self, pipeline: Pipeline, settings: GatewaySettings, stream_metrics: StreamMetrics
    ) -> None:
        self._pipeline = pipeline
        self._settings = settings
        self._stream_metrics = stream_metrics

    async def Generate(
        self, request: llm_pb2.GenerateRequest, context: Context
    ) -> AsyncIterator[token_pb2.Token]:
        timer = self._stream_metrics.timer(context)
        job = generation_job(request, self._settings)
        prepared = await self._pipeline.prepare(job, context.time_remaining())
        flag_degraded(context, prepared)
        first = True
        async for token in self._pipeline.stream(
            prepared.prompt, job.sampling, context.time_remaining()
        ):
            if first:
                token.warnings.extend(prepared.warnings)
                first = False
            timer.sent(token)
            yield token

    async def GetAnswer(self, request: llm_pb2.Query, context: Context) -> llm_pb2.Answer:
        job = generation_job(request, self._settings)
        prepared = await self._pipeline.prepare(job, context.time_remaining())
        flag_degraded(context, prepared)
        tokens = self._pipeline.stream(prepared.prompt, job.sampling, context.time_remaining())
        answer = await collect(tokens, prepared.warnings)
        answer.used_document_indices.extend(prepared.used_document_indices)
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
        prompt = summary_request(instruction, "".join(parts))
        tokens = self._pipeline.stream(prompt, sampling, context.time_remaining())
        return await collect(tokens)

    async def Chat(
        self, request_iterator: AsyncIterator[llm_pb2.ChatMessage], context: Context
    ) -> AsyncIterator[llm_pb2.ChatEvent]:
        session = ChatSession(self._pipeline, self._settings, context)
        async for event in session.run(request_iterator):
            yield event


def check_user_turn(
    user: llm_pb2.UserTurn, settings: GatewaySettings
) -> inference_pb2.SamplingParams:
    check_text("user.content", user.content, settings.max_chat_message_bytes)
    return sampling_params(user, settings)


@dataclasses.dataclass
class QueuedTurn:
    user: llm_pb2.UserTurn
    sampling: inference_pb2.SamplingParams
    # A cancel came for it before it began.
    cancelled: bool = False


# The end of a turn's tokens, after its last (or after its generation stopped).
_END = object()


class ChatSession:
    """One Chat stream, in two parts. A reader task routes each message the client sends: a
    user turn, checked at once, to the queue of turns; a cancel to the running turn (or, between
    turns, to the next one); the half-close, or what ends the stream at once (a malformed
    message, a bad turn, one too many waiting). A loop answers the queued turns one at a time."""

    def __init__(self, pipeline: Pipeline, settings: GatewaySettings, context: Context) -> None:
        self._pipeline = pipeline
        self._settings = settings
        self._context = context
        self._history = ChatHistory(settings.max_chat_turns, settings.max_chat_history_tokens)
        self._waiting: deque[QueuedTurn] = deque()
        # Set when a turn is queued or the reading ends.
        self._changed = asyncio.Event()
        self._read_all = False
        # What ends the stream with its status, at once (the running turn is stopped).
        self._failure: Exception | None = None
        # Whether a turn is being answered, and its generation until its last token (what a
        # cancel stops).
        self._answering = False
        self._generation: asyncio.Task[None] | None = None

    async def run(
        self, requests: AsyncIterator[llm_pb2.ChatMessage]
    ) -> AsyncGenerator[llm_pb2.ChatEvent, None]:
        reader = asyncio.create_task(self._read(requests))
        try:
            turn = 0
            while self._failure is None and (queued := await self._next_turn()) is not None:
                async for event in self._answer(turn, queued):
                    yield event
                turn += 1
            if self._failure is not None:
                raise self._failure
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader

    async def _next_turn(self) -> QueuedTurn | None:
        """The next turn to answer; None once the client has half-closed and all are."""
        while not self._waiting and not self._read_all and self._failure is None:
            self._changed.clear()
            await self._changed.wait()
        return self._waiting.popleft() if self._waiting and self._failure is None else None

    async def _read(self, requests: AsyncIterator[llm_pb2.ChatMessage]) -> None:
        try:
            async for message in requests:
                if message.HasField("user"):
                    self._queue(message.user)
                elif message.HasField("cancel"):
                    self._cancel()
        except Exception as exc:  # the stream must end with it, not wait for a turn
            self._failure = exc
            if self._generation is not None:
                self._generation.cancel()
        self._read_all = True
        self._changed.set()

    def _cancel(self) -> None:
        if self._answering:
            if self._generation is not None:
                self._generation.cancel()
            # After the turn's last token there is nothing left to stop.
        elif self._waiting:
            self._waiting[0].cancelled = True
        # With no turn running or waiting, there is nothing to stop.

    def _queue(self, user: llm_pb2.UserTurn) -> None:
        """Queue a user turn behind the running one, checked now: a bad turn or one too many
        ends the stream before it waits."""
        settings = self._settings
        if len(self._waiting) >= settings.max_chat_pending_turns:
            raise ResourceExhausted(
                f"chat: more than {settings.max_chat_pending_turns} user turns waiting for an "
                "answer (max_chat_pending_turns); send the next turn after turn_end"
            )
        self._waiting.append(QueuedTurn(user, check_user_turn(user, settings)))
        self._changed.set()

    async def _answer(
        self, turn: int, queued: QueuedTurn
    ) -> AsyncGenerator[llm_pb2.ChatEvent, None]:
        # The generation runs in a task of its own, so that a cancel can stop it wherever it
        # is; it hands over one token at a time and waits until the stream has sent it, so a
        # slow client still holds it back (HTTP/2 flow control).
        tokens: asyncio.Queue[Any] = asyncio.Queue()

        user = queued.user

        async def generate() -> None:
            stream = self._pipeline.stream(
                self._history.conversation(user.content),
                queued.sampling,
                self._context.time_remaining(),
            )
            async with contextlib.aclosing(stream):
                async for token in stream:
                    tokens.put_nowait(token)
                    await tokens.join()

        self._answering = True
        generation = self._generation = asyncio.create_task(generate())
        # However the generation ends, even cancelled before it began to run.
        generation.add_done_callback(lambda _: tokens.put_nowait(_END))
        if queued.cancelled:
            generation.cancel()
        answer: list[str] = []
        end = llm_pb2.TurnEnd()
        try:
            while (token := await tokens.get()) is not _END:
                answer.append(token.text)
                end.usage.completion_tokens += token_count(token)
                if token.finish_reason:
                    end.finish_reason = token.finish_reason
                    end.usage.CopyFrom(token.usage)
                    # Read on to the stream's end (right after the last token), so the worker
                    # call completes instead of being cancelled.
                    self._generation = None
                yield llm_pb2.ChatEvent(turn=turn, token=token)
                tokens.task_done()
            await asyncio.wait({generation})
        finally:
            # The client went away (or the stream failed) mid-turn: cancelling the generation
            # cancels the worker call, which aborts the engine request.
            self._answering = False
            self._generation = None
            generation.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await generation
        if self._failure is not None:
            return
        if generation.cancelled() and not end.finish_reason:
            end.finish_reason = token_pb2.FINISH_REASON_CANCELLED
        # The history measures this turn by what the worker counted: the prompt tokens it
        # added beyond the history, plus what was generated.
        added_prompt_tokens = max(end.usage.prompt_tokens - self._history.tokens, 0)
        end.dropped_turns = self._history.add(
            ChatTurn(
                user=user.content,
                assistant="".join(answer),
                tokens=added_prompt_tokens + end.usage.completion_tokens,
            )
        )
        yield llm_pb2.ChatEvent(turn=turn, turn_end=end)
