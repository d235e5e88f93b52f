"""Completions' prompts as OpenAI's and vLLM's servers take them, through the real mesh on both
token paths: token ids, a batch of prompts, echo, and the prompt's log probabilities (what an
evaluation harness's log-likelihood requests use); n on gRPC GetAnswer."""

from __future__ import annotations

import math
from typing import Any

import httpx
import openai
import pytest

from tests.integration.test_engine_options import (
    MODEL,
    PATHS,
    TOKEN,
    client,
    counted,
    engines_empty,
    llm,
    openai_port,
)
from tokenmesh.localmesh.mesh import LocalMesh
from tokenmesh.v1 import llm_pb2, llm_pb2_grpc, token_pb2

pytestmark = pytest.mark.integration
__all__ = ["client", "llm"]  # fixtures, used by name

PROMPTS = ["The quick brown fox", "jumps over", "the lazy dog and then some"]


def tokenize(client: openai.OpenAI, prompt: str) -> list[int]:
    """The ids a completion of this prompt starts from (the mesh's /tokenize)."""
    reply = client.post("/../tokenize", body={"model": MODEL, "prompt": prompt}, cast_to=object)
    return list(reply["tokens"])  # type: ignore[index]


def complete(client: openai.OpenAI, prompt: Any, **fields: Any) -> Any:
    return client.completions.create(model=MODEL, prompt=prompt, **fields)


def greedy(client: openai.OpenAI, prompt: Any, **fields: Any) -> Any:
    return complete(
        client, prompt, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}, **fields
    )


def test_a_prompt_of_token_ids_is_the_prompt_of_their_text(client: openai.OpenAI) -> None:
    text = PROMPTS[0]
    ids = tokenize(client, text)
    by_text, by_ids = greedy(client, text), greedy(client, ids)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == by_text.usage.prompt_tokens == len(ids)


def test_a_batch_answers_each_prompt_as_alone_numbered_prompt_by_choice(
    client: openai.OpenAI,
) -> None:
    alone = [greedy(client, prompt) for prompt in PROMPTS]
    ids = tokenize(client, PROMPTS[1])
    batch = greedy(client, [PROMPTS[0], PROMPTS[1], PROMPTS[2]])
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == 18
    # Lists of ids too, each prompt with n choices: prompt i's are i*n .. i*n+n-1.
    sampled = complete(
        client,
        [ids, tokenize(client, PROMPTS[2])],
        max_tokens=5,
        n=2,
        seed=7,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in sampled.choices] == [0, 1, 2, 3]
    assert sampled.usage.completion_tokens == 20
    assert sampled.usage.prompt_tokens == len(ids) + len(tokenize(client, PROMPTS[2]))


def test_a_streamed_batch_interleaves_its_choices_as_the_whole_answer_has_them(
    client: openai.OpenAI,
) -> None:
    whole = greedy(client, PROMPTS)
    texts: dict[int, str] = {}
    finished: dict[int, str] = {}
    chunks = list(greedy(client, PROMPTS, stream=True, stream_options={"include_usage": True}))
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                finished[choice.index] = choice.finish_reason
    assert texts == {c.index: c.text for c in whole.choices}
    assert finished == {0: "length", 1: "length", 2: "length"}
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_echo_begins_each_answer_with_its_prompt(client: openai.OpenAI, mesh: LocalMesh) -> None:
    alone = greedy(client, PROMPTS[0])
    before = {feature: counted(mesh, feature) for feature in ("echo", "prompt_batch")}
    echoed = greedy(client, PROMPTS[:2], echo=True)
    # Counted by the worker that served it.
    assert {feature: counted(mesh, feature) - before[feature] for feature in before} == {
        "echo": 1,
        "prompt_batch": 1,
    }
    assert echoed.choices[0].text == PROMPTS[0] + alone.choices[0].text
    assert echoed.choices[1].text.startswith(PROMPTS[1])
    # Ids are echoed as their text.
    ids = tokenize(client, PROMPTS[2])
    assert greedy(client, ids, echo=True).choices[0].text.startswith(PROMPTS[2])
    streamed = "".join(
        choice.text
        for chunk in greedy(client, PROMPTS[0], echo=True, stream=True)
        for choice in chunk.choices
    )
    assert streamed == echoed.choices[0].text


