"""The worker streams real vLLM tokens, batches concurrent streams and frees the engine at once
when a caller cancels or runs out of deadline."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc import aio

from tests.support import (
    ServiceProcess,
    aborted_since,
    aborted_total,
    engine_empty_at,
    generated,
    generations_finished,
    metric_value,
    positions,
    read_rest,
    scrape_metrics,
)
from tests.timing import Unmeasured, within_budget
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc, token_pb2

pytestmark = pytest.mark.integration

# Long enough that a stream is still running when the test cancels it.
LONG_GENERATION = 2000


def generate_request(prompt: str = "hello", max_tokens: int = 16, **sampling: object):
    return inference_pb2.InferenceRequest(
        prompt=prompt,
        sampling=inference_pb2.SamplingParams(max_tokens=max_tokens, **sampling),  # type: ignore[arg-type]
    )


async def stats(stub: inference_pb2_grpc.InferenceServiceStub) -> inference_pb2.EngineStats:
    return await stub.GetEngineStats(inference_pb2.EngineStatsRequest(), timeout=30)


async def test_warnings_and_the_degraded_mark_of_a_prepared_request_reach_the_caller(
    inference,
) -> None:
    """A request a gateway prepared: its warnings go on the first token only, and its
    `degraded` field comes back as the stream's trailer; a header saying so does not."""
    request = generate_request(max_tokens=6, ignore_eos=True)
    request.warnings.extend(["reranker_unavailable: UNAVAILABLE"])
    request.degraded = "reranker"
    call = inference.Generate(request)
    tokens = [token async for token in call]
    assert positions(tokens) == list(range(6))
    assert list(tokens[0].warnings) == ["reranker_unavailable: UNAVAILABLE"]
    assert not any(token.warnings for token in tokens[1:])
    assert ("x-tokenmesh-degraded", "reranker") in tuple(await call.trailing_metadata())
    plain = inference.Generate(
        generate_request(max_tokens=2, ignore_eos=True),
        metadata=(("x-tokenmesh-degraded", "reranker"),),
    )
    assert not any([token.warnings async for token in plain])
    assert "x-tokenmesh-degraded" not in dict(await plain.trailing_metadata())


async def test_stream_has_exactly_max_tokens_with_contiguous_indexes(inference) -> None:
    tokens = [
        token
        async for token in inference.Generate(generate_request(max_tokens=24, ignore_eos=True))
    ]
    assert positions(tokens) == list(range(24))
    assert all(token.token_id >= 0 for token in generated(tokens))
    assert all(token.finish_reason == 0 for token in tokens[:-1])
    assert tokens[-1].finish_reason == token_pb2.FINISH_REASON_LENGTH
    assert tokens[-1].usage.completion_tokens == 24
    assert tokens[-1].usage.prompt_tokens > 0
    stamps = [token.emitted_unix_nanos for token in tokens]
    assert stamps == sorted(stamps) and stamps[0] > 0


async def test_tokens_arrive_while_the_generation_runs(inference) -> None:
    """The first token reaches the client long before the last one is made (no buffering)."""
    received_at: list[float] = []  # when each token arrived (a message may hold several)
    found: list[int] = []
    async for token in inference.Generate(generate_request(max_tokens=400, ignore_eos=True)):
        tokens = positions([token])
        found.extend(tokens)
        received_at.extend([time.perf_counter()] * len(tokens))
    assert found == list(range(400))
    total = received_at[-1] - received_at[0]
    # Arrival times spread over the whole generation: the first half of the tokens arrives
    # within the first part of it, not in one burst at the end.
    assert received_at[200] - received_at[0] > total * 0.2


async def test_text_is_the_detokenized_token_ids(inference) -> None:
    from transformers import AutoTokenizer

    from tests.support import TINY_MODEL

    tokens = [
        token
        async for token in inference.Generate(
            generate_request(max_tokens=32, ignore_eos=True, temperature=0.0)
        )
    ]
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL)
    ids = [token.token_id for token in generated(tokens)]
    expected = tokenizer.decode(ids, skip_special_tokens=True)
    assert "".join(token.text for token in tokens) == expected


CONVERSATION = [
    {"role": "system", "content": "You answer in one short sentence."},
    {"role": "user", "content": "What is a token?"},
    {"role": "assistant", "content": "A piece of text the model reads or writes."},
    {"role": "user", "content": "And a chat template?"},
]


