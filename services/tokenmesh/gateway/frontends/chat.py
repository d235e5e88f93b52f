"""The Chat RPC's sessions: turns queued as they arrive, answered one at a time with the
conversation so far, each cancellable on its own."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, Protocol, TypeAlias

from grpc import aio

from tokenmesh.common.errors import ResourceExhausted
from tokenmesh.common.tokens import token_count
from tokenmesh.common.validation import check_text
from tokenmesh.gateway.config import GatewaySettings
from tokenmesh.gateway.core.documents import Prompt
from tokenmesh.gateway.core.prompts import ChatHistory, ChatTurn
from tokenmesh.gateway.core.requests import sampling_params
from tokenmesh.v1 import inference_pb2, llm_pb2, token_pb2

Context: TypeAlias = aio.ServicerContext[Any, Any]


class PromptStreams(Protocol):
    def stream(
        self, prompt: Prompt, sampling: inference_pb2.SamplingParams, remaining: float | None
    ) -> AsyncGenerator[token_pb2.Token, None]:
        """A prompt's tokens (prepared and streamed from a worker)."""
        ...


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

    def __init__(
        self, pipeline: PromptStreams, settings: GatewaySettings, context: Context
    ) -> None:
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
