"""The public LLMService through a real gateway, in front of a real worker (vLLM) and a real
reranker (MiniLM): all four RPCs, reranking, deadlines, cancellation and input limits."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
from grpc import aio

from tests.support import (
    ROOT,
    TINY_MODEL,
    ServiceProcess,
    cancel_until_empty,
    engine_empty_at,
    free_port,
    gateway_process,
    generated,
    positions,
    read_rest,
)
from tests.timing import within_budget
from tokenmesh.gateway.core.prompts import context_question
from tokenmesh.v1 import llm_pb2, llm_pb2_grpc, token_pb2

pytestmark = pytest.mark.integration

LOG_DIR = ROOT / ".run" / "test-logs"
FRANCE = [
    "Bananas are yellow and rich in potassium.",
    "The Great Barrier Reef lies off the coast of Australia.",
    "Paris is the capital and largest city of France.",
    "Photosynthesis turns light into chemical energy in plants.",
]


@pytest.fixture(scope="session")
def gateway(worker: ServiceProcess, reranker: ServiceProcess) -> Iterator[ServiceProcess]:
    process = gateway_process(LOG_DIR, worker.address, reranker.address)
    process.start()
    try:
        process.wait_serving(60)
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="session")
async def llm(gateway: ServiceProcess) -> AsyncIterator[llm_pb2_grpc.LLMServiceStub]:
    async with aio.insecure_channel(gateway.address) as channel:
        yield llm_pb2_grpc.LLMServiceStub(channel)


async def test_generate_streams_tokens_through_the_gateway(llm) -> None:
    call = llm.Generate(llm_pb2.GenerateRequest(prompt="hello", max_tokens=16, ignore_eos=True))
    tokens = [token async for token in call]
    assert positions(tokens) == list(range(16))
    assert tokens[-1].finish_reason == token_pb2.FINISH_REASON_LENGTH
    assert tokens[-1].usage.completion_tokens == 16
    assert not any(token.warnings for token in tokens)
    assert dict(await call.trailing_metadata()).get("x-tokenmesh-degraded") is None


async def test_generate_passes_logprobs_through(llm) -> None:
    request = llm_pb2.GenerateRequest(
        prompt="hello", max_tokens=8, ignore_eos=True, logprobs=True, top_logprobs=3
    )
    tokens = [token async for token in llm.Generate(request)]
    each = generated(tokens)
    assert len(each) == 8
    assert all(token.logprob is not None and len(token.top_logprobs) == 3 for token in each)


async def test_reranking_puts_the_relevant_document_first(llm) -> None:
    answer = await llm.GetAnswer(
        llm_pb2.Query(
            prompt="What is the capital of France?",
            documents=FRANCE,
            top_k_documents=2,
            max_tokens=4,
        )
    )
    assert answer.used_document_indices[0] == 2
    assert len(answer.used_document_indices) == 2
    assert not answer.warnings


async def test_generate_with_documents_streams_without_warnings(llm) -> None:
    request = llm_pb2.GenerateRequest(
        prompt="What is the capital of France?", documents=FRANCE, max_tokens=8, ignore_eos=True
    )
    tokens = [token async for token in llm.Generate(request)]
    assert len(positions(tokens)) == 8 and not tokens[0].warnings


async def test_get_answer_is_the_whole_generated_text(llm) -> None:
    query = dict(prompt="tell me", max_tokens=20, temperature=0.0, ignore_eos=True)
    answer = await llm.GetAnswer(llm_pb2.Query(**query))
    streamed = [t async for t in llm.Generate(llm_pb2.GenerateRequest(**query))]
    assert answer.text == "".join(token.text for token in streamed)
    assert answer.finish_reason == token_pb2.FINISH_REASON_LENGTH
    assert answer.usage.completion_tokens == 20 and answer.usage.prompt_tokens > 0


async def test_summarize_accepts_a_text_in_chunks(llm) -> None:
    async def chunks() -> AsyncIterator[llm_pb2.DocumentChunk]:
        yield llm_pb2.DocumentChunk(text="The first part. ", max_tokens=12)
        for i in range(20):
            yield llm_pb2.DocumentChunk(text=f"Sentence number {i} of a long text. ")

    answer = await llm.Summarize(chunks())
    assert answer.usage.completion_tokens >= 1
    # The whole text reached the model: 21 chunks of prompt are far more than a few tokens.
    assert answer.usage.prompt_tokens > 100


async def test_summarize_over_the_size_cap_is_rejected(llm) -> None:
    async def chunks() -> AsyncIterator[llm_pb2.DocumentChunk]:
        for _ in range(70):
            yield llm_pb2.DocumentChunk(text="x" * 1024, max_tokens=4)

    with pytest.raises(aio.AioRpcError) as error:
        await llm.Summarize(chunks())
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "65536 bytes" in error.value.details()


async def test_summarize_of_nothing_is_rejected(llm) -> None:
    async def chunks() -> AsyncIterator[llm_pb2.DocumentChunk]:
        return
        yield

    with pytest.raises(aio.AioRpcError) as error:
        await llm.Summarize(chunks())
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT


class ChatClient:
    """Drives one Chat stream: send messages, read events."""

    def __init__(self, llm) -> None:
        self.call = llm.Chat()

    async def say(self, content: str, max_tokens: int = 8, ignore_eos: bool = True) -> None:
        turn = llm_pb2.UserTurn(content=content, max_tokens=max_tokens, ignore_eos=ignore_eos)
        await self.call.write(llm_pb2.ChatMessage(user=turn))

    async def cancel(self) -> None:
        await self.call.write(llm_pb2.ChatMessage(cancel=llm_pb2.CancelGeneration()))

    async def until_turn_end(self) -> tuple[list[token_pb2.Token], llm_pb2.TurnEnd, int]:
        tokens = []
        while True:
            event = await self.call.read()
            assert event is not grpc.aio.EOF, "chat ended before the turn did"
            if event.HasField("turn_end"):
                return tokens, event.turn_end, event.turn
            tokens.append(event.token)


async def test_chat_keeps_history_across_turns_and_ends_on_half_close(llm) -> None:
    chat = ChatClient(llm)
    await chat.say("Hello there", max_tokens=6)
    tokens1, end1, turn1 = await chat.until_turn_end()
    await chat.say("And what next?", max_tokens=6)
    _, end2, turn2 = await chat.until_turn_end()
    assert (turn1, turn2) == (0, 1)
    # Every token of the turn (a message may hold several), and the turn's usage counts them.
    assert end1.usage.completion_tokens >= 1
    assert positions(tokens1) == list(range(end1.usage.completion_tokens))
    # The second prompt holds the first turn: more prompt tokens than the first turn had in all.
    assert end2.usage.prompt_tokens > end1.usage.prompt_tokens + end1.usage.completion_tokens
    await chat.call.done_writing()
    assert await chat.call.read() is grpc.aio.EOF
    assert await chat.call.code() == grpc.StatusCode.OK


def template_tokens(conversation: list[tuple[str, str]]) -> int:
    """How many tokens transformers' apply_chat_template makes of the conversation on the
    tiny model's tokenizer, with the generation prompt (what vLLM renders)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL)
    assert tokenizer.chat_template, f"{TINY_MODEL} has no chat template: run `make setup`"
    messages = [{"role": role, "content": content} for role, content in conversation]
    ids = tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    return len(ids)


