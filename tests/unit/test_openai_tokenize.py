"""/tokenize's request: a prompt or messages (with tools) as the worker's TokenizeRequest, vLLM's
defaults left to the worker, and what cannot be tokenized refused naming the field."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tokenmesh.common.errors import InvalidArgument
from tokenmesh.common.sampling import ToolLimits
from tokenmesh.gateway.frontends.openai.pooling import parse
from tokenmesh.gateway.frontends.openai.tokenize import DetokenizeRequest, TokenizeRequest

LIMITS = ToolLimits(max_tools=1)
TOOL = {"type": "function", "function": {"name": "f"}}


def tokenize(**fields: Any) -> TokenizeRequest:
    return parse(TokenizeRequest, json.dumps({"model": "m", **fields}).encode())


def test_a_prompt_leaves_vllms_defaults_to_the_worker() -> None:
    call = tokenize(prompt="hi").call(LIMITS)
    assert call.prompt == "hi" and not call.messages
    assert not call.HasField("add_special_tokens") and not call.HasField("add_generation_prompt")
    named = tokenize(prompt="hi", add_special_tokens=False, return_token_strs=True).call(LIMITS)
    assert named.HasField("add_special_tokens") and not named.add_special_tokens
    assert named.return_token_strs


def test_messages_and_tools_go_as_a_chat_does() -> None:
    call = tokenize(
        messages=[{"role": "user", "content": "q"}], tools=[TOOL], add_generation_prompt=False
    ).call(LIMITS)
    [message] = call.messages
    assert (message.role, message.content) == ("user", "q")
    assert json.loads(call.tools.tools_json) == [TOOL]
    assert call.HasField("add_generation_prompt") and not call.add_generation_prompt


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({}, "prompt"),
        ({"prompt": "a", "messages": [{"role": "user", "content": "q"}]}, "prompt"),
        ({"prompt": "a", "tools": [TOOL]}, "tools"),
        ({"prompt": "a", "add_generation_prompt": True}, "add_generation_prompt"),
        ({"messages": [{"role": "user", "content": "q"}], "tools": [TOOL, TOOL]}, "tools"),
        ({"prompt": "a", "chat_template": "{{x}}"}, "chat_template"),
    ],
)
def test_what_cannot_be_tokenized_is_refused_by_name(fields: dict[str, Any], named: str) -> None:
    with pytest.raises(InvalidArgument) as refused:
        tokenize(**fields).call(LIMITS)
    assert refused.value.field == named


def test_detokenize_takes_a_list_of_ids() -> None:
    assert parse(DetokenizeRequest, b'{"model": "m", "tokens": [1, 2]}').tokens == [1, 2]
    with pytest.raises(InvalidArgument) as refused:
        parse(DetokenizeRequest, b'{"model": "m", "tokens": ["a"]}')
    assert refused.value.field == "tokens[0]"