def chat_request(messages: list[dict[str, str]], max_tokens: int = 16, **sampling: object):
    return inference_pb2.InferenceRequest(
        messages=[inference_pb2.ConversationMessage(**message) for message in messages],
        sampling=inference_pb2.SamplingParams(max_tokens=max_tokens, **sampling),  # type: ignore[arg-type]
    )


async def test_messages_stream_tokens_like_a_prompt(inference) -> None:
    tokens = [
        token
        async for token in inference.Generate(
            chat_request(CONVERSATION, max_tokens=12, ignore_eos=True)
        )
    ]
    assert positions(tokens) == list(range(12))
    assert tokens[-1].finish_reason == token_pb2.FINISH_REASON_LENGTH
    assert tokens[-1].usage.completion_tokens == 12


async def test_messages_are_rendered_exactly_as_the_models_chat_template(inference) -> None:
    """The worker's prompt for a conversation is the tokens transformers' apply_chat_template
    makes of it (with the generation prompt): the same count, and the same greedy answer as
    the rendered text sent as a prompt."""
    from transformers import AutoTokenizer

    from tests.support import TINY_MODEL

    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL)
    assert tokenizer.chat_template, f"{TINY_MODEL} has no chat template: run `make setup`"
    # return_dict=False: transformers 5 returns a BatchEncoding by default.
    expected_ids = tokenizer.apply_chat_template(
        CONVERSATION, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    rendered = tokenizer.apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=True
    )
    greedy = {"max_tokens": 16, "ignore_eos": True, "temperature": 0.0}
    chat = [token async for token in inference.Generate(chat_request(CONVERSATION, **greedy))]
    assert chat[-1].usage.prompt_tokens == len(expected_ids)
    plain = [token async for token in inference.Generate(generate_request(rendered, **greedy))]
    assert plain[-1].usage.prompt_tokens == len(expected_ids)
    assert generated(chat) == generated(plain)


async def test_greedy_generation_is_deterministic(inference) -> None:
    request = generate_request(prompt="the same prompt", max_tokens=20, temperature=0.0)
    first = generated([t async for t in inference.Generate(request)])
    second = generated([t async for t in inference.Generate(request)])
    assert len(first) == 20
    assert first == second


async def test_logprobs_rank_the_alternatives_and_include_the_sampled_token(inference) -> None:
    request = generate_request(
        max_tokens=24, ignore_eos=True, temperature=0.0, logprobs=True, top_logprobs=5
    )
    tokens = generated([token async for token in inference.Generate(request)])
    assert len(tokens) == 24
    for token in tokens:
        assert token.logprob is not None and token.logprob <= 0.0
        alternatives = [candidate.logprob for candidate in token.top_logprobs]
        assert len(alternatives) == 5 and alternatives == sorted(alternatives, reverse=True)
        assert len({candidate.token_id for candidate in token.top_logprobs}) == 5
        # Greedy: the sampled token is the most likely one (a random model has exact ties).
        best = token.top_logprobs[0].logprob
        assert token.logprob == pytest.approx(best)
        assert token.token_id in {c.token_id for c in token.top_logprobs if c.logprob == best}
    plain = [t async for t in inference.Generate(generate_request(max_tokens=4))]
    assert not any(t.HasField("logprob") or t.top_logprobs or t.following_logprobs for t in plain)


def iterations_over_8_tokens(worker: ServiceProcess) -> float:
    """Engine steps that processed more than 8 tokens, from vLLM's own histogram."""
    text = scrape_metrics(worker.metrics_port)
    steps = metric_value(text, "vllm:iteration_tokens_total_count")
    return steps - metric_value(text, "vllm:iteration_tokens_total_bucket", le="8.0")


async def test_32_concurrent_streams_complete_and_run_batched(
    inference, worker: ServiceProcess
) -> None:
    big_steps_before = iterations_over_8_tokens(worker)

    async def one(i: int) -> list[int]:
        request = generate_request(prompt=f"stream {i}", max_tokens=128, ignore_eos=True)
        return positions([token async for token in inference.Generate(request)])

    results = await asyncio.gather(*(one(i) for i in range(32)))
    assert all(indexes == list(range(128)) for indexes in results)
    # One stream decodes one token per engine step; vLLM's scheduler reports many steps that
    # decoded more than 8 tokens at once: the streams ran batched (continuous batching).
    big_steps = iterations_over_8_tokens(worker) - big_steps_before
    assert big_steps >= 10, f"only {big_steps} engine steps handled more than 8 tokens"


