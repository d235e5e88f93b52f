"""LLMService RPC handlers: validate, prepare the prompt, stream or collect the worker's tokens."""

from __future__ import annotations

import asyncio
import contextlib
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
        self, pipeline: Pipeline, limits: GatewaySettings, stream_metrics: StreamMetrics
    ) -> None:
        self._pipeline = pipeline
        self._limits = limits
        self._stream_metrics = stream_metrics

    async def Generate(
        self, request: llm_pb2.GenerateRequest, context: Context
    ) -> AsyncIterator[token_pb2.Token]:
        timer = self._stream_metrics.timer(context)
        job = generation_job(request, self._limits)
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
        job = generation_job(request, self._limits)
        prepared = await self._pipeline.prepare(job, context.time_remaining())
        flag_degraded(context, prepared)
        tokens = self._pipeline.stream(prepared.prompt, job.sampling, context.time_remaining())
        answer = await collect(tokens, prepared.warnings)
        answer.used_document_indices.extend(prepared.used_document_indices)
        return answer

    async def Summarize(
        self, request_iterator: AsyncIterator[llm_pb2.DocumentChunk], context: Context
    ) -> llm_pb2.Answer:
        limits = self._limits
        first: llm_pb2.DocumentChunk | None = None
        sampling: inference_pb2.SamplingParams | None = None
        parts: list[str] = []
        size = 0
        async for chunk in request_iterator:
            if first is None:
                # The options are checked as they arrive, not after the whole text.
                first = chunk
                sampling = sampling_params(first, limits)
                check_text("instruction", first.instruction, limits.max_prompt_bytes, False)
            if len(parts) >= limits.max_summarize_chunks:
                raise InvalidArgument(
                    "chunks", f"more than the limit of {limits.max_summarize_chunks} chunks"
                )
            size += len(chunk.text.encode())
            if size > limits.max_summarize_bytes:
                raise InvalidArgument(
                    "text",
                    f"the chunks add up to more than the limit of {limits.max_summarize_bytes} "
                    "bytes",
                )
            parts.append(chunk.text)
        if first is None or sampling is None or not size:
            raise InvalidArgument("text", "no text received before the stream was closed")
        instruction = first.instruction or limits.summarize_instruction
        check_text("instruction", instruction, limits.max_prompt_bytes)
        prompt = summary_request(instruction, "".join(parts))
        tokens = self._pipeline.stream(prompt, sampling, context.time_remaining())
        return await collect(tokens)

    async def Chat(
        self, request_iterator: AsyncIterator[llm_pb2.ChatMessage], context: Context
    ) -> AsyncIterator[llm_pb2.ChatEvent]:
        session = ChatSession(self._pipeline, self._limits, context)
        async for event in session.run(request_iterator):
            yield event


def check_user_turn(
    user: llm_pb2.UserTurn, limits: GatewaySettings
) -> inference_pb2.SamplingParams:
    check_text("user.content", user.content, limits.max_chat_message_bytes)
    return sampling_params(user, limits)


