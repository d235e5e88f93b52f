"""OpenAI request models and response shapes (the HTTP API's logic, without a server)."""

from __future__ import annotations

import json

import pytest

from tokenmesh.common.errors import InvalidArgument, error_body
from tokenmesh.common.openai_answers import (
    EventStream,
    Shape,
    WholeAnswer,
    chat_logprobs,
    completion_logprobs,
    per_token,
)
from tokenmesh.gateway.frontends.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    parse,
)
from tokenmesh.v1 import token_pb2


def chat(**fields: object) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return parse(ChatCompletionRequest, json.dumps(body).encode())


def test_a_missing_field_is_named() -> None:
    with pytest.raises(InvalidArgument) as error:
        parse(CompletionRequest, b'{"model": "m"}')
    assert error.value.field == "prompt"


def test_a_body_that_is_not_json_is_refused() -> None:
    with pytest.raises(InvalidArgument) as error:
        parse(CompletionRequest, b"{nope")
    assert error.value.field == "body"


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"n": 0}, "n"),
        ({"n": 2**31}, "n"),
        ({"guided_json": {"type": "object"}}, "guided_json"),
        ({"echo": True}, "echo"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"min_tokens": "two"}, "min_tokens"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias"),
        ({"stop_token_ids": [1.5]}, "stop_token_ids"),
        ({"presence_penalty": "high"}, "presence_penalty"),
        ({"structured_outputs": {"regex": 5}}, "structured_outputs"),
        ({"structured_outputs": {"jsn": "{}"}}, "structured_outputs"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "response_format",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"messages": [{"role": "developer", "content": "x"}]}, "messages[0].role"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "x", "audio": {}}]}, "messages.0.audio"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": {"type": "function"}}, "tools"),
    ],
)
def test_what_would_change_the_answer_but_is_not_supported_is_refused_by_name(
    fields: dict[str, object], named: str
) -> None:
    with pytest.raises(InvalidArgument) as error:
        chat(**fields).generate_request(4096)
    assert error.value.field == named


def test_sampling_options_reach_the_generate_request_by_their_names() -> None:
    generate = chat(
        presence_penalty=0.5,
        frequency_penalty=-1,
        repetition_penalty=1.1,
        top_k=5,
        min_p=0.05,
        min_tokens=2,
        stop_token_ids=[7],
        bad_words=["bad"],
        allowed_token_ids=[1, 2],
        logit_bias={"2": 100},
        include_stop_str_in_output=True,
        seed=3,
        ignore_eos=True,
        stream_interval=4,
    ).generate_request(4096)
    assert (generate.presence_penalty, generate.frequency_penalty) == (0.5, -1.0)
    assert generate.repetition_penalty == pytest.approx(1.1)
    assert (generate.top_k, generate.min_tokens, list(generate.stop_token_ids)) == (5, 2, [7])
    assert generate.min_p == pytest.approx(0.05)
    assert list(generate.bad_words) == ["bad"] and list(generate.allowed_token_ids) == [1, 2]
    assert dict(generate.logit_bias) == {2: 100.0} and generate.include_stop_str_in_output
    assert (generate.seed, generate.ignore_eos, generate.stream_interval) == (3, True, 4)
    assert not generate.HasField("structured_outputs")


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 3}}}


@pytest.mark.parametrize(
    ("fields", "constraint"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": SCHEMA, "strict": True},
                }
            },
            {"json": SCHEMA},
        ),
        ({"response_format": {"type": "json_object"}}, {"json_object": True}),
        ({"response_format": {"type": "text"}}, None),
        ({"structured_outputs": {"json": SCHEMA}}, {"json": SCHEMA}),
        ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, {"json": SCHEMA}),
        ({"structured_outputs": {"regex": "[0-9]+"}}, {"regex": "[0-9]+"}),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, {"choice": ["yes", "no"]}),
        ({"structured_outputs": {"grammar": 'root ::= "a"'}}, {"grammar": 'root ::= "a"'}),
    ],
)
def test_response_format_and_structured_outputs_become_one_constraint(
    fields: dict[str, object], constraint: dict[str, object] | None
) -> None:
    """As vLLM's server makes them: a schema keeps its integers (JSON text, not a Struct)."""
    for model in (ChatCompletionRequest, CompletionRequest):
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "prompt": "p"}
        if model is CompletionRequest:
            body.pop("messages")
        else:
            body.pop("prompt")
        generate = parse(model, json.dumps(body | fields).encode()).generate_request(4096)
        if constraint is None:
            assert not generate.HasField("structured_outputs")
            continue
        made = generate.structured_outputs
        if "json" in constraint:
            assert json.loads(made.json) == constraint["json"]
            assert '"maximum": 3' in made.json or '"maximum":3' in made.json
        else:
            assert {
                "regex": made.regex,
                "choice": list(made.choice),
                "grammar": made.grammar,
                "json_object": made.json_object,
            }[next(iter(constraint))] == next(iter(constraint.values()))


