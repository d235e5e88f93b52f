"""vLLM's sampling options and structured outputs through the mesh, on both token paths and
both APIs: the answer follows the option (a schema's JSON validates, a regex matches, a bias
decides every token), and what the engine cannot take is refused naming the field."""

from __future__ import annotations

import json
import random
import re
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import httpx
import jsonschema
import openai
import pytest
from grpc import aio

from tests.support import TINY_MODEL, metric_value, positions, scrape_metrics
from tokenmesh.gateway.frontends.openai.protocol import SAMPLING_FIELDS
from tokenmesh.localmesh.mesh import LocalMesh
from tokenmesh.localmesh.probes import engine_empty_at
from tokenmesh.v1 import inference_pb2_grpc, llm_pb2, llm_pb2_grpc, token_pb2

pytestmark = pytest.mark.integration

MODEL = TINY_MODEL.name
PATHS = ("direct", "gateway")
# Bounded strings and numbers: the random tiny model ends such a value soon (the grammar then
# leaves it only the closing tokens).
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "member": {"type": "boolean"},
    },
    "required": ["name", "age", "member"],
    "additionalProperties": False,
}
# A token of the tiny model's vocabulary (32,000 ids), and one past it.
TOKEN = 1000
OUTSIDE = 10**6


def edge_port(mesh: LocalMesh) -> int:
    return mesh.settings.mesh().edge_port


def openai_port(mesh: LocalMesh, path: str) -> int:
    if path == "direct":
        return edge_port(mesh)
    return mesh.replicas("gateway")[0].openai_port or 0


def grpc_address(mesh: LocalMesh, path: str) -> str:
    if path == "direct":
        return f"127.0.0.1:{edge_port(mesh)}"
    return mesh.replicas("gateway")[0].address


@pytest.fixture(params=PATHS)
def client(request: pytest.FixtureRequest, mesh: LocalMesh) -> Iterator[openai.OpenAI]:
    port = openai_port(mesh, request.param)
    with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0) as made:
        yield made


@pytest.fixture(params=PATHS)
async def llm(
    request: pytest.FixtureRequest, mesh: LocalMesh
) -> AsyncIterator[llm_pb2_grpc.LLMServiceStub]:
    async with aio.insecure_channel(grpc_address(mesh, request.param)) as channel:
        yield llm_pb2_grpc.LLMServiceStub(channel)


def chat(client: openai.OpenAI, **fields: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe a member as JSON."}],
        **fields,
    )


def test_every_answer_to_a_json_schema_parses_and_validates(client: openai.OpenAI) -> None:
    """Sampled at temperature 1 from a random model: only the grammar makes these JSON."""
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "member", "schema": SCHEMA, "strict": True},
    }
    for seed in range(4):
        answer = chat(
            client, response_format=response_format, temperature=1.0, seed=seed, max_tokens=200
        )
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content or ""), SCHEMA)


def test_a_streamed_json_object_parses(client: openai.OpenAI) -> None:
    chunks = list(
        chat(
            client,
            response_format={"type": "json_object"},
            temperature=1.0,
            seed=5,
            max_tokens=300,
            stream=True,
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    if finish == ["stop"]:
        assert isinstance(json.loads(text), dict)
    else:
        # Cut short by max_tokens: still the start of an object.
        assert finish == ["length"] and text.lstrip().startswith("{")


def test_regex_and_choice_constrain_a_completion(client: openai.OpenAI) -> None:
    for seed in range(3):
        matched = client.completions.create(
            model=MODEL,
            prompt="Code:",
            max_tokens=20,
            temperature=1.0,
            seed=seed,
            extra_body={"structured_outputs": {"regex": "[a-c]{4}-[0-9]{2}"}},
        )
        assert re.fullmatch("[a-c]{4}-[0-9]{2}", matched.choices[0].text)
        chosen = client.completions.create(
            model=MODEL,
            prompt="Answer:",
            max_tokens=10,
            temperature=1.0,
            seed=seed,
            extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}},
        )
        assert chosen.choices[0].text in ("yes", "no", "maybe")


def counted(mesh: LocalMesh, feature: str) -> float:
    """The workers' count of requests that used a feature."""
    return sum(
        metric_value(
            scrape_metrics(worker.metrics_port or 0),
            "tokenmesh_worker_request_features_total",
            0.0,
            feature=feature,
        )
        for worker in mesh.replicas("worker")
    )