class ChatSession:
    """One Chat stream: user turns run one at a time, each streaming its tokens back; a cancel
    message stops the running turn at once; half-close ends the stream after the running turn."""

    def __init__(self, pipeline: Pipeline, limits: GatewaySettings, context: Context) -> None:
        self._pipeline = pipeline
        self._limits = limits
        self._context = context
        self._history = ChatHistory(limits.max_chat_turns, limits.max_chat_history_tokens)
        # Messages read from the client; None marks its half-close, an exception a message
        # that could not be read (malformed), which ends the stream with its status.
        self._inbox: asyncio.Queue[llm_pb2.ChatMessage | Exception | None] = asyncio.Queue()
        # A message taken from the inbox as a turn ended, handled before the inbox's next one
        # (at most one; a deque because None, the half-close, is a message too).
        self._unread: deque[llm_pb2.ChatMessage | Exception | None] = deque()
        # User turns that arrived while another turn was running, checked, with their sampling.
        self._backlog: deque[tuple[llm_pb2.UserTurn, inference_pb2.SamplingParams]] = deque()
        self._half_closed = False

    async def run(
        self, requests: AsyncIterator[llm_pb2.ChatMessage]
    ) -> AsyncGenerator[llm_pb2.ChatEvent, None]:
        reader = asyncio.create_task(self._read(requests))
        try:
            turn = 0
            while True:
                queued = await self._next_user_turn()
                if queued is None:
                    return
                async for event in self._run_turn(turn, *queued):
                    yield event
                turn += 1
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader

    async def _read(self, requests: AsyncIterator[llm_pb2.ChatMessage]) -> None:
        try:
            async for message in requests:
                await self._inbox.put(message)
        except Exception as exc:  # the stream's reader must not wait forever for a message
            await self._inbox.put(exc)
            return
        await self._inbox.put(None)

    @staticmethod
    def _message(item: llm_pb2.ChatMessage | Exception | None) -> llm_pb2.ChatMessage | None:
        if isinstance(item, Exception):
            raise item
        return item

    async def _next_message(self) -> llm_pb2.ChatMessage | Exception | None:
        if self._unread:
            return self._unread.popleft()
        return await self._inbox.get()

    async def _next_user_turn(
        self,
    ) -> tuple[llm_pb2.UserTurn, inference_pb2.SamplingParams] | None:
        """The next user turn to answer, with its sampling, or None once the client has
        half-closed."""
        while not self._backlog:
            if self._half_closed:
                return None
            message = self._message(await self._next_message())
            if message is None:
                self._half_closed = True
            elif message.HasField("user"):
                self._enqueue(message.user)
            # A cancel with no turn running has nothing to stop.
        return self._backlog.popleft()

    def _enqueue(self, user: llm_pb2.UserTurn) -> None:
        """Queue a user turn behind the running one, checked now: a bad turn or one too many
        ends the stream before it waits."""
        limits = self._limits
        if len(self._backlog) >= limits.max_chat_pending_turns:
            raise ResourceExhausted(
                f"chat: more than {limits.max_chat_pending_turns} user turns waiting for an "
                "answer (max_chat_pending_turns); send the next turn after turn_end"
            )
        self._backlog.append((user, check_user_turn(user, limits)))

    def _keep_unread(self, pending: asyncio.Future[llm_pb2.ChatMessage | Exception | None]) -> None:
        """A message read while a turn was ending is handled next, in its turn; a read still
        waiting is stopped."""
        if not pending.done():
            pending.cancel()
        elif not pending.cancelled():
            self._unread.append(pending.result())

    async def _run_turn(
        self, turn: int, user: llm_pb2.UserTurn, sampling: inference_pb2.SamplingParams
    ) -> AsyncGenerator[llm_pb2.ChatEvent, None]:
        tokens = self._pipeline.stream(
            self._history.prompt(user.content), sampling, self._context.time_remaining()
        )
        answer: list[str] = []
        generated = 0
        end = llm_pb2.TurnEnd()
        next_token = asyncio.ensure_future(anext(tokens))
        next_message = None if self._half_closed else asyncio.ensure_future(self._next_message())
        try:
            while True:
                waiting = {next_token} | ({next_message} if next_message else set())
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if next_message in done:
                    message = self._message(next_message.result())
                    next_message = None
                    if message is None:
                        self._half_closed = True
                    elif message.HasField("cancel") and not end.finish_reason:
                        next_token.cancel()
                        end.finish_reason = token_pb2.FINISH_REASON_CANCELLED
                        end.usage.completion_tokens = generated
                        break
                    elif message.HasField("user"):
                        self._enqueue(message.user)
                    # A cancel after the last token has nothing left to stop.
                    if not self._half_closed:
                        next_message = asyncio.ensure_future(self._next_message())
                if next_token in done:
                    try:
                        token = next_token.result()
                    except StopAsyncIteration:
                        break
                    answer.append(token.text)
                    generated += token_count(token)
                    yield llm_pb2.ChatEvent(turn=turn, token=token)
                    if token.finish_reason:
                        end.finish_reason = token.finish_reason
                        end.usage.CopyFrom(token.usage)
                    # Read on to the stream's end (right after the last token), so the worker
                    # call completes instead of being cancelled.
                    next_token = asyncio.ensure_future(anext(tokens))
        finally:
            if next_message is not None:
                self._keep_unread(next_message)
            # Stop the generation (a cancel, an error, or the client leaving): cancelling the
            # pending read cancels the worker call, which aborts the engine request.
            next_token.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await next_token
            await tokens.aclose()
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