async def test_chat_turns_reach_the_model_through_its_chat_template(llm) -> None:
    chat = ChatClient(llm)
    await chat.say("Hello there", max_tokens=6)
    tokens1, end1, _ = await chat.until_turn_end()
    await chat.say("And what next?", max_tokens=6)
    _, end2, _ = await chat.until_turn_end()
    await chat.call.done_writing()
    answer1 = "".join(token.text for token in tokens1)
    assert end1.usage.prompt_tokens == template_tokens([("user", "Hello there")])
    assert end2.usage.prompt_tokens == template_tokens(
        [("user", "Hello there"), ("assistant", answer1), ("user", "And what next?")]
    )


async def test_a_question_with_documents_reaches_the_model_through_its_chat_template(
    llm,
) -> None:
    question = "What is the capital of France?"
    answer = await llm.GetAnswer(
        llm_pb2.Query(prompt=question, max_tokens=4, documents=FRANCE, top_k_documents=2)
    )
    chosen = [FRANCE[index] for index in answer.used_document_indices]
    assert len(chosen) == 2 and not answer.warnings
    expected = template_tokens([("user", context_question(question, chosen))])
    assert answer.usage.prompt_tokens == expected


async def test_chat_cancel_stops_the_generation_and_the_chat_goes_on(
    llm, inference, worker: ServiceProcess
) -> None:
    # A chat of its own each round: a second 1,900-token turn would not fit the model's context
    # beside the first's history.
    chats: list[ChatClient] = []

    async def cancel_round() -> float:
        chat = ChatClient(llm)
        chats.append(chat)
        await chat.say("Talk for a long time", max_tokens=1900)
        first = await chat.call.read()
        assert first.HasField("token")
        cancelled_at = time.time_ns()
        await chat.cancel()
        _, end, _ = await chat.until_turn_end()
        assert end.finish_reason == token_pb2.FINISH_REASON_CANCELLED
        empty_at = await engine_empty_at(inference, first.token.emitted_unix_nanos)
        return (empty_at - cancelled_at) / 1e9

    await within_budget("engine empty after the turn's cancel", cancel_round)
    *earlier, chat = chats
    for done in earlier:
        done.call.cancel()
    await chat.say("Still there?", max_tokens=4)
    _, end, turn = await chat.until_turn_end()
    assert turn == 1 and end.finish_reason != token_pb2.FINISH_REASON_CANCELLED
    await chat.call.done_writing()
    assert await chat.call.read() is grpc.aio.EOF


