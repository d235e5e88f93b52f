"""The worker's reading of a conversation's output with vLLM's own parsers (worker/parsing.py),
fed a fixed text token by token, where the random tiny model cannot be made to call a tool or
reason: the hermes parser finds the call, deepseek_r1 the reasoning; the Token messages they
become make OpenAI answers that the official SDK's models take, streamed and whole alike."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from transformers import AutoTokenizer
from vllm.tokenizers import get_tokenizer

from tests.support import TINY_MODEL
from tokenmesh.common.errors import InvalidArgument
from tokenmesh.common.openai_answers import EventStream, Shape, WholeAnswer
from tokenmesh.common.tokens import merge
from tokenmesh.v1 import inference_pb2, token_pb2
from tokenmesh.worker.config import WorkerSettings
from tokenmesh.worker.outputs import Tokens
from tokenmesh.worker.parsing import OutputParsers
from tokenmesh.worker.sampling import engine_options
from tokenmesh.worker.servicer import token_message

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
QUESTION = [{"role": "user", "content": "Weather in Oslo?"}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The tiny model's tokenizer with DeepSeek-R1's <think> tokens added (its reasoning
    parser finds them by id)."""
    where = tmp_path_factory.mktemp("tokenizer")
    made = AutoTokenizer.from_pretrained(TINY_MODEL)
    made.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    made.save_pretrained(where)
    shutil.copy(Path(TINY_MODEL) / "config.json", where)
    return get_tokenizer(str(where))


def settings(**fields: Any) -> WorkerSettings:
    return WorkerSettings(model=str(TINY_MODEL), **fields)


def request(tool_choice: Any = "auto", tools: list[Any] | None = TOOLS) -> Any:
    calling = None
    if tools is not None:
        calling = inference_pb2.ToolCalling(
            tools_json=json.dumps(tools), tool_choice_json=json.dumps(tool_choice)
        )
    return engine_options(inference_pb2.SamplingParams(max_tokens=100), "", QUESTION, calling)


def generate(parsers: OutputParsers, options: Any, text: str, tokenizer: Any) -> list[Tokens]:
    """The text as the engine streams it, one token an output (each output's text the decoded
    difference), through the request's parsing; the last ends with stop."""
    parsing = parsers.for_request(options)
    assert parsing is not None
    ids = tokenizer.encode(text, add_special_tokens=False)
    outputs, before = [], ""
    for position, token_id in enumerate(ids):
        decoded = tokenizer.decode(ids[: position + 1], skip_special_tokens=False)
        end = token_pb2.FINISH_REASON_STOP if position == len(ids) - 1 else 0
        tokens = Tokens(position, [token_id], decoded[len(before) :], end)
        before = decoded
        parsing.parse(tokens, [1, 2, 3])
        outputs.append(tokens)
    outputs[-1].last, outputs[-1].completion_tokens = True, len(ids)
    return outputs


def answers(outputs: list[Tokens]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The whole answer and the streamed chunks the Token messages make."""
    shape = Shape(True, "tiny-llama", "chatcmpl-1", 0, {})
    whole, events = WholeAnswer(shape, False), EventStream(shape, False, False)
    chunks = events.start()
    for tokens in outputs:
        message = token_message(tokens)
        whole.add(message)
        chunks += events.token(message)
    parsed = [
        json.loads(line.removeprefix(b"data: "))
        for line in chunks.split(b"\n\n")
        if line.startswith(b"data: {")
    ]
    return whole.body(), parsed


def test_hermes_finds_a_call_and_the_answers_are_openais(tokenizer: Any) -> None:
    parsers = OutputParsers(
        settings(tool_call_parser="hermes", enable_auto_tool_choice=True), tokenizer, None
    )
    outputs = generate(parsers, request(), f"Let me check.{CALL}", tokenizer)
    assert outputs[-1].finish_reason == token_pb2.FINISH_REASON_TOOL_CALLS
    body, chunks = answers(outputs)
    message = ChatCompletion.model_validate(body).choices[0].message
    assert message.content == "Let me check."
    [call] = message.tool_calls or []
    assert call.function.name == "get_weather" and call.id
    assert json.loads(call.function.arguments) == {"city": "Oslo"}
    # Streamed: the same call, built from OpenAI's deltas.
    streamed = [ChatCompletionChunk.model_validate(chunk) for chunk in chunks]
    pieces = [piece for chunk in streamed for piece in chunk.choices[0].delta.tool_calls or ()]
    assert pieces[0].id == call.id and pieces[0].function and pieces[0].function.name
    assert all(piece.id is None for piece in pieces[1:])
    arguments = "".join(piece.function.arguments or "" for piece in pieces if piece.function)
    assert json.loads(arguments) == {"city": "Oslo"}
    assert "".join(chunk.choices[0].delta.content or "" for chunk in streamed) == "Let me check."
    assert streamed[-1].choices[0].finish_reason == "tool_calls"


def test_merged_messages_keep_each_call_whole(tokenizer: Any) -> None:
    """Messages merged on the way (a slow reader, the quota) join a call's argument pieces."""
    parsers = OutputParsers(
        settings(tool_call_parser="hermes", enable_auto_tool_choice=True), tokenizer, None
    )
    outputs = generate(parsers, request(), CALL + CALL, tokenizer)
    first, *rest = (token_message(tokens) for tokens in outputs)
    for later in rest:
        merge(first, later)
    assert [(call.index, call.name) for call in first.tool_calls] == [
        (0, "get_weather"),
        (1, "get_weather"),
    ]
    assert [json.loads(call.arguments) for call in first.tool_calls] == [{"city": "Oslo"}] * 2


def test_without_tools_the_text_is_left_alone(tokenizer: Any) -> None:
    parsers = OutputParsers(
        settings(tool_call_parser="hermes", enable_auto_tool_choice=True), tokenizer, None
    )
    assert parsers.for_request(request(tools=None)) is None
    assert parsers.for_request(request(tool_choice="none")) is None


def test_auto_needs_a_worker_that_enables_it(tokenizer: Any) -> None:
    parsers = OutputParsers(settings(), tokenizer, None)
    with pytest.raises(InvalidArgument) as refused:
        parsers.for_request(request("auto"))
    assert refused.value.field == "tool_choice"
    # Forced calls need no parser: their JSON schema binds the output, read back as the calls.
    parsing = parsers.for_request(request("required"))
    assert parsing is not None and parsing.options.structured_outputs is not None
    assert parsing.options.structured_outputs.json["type"] == "array"


def test_reasoning_comes_apart_from_the_answer(tokenizer: Any) -> None:
    parsers = OutputParsers(settings(reasoning_parser="deepseek_r1"), tokenizer, None)
    outputs = generate(parsers, request(tools=None), "Oslo is north.</think>It is cold.", tokenizer)
    body, chunks = answers(outputs)
    message = body["choices"][0]["message"]
    assert message["content"] == "It is cold."
    assert message["reasoning_content"] == message["reasoning"] == "Oslo is north."
    streamed = "".join(c["choices"][0]["delta"].get("reasoning_content") or "" for c in chunks)
    assert streamed == "Oslo is north."
    assert all(token_message(tokens).text != "</think>" for tokens in outputs)