async def test_structured_outputs_on_grpc(
    llm: llm_pb2_grpc.LLMServiceStub, mesh: LocalMesh
) -> None:
    before = counted(mesh, "structured_outputs_json")
    request = llm_pb2.GenerateRequest(
        prompt="A member:",
        max_tokens=200,
        temperature=1.0,
        seed=11,
        structured_outputs=token_pb2.StructuredOutputs(json=json.dumps(SCHEMA)),
    )
    tokens = [token async for token in llm.Generate(request, timeout=120)]
    assert tokens[-1].finish_reason == token_pb2.FINISH_REASON_STOP
    jsonschema.validate(json.loads("".join(token.text for token in tokens)), SCHEMA)
    assert counted(mesh, "structured_outputs_json") == before + 1
    answer = await llm.GetAnswer(
        llm_pb2.Query(
            prompt="Pick one:",
            max_tokens=10,
            temperature=1.0,
            structured_outputs=token_pb2.StructuredOutputs(choice=["red", "green"]),
        ),
        timeout=120,
    )
    assert answer.text in ("red", "green")


async def test_a_logit_bias_of_100_makes_every_token_that_token(
    llm: llm_pb2_grpc.LLMServiceStub, mesh: LocalMesh
) -> None:
    request = llm_pb2.GenerateRequest(
        prompt="Anything", max_tokens=8, ignore_eos=True, temperature=1.0, logit_bias={TOKEN: 100}
    )
    tokens = [token async for token in llm.Generate(request, timeout=120)]
    assert [i for token in tokens for i in token.token_ids] == [TOKEN] * 8
    # The same through OpenAI's API (the same text), and stop_token_ids ends it at once.
    with openai.OpenAI(
        base_url=f"http://127.0.0.1:{edge_port(mesh)}/v1", api_key="-", max_retries=0
    ) as client:
        biased = client.completions.create(
            model=MODEL,
            prompt="Anything",
            max_tokens=8,
            temperature=1.0,
            logit_bias={str(TOKEN): 100},
            extra_body={"ignore_eos": True},
        )
        assert biased.choices[0].text == "".join(token.text for token in tokens)
        stopped = client.completions.create(
            model=MODEL,
            prompt="Anything",
            max_tokens=8,
            logit_bias={str(TOKEN): 100},
            extra_body={"stop_token_ids": [TOKEN]},
        )
        assert stopped.choices[0].finish_reason == "stop"
        assert stopped.usage is not None and stopped.usage.completion_tokens == 1


def refusal(port: int, route: str, body: dict[str, Any]) -> tuple[int, str]:
    reply = httpx.post(f"http://127.0.0.1:{port}{route}", json=body, timeout=60)
    return reply.status_code, reply.json()["error"]["message"]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    ("fields", "named", "says"),
    [
        ({"max_tokens": 10**12}, "max_tokens", "2147483647"),
        ({"presence_penalty": 3}, "presence_penalty", "[-2, 2]"),
        ({"allowed_token_ids": [OUTSIDE]}, "allowed_token_ids", ""),
        ({"logit_bias": {str(OUTSIDE): 5}}, "logit_bias", ""),
        ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs", ""),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs", ""),
        ({"guided_json": {"type": "object"}}, "guided_json", "not supported"),
        ({"response_format": {"type": "yaml"}}, "response_format.type", ""),
    ],
)
def test_what_the_engine_cannot_take_is_400_naming_the_field(
    mesh: LocalMesh, path: str, fields: dict[str, Any], named: str, says: str
) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 4, **fields}
    status, message = refusal(openai_port(mesh, path), "/v1/completions", body)
    assert status == 400, message
    assert message.startswith(f"{named}: ") and says in message


async def test_grpc_names_the_field_vllm_refuses(llm: llm_pb2_grpc.LLMServiceStub) -> None:
    for request, named in (
        (llm_pb2.GenerateRequest(prompt="x", max_tokens=4, min_p=2.0), "min_p"),
        (
            llm_pb2.GenerateRequest(
                prompt="x",
                max_tokens=4,
                structured_outputs=token_pb2.StructuredOutputs(regex="(unclosed"),
            ),
            "structured_outputs",
        ),
    ):
        with pytest.raises(aio.AioRpcError) as refused:
            [token async for token in llm.Generate(request, timeout=60)]
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert (refused.value.details() or "").startswith(f"{named}: ")