async def test_client_cancel_through_the_gateway_frees_the_engine(
    llm, inference, worker: ServiceProcess
) -> None:
    async def cancel_round() -> float:
        calls = [
            llm.Generate(
                llm_pb2.GenerateRequest(prompt=f"long {i}", max_tokens=2000, ignore_eos=True)
            )
            for i in range(4)
        ]
        return await cancel_until_empty(calls, [inference])

    await within_budget("engine empty after the cancel", cancel_round)


async def test_deadline_through_the_gateway_ends_the_stream_and_frees_the_engine(
    llm, inference, worker: ServiceProcess
) -> None:
    timeout = 1.0

    async def deadline_round() -> float:
        started = time.time_ns()
        call = llm.Generate(
            llm_pb2.GenerateRequest(prompt="too long", max_tokens=2000, ignore_eos=True),
            timeout=timeout,
        )
        with pytest.raises(aio.AioRpcError) as error:
            await read_rest(call)
        assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        # The gateway gives the worker the caller's deadline less a margin, so the engine may
        # be empty a little before the caller's deadline: never more than the budget after it.
        # The engine was idle before this call, so its first "empty" report after the start is
        # ours.
        expired = started + int(timeout * 1e9)
        empty_at = await engine_empty_at(inference, started)
        return (empty_at - expired) / 1e9

    await within_budget("engine empty after the deadline", deadline_round)


LIMIT_CASES = {
    "empty prompt": (dict(prompt=""), "prompt: must not be empty"),
    "prompt too big": (dict(prompt="p" * (32 * 1024 + 1)), "over the limit of 32768"),
    "max_tokens zero": (dict(max_tokens=0), "max_tokens: must be in [1, 4096]"),
    "max_tokens over cap": (dict(max_tokens=4097), "max_tokens"),
    "temperature": (dict(temperature=-1.0), "temperature: must be in [0, 2]"),
    "too many documents": (dict(documents=["d"] * 33), "over the limit of 32"),
    "document too big": (dict(documents=["ok", "d" * 8193]), "documents[1]"),
    "top_k_documents": (dict(documents=["a"], top_k_documents=9), "top_k_documents"),
    "context overflow": (dict(prompt="w " * 3000, max_tokens=8), "model context"),
}


@pytest.mark.parametrize("case", LIMIT_CASES)
async def test_input_limits_are_invalid_argument(llm, case: str) -> None:
    fields, expected = LIMIT_CASES[case]
    request = llm_pb2.GenerateRequest(**{"prompt": "hi", "max_tokens": 4, **fields})
    with pytest.raises(aio.AioRpcError) as error:
        await read_rest(llm.Generate(request, timeout=30))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert expected in error.value.details()


def test_unreachable_worker_is_unavailable_within_the_connect_timeout(tmp_path: Path) -> None:
    lonely = gateway_process(
        LOG_DIR,
        worker_address=f"127.0.0.1:{free_port()}",
        reranker_address=f"127.0.0.1:{free_port()}",
        name="gateway-no-worker",
        connect_timeout_seconds="1",
    )
    lonely.start()
    try:
        lonely.wait_serving(60)
        with grpc.insecure_channel(lonely.address) as channel:
            stub = llm_pb2_grpc.LLMServiceStub(channel)
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as error:
                stub.GetAnswer(llm_pb2.Query(prompt="anyone?", max_tokens=4), timeout=30)
            elapsed = time.monotonic() - started
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "worker" in error.value.details()
        assert elapsed < 10, f"took {elapsed:.1f}s with a 1 s connect timeout"
    finally:
        lonely.stop()