def test_a_chat_becomes_a_generate_of_its_last_user_message_and_its_messages() -> None:
    request = chat(
        messages=[
            {"role": "system", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "one "}, {"type": "text", "text": "two"}],
            },
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "three"},
        ],
        max_completion_tokens=7,
        stop="x",
        temperature=0.5,
        logprobs=True,
        top_logprobs=3,
        documents=["d"],
    )
    generate = request.generate_request(4096)
    assert (generate.prompt, generate.max_tokens, list(generate.stop)) == ("three", 7, ["x"])
    assert (generate.logprobs, generate.top_logprobs, list(generate.documents)) == (True, 3, ["d"])
    assert generate.temperature == pytest.approx(0.5)
    messages = request.conversation("context + three")
    assert [(m.role, m.content) for m in messages] == [
        ("system", "be brief"),
        ("user", "one two"),
        ("assistant", "ok"),
        ("user", "context + three"),
    ]


def test_completions_default_to_openais_16_tokens_and_chats_to_the_cap() -> None:
    completion = parse(CompletionRequest, b'{"model": "m", "prompt": "p"}')
    assert completion.generate_request(4096).max_tokens == 16
    # A chat naming no limit asks for the cap, which the worker cuts to what the context
    # leaves (max_tokens_within_context, set by the API for exactly these).
    assert chat().max_tokens_named is None
    assert chat().generate_request(4096).max_tokens == 4096


def test_a_merged_message_is_split_into_its_tokens_by_their_text_lengths() -> None:
    token = token_pb2.Token(
        text="héllo",
        token_ids=[1, 2],
        text_lengths=[3, 3],
        logprob=-0.5,
        following_logprobs=[token_pb2.PositionLogprobs(logprob=-1.5)],
    )
    assert [(text, logprob) for text, logprob, _ in per_token(token)] == [
        ("hé", -0.5),
        ("llo", -1.5),
    ]


def test_the_fast_chunk_is_the_same_json_as_the_whole_chunk() -> None:
    for is_chat in (True, False):
        shape = Shape.of(Shape.new_answer(is_chat, "m", False, False), {})
        head, tail = shape.text_chunk_parts()
        fast = json.loads((head + json.dumps('a "quoted" ü').encode() + tail)[6:])
        piece = {"content": 'a "quoted" ü'} if is_chat else 'a "quoted" ü'
        key = "delta" if is_chat else "text"
        whole = shape.chunk({"index": 0, key: piece, "logprobs": None, "finish_reason": None})
        assert fast == json.loads(whole[6:])


def test_errors_have_openais_shape_and_type() -> None:
    assert error_body("bad", 400, "max_tokens") == {
        "error": {
            "message": "bad",
            "type": "invalid_request_error",
            "param": "max_tokens",
            "code": None,
        }
    }
    assert error_body("no", 429)["error"]["type"] == "rate_limit_error"
    assert error_body("down", 503)["error"]["type"] == "service_unavailable"


def test_every_chunk_validates_against_the_openai_sdks_own_models() -> None:
    """The SDK parses leniently; its pydantic models, validated, hold each field's type."""
    from openai.types import Completion
    from openai.types.chat import ChatCompletionChunk

    token = token_pb2.Token(
        text="hi",
        token_ids=[1],
        logprob=-0.25,
        top_logprobs=[token_pb2.TokenLogprob(text="ho", logprob=-1.0)],
        finish_reason=token_pb2.FINISH_REASON_LENGTH,
        usage=token_pb2.Usage(prompt_tokens=3, completion_tokens=1),
    )
    extra = {"tokenmesh": {"degraded": "reranker", "warnings": ["reranker_unavailable: x"]}}
    for is_chat, model in ((True, ChatCompletionChunk), (False, Completion)):
        shape = Shape.of(Shape.new_answer(is_chat, "m", False, False), extra)
        head, tail = shape.text_chunk_parts()
        piece = {"content": "hi"} if is_chat else "hi"
        logprobs = chat_logprobs(token) if is_chat else completion_logprobs(token, 0)
        chunks = [
            head + json.dumps("hi").encode() + tail,
            shape.chunk(
                {
                    "index": 0,
                    ("delta" if is_chat else "text"): piece,
                    "logprobs": logprobs,
                    "finish_reason": "length",
                }
            ),
            shape.usage_chunk(token),
        ]
        # The SDK's Completion (streamed completions too) requires a finish reason, which
        # OpenAI's own streams leave null until the last chunk.
        for chunk in chunks if is_chat else chunks[1:]:
            assert chunk.startswith(b"data: ") and chunk.endswith(b"\n\n")
            parsed = model.model_validate(json.loads(chunk[6:]))
            assert parsed.id == shape.id and parsed.model == "m"
        assert model.model_validate(json.loads(chunks[-1][6:])).usage.total_tokens == 4


