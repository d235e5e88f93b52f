"""OpenAI's function calling through the mesh, with the official SDK, on both token paths: the
tiny model's template renders the tools, vLLM's hermes parser reads the calls back, "required"
and named functions are enforced by structured output (so every call's arguments validate
against its function's parameters, from a random model), a conversation that sends a call's
result back continues, and what cannot be called is refused naming the field."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.integration.test_engine_options import PATHS, openai_port
from tests.support import TINY_MODEL, metric_value, scrape_metrics
from tokenmesh.localmesh.mesh import LocalMesh

pytestmark = pytest.mark.integration

MODEL = TINY_MODEL.name
# Bounded values: the random model ends each soon (the grammar then leaves only the closing).
WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME: dict[str, Any] = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "JST"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
# Strict, as OpenAI's API has it: the arguments are bound to the parameters (without it,
# vLLM binds only the call's envelope unless the worker's tool_strict_level is parameter).
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "A forecast.",
            "parameters": WEATHER,
            "strict": True,
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME, "strict": True}},
]
PARAMETERS = {"get_weather": WEATHER, "get_time": TIME}
QUESTION = [{"role": "user", "content": "What is the weather in Oslo for three days?"}]
CALLED = {"name": "get_time", "arguments": "{}"}


@pytest.fixture(params=PATHS)
def client(request: pytest.FixtureRequest, mesh: LocalMesh) -> Iterator[openai.OpenAI]:
    port = openai_port(mesh, request.param)
    with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0) as made:
        yield made


def ask(client: openai.OpenAI, **fields: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL,
        messages=fields.pop("messages", QUESTION),
        tools=fields.pop("tools", TOOLS),
        max_tokens=fields.pop("max_tokens", 300),
        temperature=1.0,
        **fields,
    )


def streamed(client: openai.OpenAI, **fields: Any) -> tuple[list[dict[str, Any]], str, str]:
    """A streamed answer's tool calls as OpenAI's deltas build them (id, type and name on a
    call's first delta; its arguments in pieces), its content and its finish reason."""
    calls: dict[int, dict[str, Any]] = {}
    content, reasons = "", []
    for chunk in ask(client, stream=True, **fields):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        content += delta.content or ""
        for piece in delta.tool_calls or ():
            call = calls.get(piece.index)
            if call is None:
                assert piece.id and piece.type == "function" and piece.function.name, piece
                call = calls[piece.index] = {"id": piece.id, "name": piece.function.name}
                call["arguments"] = ""
            else:
                assert piece.id is None and piece.function.name is None, piece
            call["arguments"] += piece.function.arguments or ""
        if choice.finish_reason:
            reasons.append(choice.finish_reason)
    assert len(reasons) == 1, reasons
    return [calls[index] for index in sorted(calls)], content, reasons[0]


def check_call(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), PARAMETERS[name])


def test_required_calls_validate_against_their_functions(client: openai.OpenAI) -> None:
    for seed in range(3):
        answer = ask(client, tool_choice="required", seed=seed)
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        calls = choice.message.tool_calls
        assert calls, choice.message
        assert len({call.id for call in calls}) == len(calls)
        for call in calls:
            check_call(call.function.name, call.function.arguments)
        assert not choice.message.content


def test_required_calls_stream_as_openai_deltas(client: openai.OpenAI) -> None:
    calls, content, reason = streamed(client, tool_choice="required", seed=7)
    assert reason == "tool_calls" and calls and not content.strip()
    for call in calls:
        check_call(call["name"], call["arguments"])