def close(a: float, b: float) -> bool:
    # The same forward pass, batched with whatever else the engine runs: float32 differs in
    # its last digits only.
    return math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-4)


def test_echo_with_logprobs_scores_the_prompt_as_the_model_generated_it(
    client: openai.OpenAI,
) -> None:
    """The log-likelihood request of evaluation harnesses (echo, logprobs, max_tokens 1): the
    prompt's tokens come first, the first without a logprob, and a token's logprob as part of
    the prompt is the logprob the model gave it when it generated it (vLLM reports raw
    logprobs: before allowed_token_ids, which here fixes what is generated)."""
    ids = tokenize(client, PROMPTS[0])
    generated = complete(
        client,
        ids,
        max_tokens=3,
        temperature=0,
        logprobs=1,
        extra_body={"allowed_token_ids": [TOKEN], "ignore_eos": True},
    )
    made = generated.choices[0].logprobs
    scored = complete(
        client, [ids + [TOKEN] * 3], max_tokens=1, temperature=0, logprobs=1, echo=True
    )
    logprobs = scored.choices[0].logprobs
    assert len(logprobs.tokens) == len(ids) + 3 + 1
    assert logprobs.tokens[len(ids) : len(ids) + 3] == made.tokens
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    for got, want in zip(
        logprobs.token_logprobs[len(ids) : len(ids) + 3], made.token_logprobs, strict=True
    ):
        assert close(got, want), (got, want)
    # The most likely token at each prompt position is at least as likely as the prompt's.
    for lp, top in zip(logprobs.token_logprobs[1:], logprobs.top_logprobs[1:], strict=True):
        assert lp <= 0 and len(top) == 1 and max(top.values()) >= lp - 1e-4
    assert scored.choices[0].text.startswith(client_text(client, ids))
    offsets = logprobs.text_offset
    assert offsets == sorted(offsets) and offsets[0] == 0


def test_echo_with_no_tokens_scores_the_prompt_alone(client: openai.OpenAI) -> None:
    """max_tokens 0 with echo (vLLM's server takes it): the prompt and its logprobs only."""
    ids = tokenize(client, PROMPTS[1])
    scored = complete(client, PROMPTS[1], max_tokens=0, echo=True, logprobs=1)
    choice = scored.choices[0]
    assert choice.text == PROMPTS[1] and choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == len(ids) == scored.usage.prompt_tokens
    assert choice.logprobs.token_logprobs[0] is None
    assert all(lp is not None for lp in choice.logprobs.token_logprobs[1:])
    assert scored.usage.completion_tokens == 0


def client_text(client: openai.OpenAI, ids: list[int]) -> str:
    reply = client.post("/../detokenize", body={"model": MODEL, "tokens": ids}, cast_to=object)
    return str(reply["prompt"])  # type: ignore[index]