def events(data: bytes) -> list[str]:
    assert data.endswith(b"\n\n")
    return [event.removeprefix("data: ") for event in data.decode().split("\n\n") if event]


def test_a_stream_of_messages_becomes_its_events_with_usage_and_done_after_the_last() -> None:
    """What a worker sends (GenerateOpenAI) and the gateway's own API writes: a chat's role
    first, one chunk per message, the usage chunk when asked and [DONE] after the last."""
    from openai.types.chat import ChatCompletionChunk

    shape = Shape.of(Shape.new_answer(True, "m", False, False), {})
    stream = EventStream(shape, logprobs=False, include_usage=True)
    middle = token_pb2.Token(text="Hé", token_ids=[5, 6], text_lengths=[1, 2])
    last = token_pb2.Token(
        text="!",
        token_ids=[7],
        finish_reason=token_pb2.FINISH_REASON_STOP,
        usage=token_pb2.Usage(prompt_tokens=3, completion_tokens=3),
    )
    sent = [*events(stream.start()), *events(stream.token(middle)), *events(stream.token(last))]
    assert sent[-1] == "[DONE]"
    chunks = [ChatCompletionChunk.model_validate_json(event) for event in sent[:-1]]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].delta.content for c in chunks[1:3]] == ["Hé", "!"]
    assert [c.choices[0].finish_reason for c in chunks[1:3]] == [None, "stop"]
    usage = chunks[3].usage
    assert chunks[3].choices == [] and usage is not None and usage.total_tokens == 6
    failed = events(EventStream.failed(error_body("deadline", 504)))
    assert json.loads(failed[0])["error"]["message"] == "deadline" and failed[1] == "[DONE]"


def test_a_whole_answer_gathers_its_text_logprobs_and_usage() -> None:
    from openai.types import Completion

    answer = WholeAnswer(Shape.of(Shape.new_answer(False, "m", False, False), {}), logprobs=True)
    answer.add(
        token_pb2.Token(
            text="ab",
            token_ids=[1, 2],
            text_lengths=[1, 1],
            logprob=-1.0,
            following_logprobs=[token_pb2.PositionLogprobs(logprob=-1.5)],
        )
    )
    answer.add(
        token_pb2.Token(
            text="c",
            token_ids=[3],
            logprob=-2.0,
            finish_reason=token_pb2.FINISH_REASON_LENGTH,
            usage=token_pb2.Usage(prompt_tokens=2, completion_tokens=3),
        )
    )
    whole = Completion.model_validate(answer.body())
    choice = whole.choices[0]
    assert choice.text == "abc" and choice.finish_reason == "length"
    assert choice.logprobs is not None
    assert choice.logprobs.tokens == ["a", "b", "c"]
    assert choice.logprobs.text_offset == [0, 1, 2]
    assert choice.logprobs.token_logprobs == [-1.0, -1.5, -2.0]
    assert whole.usage is not None and whole.usage.total_tokens == 5


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 10**12),
        ("max_completion_tokens", 2**31),
        ("top_logprobs", -(2**31) - 1),
        ("top_k_documents", 2**40),
        ("seed", 2**63),
    ],
)
def test_a_number_past_what_its_field_holds_is_refused_naming_the_field(
    field: str, value: int
) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], field: value}
    with pytest.raises(InvalidArgument) as refused:
        parse(ChatCompletionRequest, json.dumps(body).encode()).generate_request(4096)
    assert refused.value.field == field
    message = refused.value.message
    assert any(words in message for words in ("less than or equal", "greater than", "out of range"))