def test_a_named_function_is_the_one_called(client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    answer = ask(client, tool_choice=named, seed=3)
    choice = answer.choices[0]
    # A named call ends as OpenAI's do: "stop".
    assert choice.finish_reason == "stop", choice
    [call] = choice.message.tool_calls
    assert call.function.name == "get_time"
    check_call("get_time", call.function.arguments)
    [streamed_call], _, reason = streamed(client, tool_choice=named, seed=3)
    assert reason == "stop" and streamed_call["name"] == "get_time"
    check_call("get_time", streamed_call["arguments"])


def test_one_call_only_when_parallel_calls_are_off(client: openai.OpenAI) -> None:
    for seed in range(3):
        answer = ask(client, tool_choice="required", parallel_tool_calls=False, seed=seed)
        assert len(answer.choices[0].message.tool_calls) == 1


def test_a_conversation_sends_the_result_back_and_continues(client: openai.OpenAI) -> None:
    first = ask(client, tool_choice="required", parallel_tool_calls=False, seed=11)
    [call] = first.choices[0].message.tool_calls
    conversation = [
        *QUESTION,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 degrees."},
    ]
    answer = ask(client, messages=conversation, tool_choice="none", max_tokens=8, seed=1)
    choice = answer.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.message.tool_calls is None
    # The call and its result were rendered into the prompt (the template's <tool_call> and
    # <tool_response>): it is longer than the question alone by at least their text.
    alone = ask(client, tool_choice="none", max_tokens=8, seed=1)
    added = len(call.function.arguments) + len("Sunny, 21 degrees.")
    assert answer.usage.prompt_tokens - alone.usage.prompt_tokens >= added // 4


def test_auto_lets_the_model_answer_whole_and_streamed(client: openai.OpenAI) -> None:
    """The random model rarely writes a <tool_call> tag: auto then answers with content (the
    parser's reading of a model that does call is tests/unit/test_output_parsing.py's)."""
    answer = ask(client, tool_choice="auto", max_tokens=16, seed=2)
    choice = answer.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    if choice.finish_reason != "tool_calls":
        assert choice.message.content and not choice.message.tool_calls
    calls, content, reason = streamed(client, max_tokens=16, seed=2)
    # The same seed: the same answer, streamed.
    assert reason == choice.finish_reason
    assert content == (choice.message.content or "")
    assert len(calls) == len(choice.message.tool_calls or ())


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"tools": None, "tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "nowhere"}}}, "tool_choice"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
        ({"tools": [TOOLS[0]] * 129}, "tools"),
        ({"tools": "get_weather"}, "tools"),
        (
            {"messages": [*QUESTION, {"role": "tool", "content": "42"}]},
            "messages[1].tool_call_id",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": "hi",
                        "tool_calls": [{"id": "1", "type": "function", "function": CALLED}],
                    }
                ]
            },
            "messages[0].tool_calls",
        ),
    ],
)
def test_what_cannot_be_called_is_refused_naming_the_field(
    client: openai.OpenAI, fields: dict[str, Any], named: str
) -> None:
    fields = dict(fields)  # shared by both paths' runs
    tools = fields.pop("tools", TOOLS)
    extra = {} if tools is None else {"tools": tools}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=MODEL,
            messages=fields.pop("messages", QUESTION),
            max_tokens=4,
            **extra,
            **fields,
        )
    body = refused.value.body
    assert isinstance(body, dict), body
    # The field leads the message and is the param, whichever process refused it.
    assert body["message"].startswith(named) and (body["param"] or "").startswith(named), body


def test_tool_requests_are_counted_by_choice(mesh: LocalMesh, client: openai.OpenAI) -> None:
    def counted() -> float:
        return sum(
            metric_value(
                scrape_metrics(worker.metrics_port),
                "tokenmesh_worker_request_features_total",
                0.0,
                feature="tools_required",
            )
            for worker in mesh.replicas("worker")
        )

    before = counted()
    ask(client, tool_choice="required", seed=0, max_tokens=120)
    assert counted() == before + 1


# Values of every JSON type and shape, some near what the fields take.
BAD_VALUES: list[Any] = [
    None,
    -1,
    2**40,
    1.5,
    True,
    "",
    "x" * 5000,
    "required",
    [],
    [1, 2],
    [[[]]],
    {},
    {"type": "function"},
    {"type": "function", "function": {"name": 5}},
    [{"type": "nope"}],
    [{"type": "function", "function": {"name": "f", "parameters": "not a schema"}}],
    [{"type": "function", "function": {"name": "f" * 300}}] * 200,
    [{"id": 1, "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}],
]
FUZZED = ("tools", "tool_choice", "parallel_tool_calls", "tool_calls", "tool_call_id")


def test_fuzzed_tool_fields_are_refused_naming_the_field_and_the_mesh_still_serves(
    mesh: LocalMesh,
) -> None:
    """Each case one field of function calling set to a random value through the edge: an
    answer, or a 400 naming the field it is in; never a 5xx, and the mesh serves after."""
    rng = random.Random(23)
    url = f"http://127.0.0.1:{mesh.settings.mesh().edge_port}/v1/chat/completions"
    refused = 0
    for _ in range(50):
        field, value = rng.choice(FUZZED), rng.choice(BAD_VALUES)
        body: dict[str, Any] = {"model": MODEL, "messages": list(QUESTION), "tools": TOOLS}
        body["max_tokens"] = 3
        named = field
        if field in ("tool_calls", "tool_call_id"):
            # In the conversation: an assistant's calls, or a tool result's id.
            role = "assistant" if field == "tool_calls" else "tool"
            body["messages"] = [*QUESTION, {"role": role, "content": "c", field: value}]
            named = "messages"
        else:
            body[field] = value
        reply = httpx.post(url, json=body, timeout=60)
        if reply.status_code == 200:
            continue
        refused += 1
        assert reply.status_code == 400, (field, value, reply.text)
        message = reply.json()["error"]["message"]
        assert re.split(r"[.:\[]", message)[0] == named, (field, value, message)
    assert refused > 25
    still = httpx.post(
        url, json={"model": MODEL, "messages": QUESTION, "max_tokens": 3}, timeout=60
    )
    assert still.status_code == 200 and still.json()["usage"]["completion_tokens"] >= 1