async def _start_streams(inference, count: int) -> tuple[list[grpc.aio.UnaryStreamCall], int]:
    """Start count long streams and wait until each has produced its first token; returns
    the calls and when the last first token was sent (the engine was busy then, so any
    later scheduler report saying "empty" is about these streams)."""
    calls = [
        inference.Generate(
            generate_request(
                prompt=f"long stream {i}", max_tokens=LONG_GENERATION, ignore_eos=True
            ),
        )
        for i in range(count)
    ]
    try:
        firsts = await asyncio.gather(*(call.read() for call in calls))
    except BaseException:
        for call in calls:
            call.cancel()
        raise
    return calls, max(token.emitted_unix_nanos for token in firsts)


async def test_cancel_frees_engine_within_100ms(inference, worker: ServiceProcess) -> None:
    streams = 8

    async def cancel_round() -> float:
        aborted_before = aborted_total(worker, "cancelled")
        finished_before = generations_finished(worker)
        calls, busy_ns = await _start_streams(inference, streams)
        cancelled_at = time.time_ns()
        for call in calls:
            call.cancel()
        empty_at = await engine_empty_at(inference, busy_ns)
        assert all(call.cancelled() for call in calls)
        aborted = await aborted_since(worker, "cancelled", aborted_before, streams)
        finished = generations_finished(worker) - finished_before
        # Every stream either ran to its end before the cancel reached it or was aborted.
        assert aborted + finished == streams, (aborted, finished)
        # On a loaded machine a stream can be sent whole before the test has seen every first
        # token, leaving nothing to cancel: such a round measured nothing.
        if not aborted:
            raise Unmeasured("every stream ended before the cancel reached it")
        return (empty_at - cancelled_at) / 1e9

    await within_budget("engine empty after the cancel", cancel_round)


async def test_deadline_frees_engine_within_100ms(inference, worker: ServiceProcess) -> None:
    timeout = 1.0

    async def deadline_round() -> float:
        aborted_before = aborted_total(worker, "any")
        started_ns = time.time_ns()
        calls = [
            inference.Generate(
                generate_request(
                    prompt=f"expiring {i}", max_tokens=LONG_GENERATION, ignore_eos=True
                ),
                timeout=timeout,
            )
            for i in range(4)
        ]
        codes = []
        for call in calls:
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await read_rest(call)
            codes.append(error.value.code())
        assert codes == [grpc.StatusCode.DEADLINE_EXCEEDED] * 4
        # Every deadline passed at or after started + timeout, so measuring from there can only
        # overstate the time the engine took to empty. The engine was idle before these
        # streams, so its first "empty" report after they started is about them.
        expired_ns = started_ns + int(timeout * 1e9)
        empty_at = await engine_empty_at(inference, started_ns)
        aborted = await aborted_since(worker, "any", aborted_before, 4)
        assert aborted <= 4
        # A stream whose deadline passed before it reached the engine (a loaded machine) has
        # nothing to free: a round where not all four ran measured something else.
        if aborted != 4:
            raise Unmeasured(f"{4 - aborted} of 4 streams were not in the engine at their deadline")
        return (empty_at - expired_ns) / 1e9

    await within_budget("engine empty after the deadline", deadline_round)


async def test_engine_stats_report_model_and_context(inference, worker: ServiceProcess) -> None:
    report = await stats(inference)
    assert report.model.endswith("tiny-llama")
    assert report.max_model_len == 2048
    assert 0.0 <= report.kv_cache_usage <= 1.0


async def test_max_tokens_within_context_stops_where_the_context_ends(inference) -> None:
    """With max_tokens_within_context, a request asking for more than the context leaves
    generates to the context's end; without it, it is refused naming max_tokens."""
    prompt = " ".join(["word"] * 1000)
    first = [t async for t in inference.Generate(generate_request(prompt, max_tokens=1))]
    prompt_tokens = first[-1].usage.prompt_tokens
    room = 2048 - prompt_tokens  # the worker's max_model_len in tests (its default)
    assert 0 < room < 2000
    within = generate_request(prompt, 2000, ignore_eos=True, max_tokens_within_context=True)
    tokens = [token async for token in inference.Generate(within)]
    assert tokens[-1].usage.completion_tokens == room
    assert tokens[-1].finish_reason == token_pb2.FINISH_REASON_LENGTH
    with pytest.raises(aio.AioRpcError) as refused:
        await anext(aiter(inference.Generate(generate_request(prompt, 2000, ignore_eos=True))))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"(at most {room} here)" in refused.value.details()
