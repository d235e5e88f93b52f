"""A Chat stream's input bounds: turns waiting behind the running one, and malformed messages."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tokenmesh.common.errors import InvalidArgument, ResourceExhausted
from tokenmesh.gateway.config import GatewaySettings
from tokenmesh.gateway.core.prompts import Conversation
from tokenmesh.gateway.frontends.chat import ChatSession
from tokenmesh.v1 import llm_pb2, token_pb2


class SlowPipeline:
    """Every turn streams one token, then nothing for a long time."""

    def stream(self, prompt: str, *args: Any) -> AsyncIterator[token_pb2.Token]:
        async def tokens() -> AsyncIterator[token_pb2.Token]:
            yield token_pb2.Token(text="a")
            await asyncio.sleep(30)

        return tokens()


class QuickPipeline:
    """Every turn streams one last token at once; the prompts it was given are kept."""

    def __init__(self) -> None:
        self.prompts: list[Conversation] = []

    def stream(self, prompt: Conversation, *args: Any) -> AsyncIterator[token_pb2.Token]:
        self.prompts.append(prompt)

        async def tokens() -> AsyncIterator[token_pb2.Token]:
            yield token_pb2.Token(text="a", finish_reason=token_pb2.FINISH_REASON_STOP)

        return tokens()


class Context:
    def time_remaining(self) -> None:
        return None


def user(content: str = "hi") -> llm_pb2.ChatMessage:
    return llm_pb2.ChatMessage(user=llm_pb2.UserTurn(content=content, max_tokens=4))


async def messages(*items: llm_pb2.ChatMessage | Exception) -> AsyncIterator[Any]:
    for item in items:
        if isinstance(item, Exception):
            raise item
        yield item
    await asyncio.sleep(30)  # the client keeps the stream open


async def run(
    limits: GatewaySettings, *items: llm_pb2.ChatMessage | Exception, pipeline: Any = None
) -> list[llm_pb2.ChatEvent]:
    session = ChatSession(pipeline or SlowPipeline(), limits, Context())
    async with asyncio.timeout(5):
        return [event async for event in session.run(messages(*items))]


async def half_closed(*items: llm_pb2.ChatMessage) -> AsyncIterator[llm_pb2.ChatMessage]:
    for item in items:
        yield item


async def test_one_turn_too_many_waiting_ends_the_stream_resource_exhausted() -> None:
    limits = GatewaySettings(max_chat_pending_turns=3)
    with pytest.raises(ResourceExhausted, match="more than 3 user turns waiting"):
        await run(limits, *[user() for _ in range(5)])


async def test_a_bad_turn_is_refused_as_it_arrives_not_when_its_turn_comes() -> None:
    with pytest.raises(InvalidArgument, match=r"user\.content"):
        await run(GatewaySettings(), user(), user(""))


async def test_a_malformed_message_ends_the_stream_instead_of_hanging() -> None:
    with pytest.raises(InvalidArgument, match="request"):
        await run(GatewaySettings(), user(), InvalidArgument("request", "not a valid message"))


async def test_turns_sent_together_are_answered_in_order_then_the_stream_ends() -> None:
    # Turns read while the one before ends (as the quick pipeline's do) keep their place.
    pipeline = QuickPipeline()
    session = ChatSession(pipeline, GatewaySettings(), Context())  # type: ignore[arg-type]
    contents = ["one", "two", "three", "four"]
    async with asyncio.timeout(5):
        events = [e async for e in session.run(half_closed(*(user(c) for c in contents)))]
    assert [prompt.messages[-1].content for prompt in pipeline.prompts] == contents
    # Each turn's conversation holds the turns answered before it, user and assistant.
    assert [len(prompt.messages) for prompt in pipeline.prompts] == [1, 3, 5, 7]
    assert [e.turn for e in events if e.HasField("turn_end")] == [0, 1, 2, 3]


async def test_a_bad_turn_read_as_a_turn_ends_is_refused_and_never_run() -> None:
    pipeline = QuickPipeline()
    with pytest.raises(InvalidArgument, match=r"user\.content"):
        await run(GatewaySettings(), user("fine"), user(""), user("never"), pipeline=pipeline)
    assert len(pipeline.prompts) <= 1


class ClosingPipeline:
    """Every turn streams one token, then waits; records whether each generation was closed."""

    def __init__(self) -> None:
        self.closed: list[bool] = []

    def stream(self, prompt: Conversation, *args: Any) -> AsyncIterator[token_pb2.Token]:
        turn = len(self.closed)
        self.closed.append(False)

        async def tokens() -> AsyncIterator[token_pb2.Token]:
            try:
                yield token_pb2.Token(text="a")
                if "short" in prompt.messages[-1].content:
                    yield token_pb2.Token(text="b", finish_reason=token_pb2.FINISH_REASON_STOP)
                    return
                await asyncio.sleep(30)
            finally:
                self.closed[turn] = True

        return tokens()


async def test_a_cancel_stops_the_running_turn_at_once_and_the_next_turn_is_answered() -> None:
    pipeline = ClosingPipeline()
    session = ChatSession(pipeline, GatewaySettings(), Context())  # type: ignore[arg-type]
    sent: asyncio.Queue[llm_pb2.ChatMessage | None] = asyncio.Queue()

    async def requests() -> AsyncIterator[llm_pb2.ChatMessage]:
        while (message := await sent.get()) is not None:
            yield message

    events = session.run(requests())
    async with asyncio.timeout(5):
        sent.put_nowait(user("talk long"))
        first = await anext(events)
        assert first.token.text == "a" and pipeline.closed == [False]
        sent.put_nowait(llm_pb2.ChatMessage(cancel=llm_pb2.CancelGeneration()))
        end = await anext(events)
        assert end.turn_end.finish_reason == token_pb2.FINISH_REASON_CANCELLED
        assert end.turn_end.usage.completion_tokens == 1
        assert pipeline.closed == [True]  # the generation (the worker call) was stopped
        sent.put_nowait(user("short"))
        sent.put_nowait(None)
        rest = [event async for event in events]
    assert [e.token.text for e in rest if e.HasField("token")] == ["a", "b"]
    assert [e.turn_end.finish_reason for e in rest if e.HasField("turn_end")] == [
        token_pb2.FINISH_REASON_STOP
    ]
    assert rest[-1].turn == 1


@pytest.mark.parametrize("yields", range(4))
async def test_a_cancel_right_after_its_turn_never_hangs_the_stream(yields: int) -> None:
    # The cancel may reach the turn before its generation has begun to run, or before the turn
    # itself has begun: either way it stops that turn.
    pipeline = ClosingPipeline()
    session = ChatSession(pipeline, GatewaySettings(), Context())  # type: ignore[arg-type]

    async def requests() -> AsyncIterator[llm_pb2.ChatMessage]:
        yield user("talk long")
        for _ in range(yields):
            await asyncio.sleep(0)
        yield llm_pb2.ChatMessage(cancel=llm_pb2.CancelGeneration())

    async with asyncio.timeout(5):
        events = [event async for event in session.run(requests())]
    ends = [e.turn_end for e in events if e.HasField("turn_end")]
    assert len(ends) == 1 and ends[0].finish_reason == token_pb2.FINISH_REASON_CANCELLED


class ScriptedPipeline:
    """Each turn streams the next of its scripted token lists; the prompts it was given are kept."""

    def __init__(self, *turns: list[token_pb2.Token]) -> None:
        self.turns = list(turns)
        self.prompts: list[Conversation] = []

    def stream(self, prompt: Conversation, *args: Any) -> AsyncIterator[token_pb2.Token]:
        self.prompts.append(prompt)
        script = self.turns.pop(0)

        async def tokens() -> AsyncIterator[token_pb2.Token]:
            for token in script:
                yield token

        return tokens()


async def test_a_turn_that_ends_without_text_takes_no_room_in_the_history() -> None:
    stop = token_pb2.FINISH_REASON_STOP
    pipeline = ScriptedPipeline(
        [token_pb2.Token(text="a", token_id=5, finish_reason=stop, usage={"prompt_tokens": 10})],
        # The model ends at once: no text, yet the worker counted the whole prompt.
        [token_pb2.Token(token_id=-1, finish_reason=stop, usage={"prompt_tokens": 25})],
        [token_pb2.Token(text="c", token_id=7, finish_reason=stop, usage={"prompt_tokens": 14})],
    )
    settings = GatewaySettings(max_chat_history_tokens=20)
    session = ChatSession(pipeline, settings, Context())  # type: ignore[arg-type]
    async with asyncio.timeout(5):
        events = [e async for e in session.run(half_closed(user("u1"), user("u2"), user("u3")))]
    assert [e.turn_end.dropped_turns for e in events if e.HasField("turn_end")] == [0, 0, 0]
    # The first turn is still sent: the empty one did not push it out.
    assert [m.content for m in pipeline.prompts[2].messages] == ["u1", "a", "u3"]