def interleaved_choices() -> list[token_pb2.Token]:
    """Two choices' messages as a worker streams them: interleaved, each ending with its
    finish reason, the stream's last with the usage of both."""
    stop, length = token_pb2.FINISH_REASON_STOP, token_pb2.FINISH_REASON_LENGTH
    last = token_pb2.Token(text="d", index=1, token_ids=[4], choice=1, finish_reason=length)
    last.usage.prompt_tokens, last.usage.completion_tokens = 3, 4
    return [
        token_pb2.Token(text="a", index=0, token_ids=[1], choice=0),
        token_pb2.Token(text="c", index=0, token_ids=[3], choice=1),
        token_pb2.Token(text="b", index=1, token_ids=[2], choice=0, finish_reason=stop),
        last,
    ]


def test_several_choices_stream_interleaved_with_their_indexes_and_one_usage() -> None:
    shape = Shape.of(Shape.new_answer(True, "m", True, True), {})
    events = EventStream(shape, logprobs=False, include_usage=True, choices=2)
    data = events.start() + b"".join(events.token(token) for token in interleaved_choices())
    chunks = [
        json.loads(line[len(b"data: ") :])
        for line in data.split(b"\n\n")
        if line.startswith(b"data: {")
    ]
    assert data.endswith(b"data: [DONE]\n\n") and data.count(b"[DONE]") == 1
    roles = [c["choices"][0] for c in chunks[:2]]
    assert [(r["index"], r["delta"]["role"]) for r in roles] == [(0, "assistant"), (1, "assistant")]
    pieces = [c["choices"][0] for c in chunks[2:6]]
    assert [(p["index"], p["delta"]["content"], p["finish_reason"]) for p in pieces] == [
        (0, "a", None),
        (1, "c", None),
        (0, "b", "stop"),
        (1, "d", "length"),
    ]
    assert chunks[6]["choices"] == [] and chunks[6]["usage"]["completion_tokens"] == 4
    assert len(chunks) == 7


def test_a_whole_answer_has_every_choice_in_index_order() -> None:
    whole = WholeAnswer(Shape.of(Shape.new_answer(False, "m", False, False), {}), logprobs=False)
    for token in interleaved_choices():
        whole.add(token)
    body = whole.body()
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "ab", "stop"),
        (1, "cd", "length"),
    ]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}


def test_tool_calls_and_results_reach_the_worker_with_the_tools() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    body = chat(
        messages=[
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "name": "f", "content": "42"},
        ],
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
    )
    body.generate_request(4096)
    _, assistant, tool = body.conversation(None)
    [made] = assistant.tool_calls
    assert (made.index, made.id, made.name, made.arguments) == (0, "c1", "f", '{"a": 1}')
    assert (tool.role, tool.tool_call_id, tool.name, tool.content) == ("tool", "c1", "f", "42")
    calling = body.tool_calling()
    assert calling is not None and json.loads(calling.tools_json) == tools
    assert json.loads(calling.tool_choice_json) == "required"
    assert calling.HasField("parallel_tool_calls") and not calling.parallel_tool_calls
    assert chat().tool_calling() is None


def prompt_tokens(echo: str = "") -> token_pb2.PromptTokens:
    """A prompt of three tokens ("Hel", "lo", " you") with logprobs, the first none."""
    return token_pb2.PromptTokens(
        text=echo,
        token_ids=[7, 8, 9],
        token_texts=["Hel", "lo", " you"],
        logprobs=[
            token_pb2.PositionLogprobs(),
            token_pb2.PositionLogprobs(
                logprob=-2.0,
                rank=3,
                top_logprobs=[token_pb2.TokenLogprob(token_id=4, text="p", logprob=-0.5)],
            ),
            token_pb2.PositionLogprobs(
                logprob=-0.25,
                rank=1,
                top_logprobs=[token_pb2.TokenLogprob(token_id=9, text=" you", logprob=-0.25)],
            ),
        ],
    )