def test_prompt_logprobs_list_each_prompt_token_and_its_rank(client: openai.OpenAI) -> None:
    ids = tokenize(client, PROMPTS[1])
    answer = complete(client, ids, max_tokens=2, extra_body={"prompt_logprobs": 2})
    listed = answer.choices[0].model_extra["prompt_logprobs"]
    assert len(listed) == len(ids) and listed[0] is None
    echoed = complete(client, ids, max_tokens=1, temperature=0, logprobs=2, echo=True)
    for position, (token_id, entries) in enumerate(zip(ids[1:], listed[1:], strict=True), 1):
        mine = entries[str(token_id)]
        assert mine["rank"] >= 1 and mine["logprob"] <= 0
        assert close(mine["logprob"], echoed.choices[0].logprobs.token_logprobs[position])
        ranked = sorted(e["rank"] for key, e in entries.items() if key != str(token_id))
        assert ranked[:2] == [1, 2] or mine["rank"] in (1, 2)
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        extra_body={"prompt_logprobs": 0},
    )
    listed = chat.model_extra["prompt_logprobs"]
    assert listed[0] is None and all(len(entries) == 1 for entries in listed[1:])
    assert len(listed) == chat.usage.prompt_tokens


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    ("route", "fields", "named", "says"),
    [
        ("/v1/completions", {"prompt": [1, "a"]}, "prompt", "list of token ids"),
        ("/v1/completions", {"prompt": []}, "prompt", "empty"),
        ("/v1/completions", {"prompt": ["a", ""]}, "prompt[1]", "empty"),
        ("/v1/completions", {"prompt": [5, 10**6]}, "prompt[1]", "vocabulary"),
        ("/v1/completions", {"prompt": [[5], [5, -1]]}, "prompt[1][1]", ">= 0"),
        ("/v1/completions", {"prompt": [[5], [5, 10**6]]}, "prompt[1][1]", "vocabulary"),
        ("/v1/completions", {"prompt": ["a"] * 9, "n": 2, "seed": 1}, "prompt", "limit of 16"),
        ("/v1/completions", {"prompt": ["a", "b"], "documents": ["d"]}, "documents", ""),
        ("/v1/completions", {"prompt": "a", "prompt_logprobs": 21}, "prompt_logprobs", "20"),
        ("/v1/completions", {"prompt": "a", "prompt_logprobs": -1}, "prompt_logprobs", ""),
        (
            "/v1/completions",
            {"prompt": "a", "prompt_logprobs": 1, "stream": True},
            "prompt_logprobs",
            "stream",
        ),
        ("/v1/completions", {"prompt": "a", "echo": "yes"}, "echo", ""),
        ("/v1/completions", {"prompt": "a", "max_tokens": 0}, "max_tokens", "(0 with echo)"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "a"}], "echo": True},
            "echo",
            "/v1/completions",
        ),
    ],
)
def test_bad_prompts_are_400_naming_the_field(
    mesh: LocalMesh, path: str, route: str, fields: dict[str, Any], named: str, says: str
) -> None:
    body = {"model": MODEL, "max_tokens": 2, **fields}
    reply = httpx.post(f"http://127.0.0.1:{openai_port(mesh, path)}{route}", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["message"].startswith(f"{named}: ") and says in error["message"], error
    assert error["param"] == named


async def test_cancelling_a_batch_frees_every_engine_request(
    client: openai.OpenAI, mesh: LocalMesh
) -> None:
    stream = complete(
        client,
        ["one", "two", "three", "four"],
        max_tokens=2000,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    seen = set()
    for chunk in stream:
        seen.update(choice.index for choice in chunk.choices)
        if len(seen) == 4:
            break
    stream.close()
    # The batch's 8,000 tokens would take minutes.
    await engines_empty(mesh)


async def test_grpc_echo_and_prompt_logprobs_come_on_each_choices_first_message(
    llm: llm_pb2_grpc.LLMServiceStub,
) -> None:
    request = llm_pb2.GenerateRequest(
        prompt=PROMPTS[0], max_tokens=4, ignore_eos=True, n=2, echo=True, prompt_logprobs=1
    )
    tokens = [token async for token in llm.Generate(request, timeout=120)]
    for choice in (0, 1):
        mine = [token for token in tokens if token.choice == choice]
        assert [t.HasField("prompt") for t in mine] == [True] + [False] * (len(mine) - 1)
        prompt = mine[0].prompt
        assert prompt.text == PROMPTS[0]
        assert len(prompt.token_ids) == len(prompt.token_texts) == len(prompt.logprobs)
        assert not prompt.logprobs[0].HasField("logprob")
        assert all(p.HasField("logprob") and p.rank >= 1 for p in prompt.logprobs[1:])
        assert all(len(p.top_logprobs) == 1 for p in prompt.logprobs[1:])
    assert tokens[-1].usage.prompt_tokens == len(tokens[0].prompt.token_ids)


async def test_get_answer_with_several_choices_answers_each(
    llm: llm_pb2_grpc.LLMServiceStub,
) -> None:
    query = llm_pb2.Query(prompt="choices", max_tokens=5, ignore_eos=True, n=3, seed=11)
    answer = await llm.GetAnswer(query, timeout=120)
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert answer.text == answer.choices[0].text
    assert answer.finish_reason == answer.choices[0].finish_reason
    assert all(c.finish_reason == token_pb2.FINISH_REASON_LENGTH for c in answer.choices)
    assert answer.usage.completion_tokens == 15
    one = await llm.GetAnswer(llm_pb2.Query(prompt="choices", max_tokens=5), timeout=120)
    assert not one.choices and one.text