# Values of the wrong type, size or range for each new field (a fixed seed: the same cases
# every run).
# Every field the API takes by name, and the others it parses itself.
FUZZED_FIELDS = (*sorted(SAMPLING_FIELDS), "structured_outputs", "response_format", "n", "prompt")
BAD_VALUES: tuple[Any, ...] = (
    "text",
    -(10**20),
    10**20,
    1e300,
    -1e300,
    [None],
    {"": []},
    [[1]],
    {"json": 5},
    {"regex": "["},
    {"choice": []},
    {"grammar": ""},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": "no"}},
    ["x" * 300] * 70,
    list(range(-5, 1100)),
    {str(OUTSIDE): 1.0},
    {"1": 101},
)


def test_fuzzed_fields_are_refused_naming_the_field_and_the_mesh_still_serves(
    mesh: LocalMesh,
) -> None:
    rng = random.Random(32)
    port = edge_port(mesh)
    cases = [(rng.choice(FUZZED_FIELDS), rng.choice(BAD_VALUES)) for _ in range(60)]
    accepted = []
    for field, value in cases:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 3, field: value}
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
        if reply.status_code == 200:
            # Some values are valid for some fields (a large seed, a known token list).
            accepted.append((field, value))
            continue
        assert reply.status_code == 400, (field, value, reply.text)
        message = reply.json()["error"]["message"]
        assert message.split(":")[0].split(".")[0].split("[")[0] == field, (field, value, message)
    assert len(accepted) < len(cases) // 2, accepted
    # Still serving.
    reply = httpx.post(
        f"http://127.0.0.1:{port}/v1/completions",
        json={"model": MODEL, "prompt": "still here", "max_tokens": 3},
        timeout=60,
    )
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] >= 1


def test_several_choices_whole_and_streamed(client: openai.OpenAI) -> None:
    """n: 3, each choice indexed and ended, usage counting all of them; sampled with one seed,
    the choices differ (vLLM seeds choice i with seed + i)."""
    whole = chat(
        client, n=3, max_tokens=6, temperature=1.0, seed=4, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in whole.choices)
    assert whole.usage is not None and whole.usage.completion_tokens == 18
    assert len({c.message.content for c in whole.choices}) > 1
    chunks = list(
        chat(
            client,
            n=3,
            max_tokens=6,
            temperature=1.0,
            seed=4,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    texts: dict[int, str] = {}
    finished: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finished[choice.index] = choice.finish_reason
    assert finished == {0: "length", 1: "length", 2: "length"}
    # The same seed, the same choices, streamed or whole.
    assert [texts[i] for i in range(3)] == [c.message.content for c in whole.choices]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 18


async def test_several_choices_on_grpc_each_numbered_from_zero(
    llm: llm_pb2_grpc.LLMServiceStub,
) -> None:
    request = llm_pb2.GenerateRequest(prompt="choices", max_tokens=7, ignore_eos=True, n=3)
    tokens = [token async for token in llm.Generate(request, timeout=120)]
    for choice in range(3):
        mine = [token for token in tokens if token.choice == choice]
        assert positions(mine) == list(range(7))
        assert [bool(t.finish_reason) for t in mine] == [False] * (len(mine) - 1) + [True]
    assert [token.HasField("usage") for token in tokens] == [False] * (len(tokens) - 1) + [True]
    assert tokens[-1].usage.completion_tokens == 21


async def test_cancelling_several_choices_frees_every_engine_request(
    llm: llm_pb2_grpc.LLMServiceStub, mesh: LocalMesh
) -> None:
    request = llm_pb2.GenerateRequest(prompt="many", max_tokens=2000, ignore_eos=True, n=4)
    call = llm.Generate(request, timeout=120)
    seen = set()
    async for token in call:
        seen.add(token.choice)
        if len(seen) == 4:
            break
    call.cancel()
    # The four choices' 8,000 tokens would take minutes.
    await engines_empty(mesh)


async def engines_empty(mesh: LocalMesh) -> None:
    """Nothing running or waiting on any worker within seconds (after a cancel). Any empty
    report will do: the busy engine reported its requests running until the abort, an idle
    one reports no more."""
    for worker in mesh.replicas("worker"):
        async with aio.insecure_channel(worker.address) as channel:
            await engine_empty_at(inference_pb2_grpc.InferenceServiceStub(channel), 0, within=10)