def test_an_echoed_prompt_begins_the_text_and_the_logprobs_whole_and_streamed() -> None:
    first = token_pb2.Token(
        text="!", token_ids=[5], logprob=-1.0, prompt=prompt_tokens("Hello you")
    )
    last = token_pb2.Token(
        text="?",
        token_ids=[6],
        logprob=-3.0,
        finish_reason=token_pb2.FINISH_REASON_LENGTH,
        usage=token_pb2.Usage(prompt_tokens=3, completion_tokens=2),
    )
    answer = WholeAnswer(Shape.of(Shape.new_answer(False, "m", False, False), {}), logprobs=True)
    answer.add(first)
    answer.add(last)
    # A message that only ends its choice adds no token to the logprobs.
    answer.add(token_pb2.Token(token_id=-1, finish_reason=token_pb2.FINISH_REASON_LENGTH))
    # As JSON: the SDK's model types the first token's null logprob as a number, though
    # OpenAI's legacy completions and vLLM's server send null (the SDK reads it leniently).
    choice = answer.body()["choices"][0]
    assert choice["text"] == "Hello you!?"
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == ["Hel", "lo", " you", "!", "?"]
    assert logprobs["token_logprobs"] == [None, -2.0, -0.25, -1.0, -3.0]
    assert logprobs["text_offset"] == [0, 3, 5, 9, 10]
    assert logprobs["top_logprobs"] == [None, {"p": -0.5}, {" you": -0.25}, {}, {}]
    # vLLM's prompt_logprobs: each position's token and alternatives, with their ranks.
    assert answer.body()["choices"][0]["prompt_logprobs"] == [
        None,
        {
            "4": {"logprob": -0.5, "rank": 1, "decoded_token": "p"},
            "8": {"logprob": -2.0, "rank": 3, "decoded_token": "lo"},
        },
        {"9": {"logprob": -0.25, "rank": 1, "decoded_token": " you"}},
    ]
    stream = EventStream(
        Shape.of(Shape.new_answer(False, "m", True, False), {}), logprobs=True, include_usage=False
    )
    chunks = [json.loads(event) for event in events(stream.token(first) + stream.token(last))[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "Hello you!?"
    assert chunks[0]["choices"][0]["logprobs"]["text_offset"] == [0, 3, 5, 9]
    assert chunks[1]["choices"][0]["logprobs"]["text_offset"] == [10]


def test_prompt_logprobs_without_echo_leave_the_text_alone_and_a_chat_has_them_once() -> None:
    token = token_pb2.Token(
        text="x",
        token_ids=[5],
        prompt=prompt_tokens(),
        finish_reason=token_pb2.FINISH_REASON_LENGTH,
        usage=token_pb2.Usage(prompt_tokens=3, completion_tokens=1),
    )
    for is_chat in (False, True):
        answer = WholeAnswer(Shape.of(Shape.new_answer(is_chat, "m", False, False), {}), False)
        answer.add(token)
        body = answer.body()
        listed = body["prompt_logprobs"] if is_chat else body["choices"][0]["prompt_logprobs"]
        assert listed[0] is None and listed[2] == {
            "9": {"logprob": -0.25, "rank": 1, "decoded_token": " you"}
        }
        said = body["choices"][0]["message"]["content"] if is_chat else body["choices"][0]["text"]
        assert said == "x"
        assert ("prompt_logprobs" in body["choices"][0]) is not is_chat


@pytest.mark.parametrize(
    ("prompt", "text", "ids", "batch"),
    [
        ("hi", "hi", None, None),
        (["hi"], "hi", None, None),
        ([3, 4], "", (3, 4), None),
        (["a", "b"], "", None, [("a", ()), ("b", ())]),
        ([[3], [4, 5]], "", None, [("", (3,)), ("", (4, 5))]),
    ],
)
def test_a_prompt_is_a_text_ids_or_a_batch_of_either(
    prompt: object,
    text: str,
    ids: tuple[int, ...] | None,
    batch: list[tuple[str, tuple[int, ...]]] | None,
) -> None:
    request = parse(CompletionRequest, json.dumps({"model": "m", "prompt": prompt}).encode())
    assert request.generate_request(16).prompt == text
    made = request.batch()
    if ids is None and batch is None:
        assert made is None
        return
    assert made is not None
    assert made.token_ids == (ids or ())
    assert [(p.text, tuple(p.token_ids)) for p in made.prompts] == (batch or [])


@pytest.mark.parametrize(
    ("prompt", "field"),
    [
        ([1, "a"], "prompt"),
        ([[1], ["a"]], "prompt"),
        ([True], "prompt"),
        ({"a": 1}, "prompt"),
        ([], "prompt"),
        (["a", ""], "prompt[1]"),
        ([[1], []], "prompt[1]"),
        ([1, -2], "prompt[1]"),
        ([[1], [2, 2**31]], "prompt[1][1]"),
    ],
)
def test_a_prompt_of_no_known_shape_or_an_empty_one_is_refused_naming_it(
    prompt: object, field: str
) -> None:
    with pytest.raises(InvalidArgument) as error:
        parse(CompletionRequest, json.dumps({"model": "m", "prompt": prompt}).encode()).batch()
    assert error.value.field == field


def test_echo_is_a_completions_field_and_chats_refuse_it() -> None:
    request = parse(CompletionRequest, b'{"model": "m", "prompt": "a", "echo": true}')
    assert request.generate_request(16).echo
    with pytest.raises(InvalidArgument) as error:
        chat(echo=True).generate_request(16)
    assert error.value.field == "echo"
