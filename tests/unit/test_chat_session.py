"""A Chat stream's input bounds: turns waiting behind the running one, and malformed messages."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tokenmesh.common.errors import InvalidArgument, ResourceExhausted
from tokenmesh.gateway.config import GatewaySettings
from tokenmesh.gateway.servicer import ChatSession
from tokenmesh.v1 import llm_pb2, token_pb2


class SlowPipeline:
    """Every turn streams one token, then nothing for a long time."""

    def stream(self, prompt: str, *args: Any) -> AsyncIterator[token_pb2.Token]:
        async def tokens() -> AsyncIterator[token_pb2.Token]:
            yield token_pb2.Token(text="a")
            await asyncio.sleep(30)

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


async def run(limits: GatewaySettings, *items: llm_pb2.ChatMessage | Exception) -> None:
    session = ChatSession(SlowPipeline(), limits, Context())  # type: ignore[arg-type]
    async with asyncio.timeout(5):
        async for _ in session.run(messages(*items)):
            pass


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
