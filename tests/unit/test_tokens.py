"""Token messages of several tokens: merging, cutting, and coalescing behind a slow writer."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

import pytest

from tests.support import generated, positions
from tokenmesh.common.tokens import cut, merge, text_lengths, token_count
from tokenmesh.gateway.core.workers import ReadAhead
from tokenmesh.v1 import token_pb2
from tokenmesh.worker.engine_thread import Handoff, Inbox
from tokenmesh.worker.outputs import Candidate, Tokens
from tokenmesh.worker.servicer import token_message


def one(index: int, text: str, logprob: float | None = None) -> token_pb2.Token:
    token = token_pb2.Token(text=text, index=index, token_id=100 + index, token_ids=[100 + index])
    if logprob is not None:
        token.logprob = logprob
        token.top_logprobs.add(token_id=100 + index, text=text, logprob=logprob)
    return token


def test_merged_messages_keep_every_token_its_text_and_logprobs() -> None:
    first = one(0, "Hé", -0.5)
    first.warnings.append("reranker_unavailable: circuit open")
    for index, text in ((1, "llo"), (2, " wörld")):
        merge(first, one(index, text, -1.0 * index))
    end = one(3, "!", -3.0)
    end.finish_reason = token_pb2.FINISH_REASON_LENGTH
    end.usage.completion_tokens = 4
    merge(first, end)
    assert first.text == "Héllo wörld!"
    assert list(first.token_ids) == [100, 101, 102, 103] and first.token_id == 100
    assert token_count(first) == 4 and positions([first]) == [0, 1, 2, 3]
    assert text_lengths(first) == [3, 3, 7, 1]
    assert [t.logprob for t in generated([first])] == [-0.5, -1.0, -2.0, -3.0]
    assert first.finish_reason == token_pb2.FINISH_REASON_LENGTH
    assert first.usage.completion_tokens == 4
    assert list(first.warnings) == ["reranker_unavailable: circuit open"]


@pytest.mark.parametrize(("keep", "text"), [(1, "Hé"), (2, "Héllo"), (3, "Héllo wörld")])
def test_a_cut_message_holds_its_first_tokens_and_their_text(keep: int, text: str) -> None:
    message = one(5, "Hé", -0.5)
    for index, piece in ((6, "llo"), (7, " wörld"), (8, "!")):
        merge(message, one(index, piece, -1.0))
    message.finish_reason = token_pb2.FINISH_REASON_LENGTH
    part = cut(message, keep)
    assert part.text == text
    assert positions([part]) == list(range(5, 5 + keep))
    assert len(generated([part])) == keep
    assert all(t.logprob is not None for t in generated([part]))
    assert not part.finish_reason and not part.HasField("usage")
    assert token_count(message) == 4  # the original is left as it was


def test_a_sender_without_token_ids_counts_one_token_a_message() -> None:
    assert token_count(token_pb2.Token(index=3, token_id=7)) == 1
    assert token_count(token_pb2.Token(index=3, token_id=-1)) == 0
    older = token_pb2.Token(index=0, token_id=7, text="a")
    merge(older, token_pb2.Token(index=1, token_id=8, text="b"))
    assert list(older.token_ids) == [7, 8] and older.text == "ab"


def test_worker_outputs_merge_with_per_output_text_lengths() -> None:
    first = Tokens(0, [1], "a", logprobs=[(-0.1, (Candidate(1, "a", -0.1),))])
    # One engine output of two tokens (vLLM merged them): their text cannot be split.
    first.extend(Tokens(1, [2, 3], "bç", logprobs=[(-0.2, ()), (-0.3, ())]))
    first.extend(
        Tokens(
            3, [], "", finish_reason=token_pb2.FINISH_REASON_STOP, last=True, completion_tokens=3
        )
    )
    message = token_message(first)
    assert list(message.token_ids) == [1, 2, 3] and message.text == "abç"
    assert list(message.text_lengths) == [1, 0, 3]
    assert message.finish_reason == token_pb2.FINISH_REASON_STOP
    assert message.usage.completion_tokens == 3
    assert [t.logprob for t in generated([message])] == pytest.approx([-0.1, -0.2, -0.3])
    assert cut(message, 1).text == "a" and cut(message, 2).text == "a"


async def test_one_wake_up_carries_everything_posted_meanwhile() -> None:
    loop = asyncio.get_running_loop()
    handoff = Handoff(loop)
    inboxes = [Inbox(loop), Inbox(loop)]
    wakeups = 0
    original = loop.call_soon_threadsafe

    def counting(callback, *args):  # type: ignore[no-untyped-def]
        nonlocal wakeups
        wakeups += 1
        return original(callback, *args)

    loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
    try:

        def engine_step() -> None:
            for step in range(3):
                for inbox in inboxes:
                    handoff.post(inbox, Tokens(step, [step], "x"))

        thread = threading.Thread(target=engine_step)
        thread.start()
        thread.join()
        taken = [await asyncio.wait_for(inbox.take(), 5) for inbox in inboxes]
    finally:
        loop.call_soon_threadsafe = original  # type: ignore[method-assign]
    assert [[item.index for item in items] for items in taken] == [[0, 1, 2], [0, 1, 2]]
    assert wakeups == 1


async def produced(
    count: int, arrived: list[int], gap: float = 0.0
) -> AsyncIterator[token_pb2.Token]:
    for index in range(count):
        arrived.append(index)
        yield one(index, f"t{index} ")
        await asyncio.sleep(gap)


async def test_tokens_go_alone_while_the_writer_keeps_up() -> None:
    arrived: list[int] = []
    ahead = ReadAhead(produced(6, arrived, gap=0.01), limit=256, per_message=64)
    messages = []
    while (token := await ahead.next()) is not None:
        messages.append(token)
    assert [token_count(m) for m in messages] == [1] * 6


async def test_tokens_that_pile_up_behind_a_slow_write_go_out_together() -> None:
    arrived: list[int] = []
    ahead = ReadAhead(produced(40, arrived, gap=0.001), limit=256, per_message=64)
    messages = []
    while (token := await ahead.next()) is not None:
        messages.append(token)
        await asyncio.sleep(0.02)  # a write that takes 20 ms
    assert token_count(messages[0]) == 1  # the first token is never held back
    assert positions(messages) == list(range(40))
    assert "".join(m.text for m in messages) == "".join(f"t{i} " for i in range(40))
    assert len(messages) < 20


async def test_reading_stops_past_the_limit_while_the_writer_is_stalled() -> None:
    arrived: list[int] = []
    ahead = ReadAhead(produced(100, arrived), limit=8, per_message=4)
    first = await ahead.next()
    assert first is not None
    await asyncio.sleep(0.1)  # the caller stalls: at most `limit` tokens are read meanwhile
    assert len(arrived) <= 1 + 8 + 1
    rest = []
    while (token := await ahead.next()) is not None:
        rest.append(token)
    assert positions([first, *rest]) == list(range(100))
    assert max(token_count(token) for token in rest) == 4  # at most per_message a message


async def test_an_error_after_tokens_comes_after_them() -> None:
    async def failing() -> AsyncIterator[token_pb2.Token]:
        yield one(0, "a")
        yield one(1, "b")
        raise RuntimeError("worker went away")

    ahead = ReadAhead(failing(), limit=256, per_message=64)
    received = []
    with pytest.raises(RuntimeError, match="worker went away"):
        while (token := await ahead.next()) is not None:
            received.append(token)
    assert positions(received) == [0, 1]


async def test_interleaved_choices_merge_each_with_its_own() -> None:
    """n = 3: the worker's messages alternate between choices; behind a slow writer each
    choice's tokens merge with that choice's alone, in order, and the message that ends the
    stream (usage of every choice) comes last."""

    async def choices() -> AsyncIterator[token_pb2.Token]:
        for index in range(12):
            for choice in range(3):
                token = one(index, f"c{choice}t{index} ")
                token.choice = choice
                if index == 11:
                    token.finish_reason = token_pb2.FINISH_REASON_LENGTH
                    if choice == 2:
                        token.usage.completion_tokens = 36
                yield token
                await asyncio.sleep(0.001)

    ahead = ReadAhead(choices(), limit=256, per_message=64)
    messages = []
    while (token := await ahead.next()) is not None:
        messages.append(token)
        await asyncio.sleep(0.01)  # a slow write: tokens pile up and merge
    assert len(messages) < 36
    for choice in range(3):
        mine = [m for m in messages if m.choice == choice]
        assert positions(mine) == list(range(12))
        assert "".join(m.text for m in mine) == "".join(f"c{choice}t{i} " for i in range(12))
        assert [bool(m.finish_reason) for m in mine] == [False] * (len(mine) - 1) + [True]
    assert [m.HasField("usage") for m in messages] == [False] * (len(messages) - 1) + [True]
    assert messages[-1].usage.completion_tokens == 36
