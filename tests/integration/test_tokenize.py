"""vLLM's /tokenize and /detokenize through the edge and a gateway's own port: a prompt's tokens
are the model tokenizer's, a chat's are exactly those its generation starts from (usage), text
survives the round trip, and bad requests are refused naming the field."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.support import TINY_MODEL
from tokenmesh.localmesh.mesh import LocalMesh

pytestmark = pytest.mark.integration

MODEL = TINY_MODEL.name
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What time is it in Oslo?"},
]


@pytest.fixture(params=("edge", "gateway"))
def base(request: pytest.FixtureRequest, mesh: LocalMesh) -> Iterator[str]:
    if request.param == "edge":
        port = mesh.settings.mesh().edge_port
    else:
        port = mesh.replicas("gateway")[0].openai_port or 0
    yield f"http://127.0.0.1:{port}"


def post(base: str, route: str, **body: Any) -> httpx.Response:
    return httpx.post(f"{base}{route}", json={"model": MODEL, **body}, timeout=30)


def test_a_prompts_tokens_are_the_models_tokenizers(base: str) -> None:
    prompt = "def main(argv):\n    return 0  # café"
    answer = post(base, "/tokenize", prompt=prompt, return_token_strs=True)
    assert answer.status_code == 200, answer.text
    made = answer.json()
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL)
    expected = tokenizer(prompt).input_ids
    assert made["tokens"] == expected and made["count"] == len(expected)
    assert made["max_model_len"] == 2048
    assert made["token_strs"] == tokenizer.convert_ids_to_tokens(expected)
    bare = post(base, "/tokenize", prompt=prompt, add_special_tokens=False).json()
    assert bare["tokens"] == tokenizer(prompt, add_special_tokens=False).input_ids
    assert bare["token_strs"] is None
    text = post(base, "/detokenize", tokens=bare["tokens"])
    assert text.status_code == 200 and text.json() == {"prompt": prompt}


@pytest.mark.parametrize("tools", [None, TOOLS])
def test_a_chats_tokens_are_those_its_generation_starts_from(
    base: str, tools: list[Any] | None
) -> None:
    extra = {"tools": tools} if tools else {}
    made = post(base, "/tokenize", messages=CHAT, **extra).json()
    with openai.OpenAI(base_url=f"{base}/v1", api_key="-", max_retries=0) as client:
        answer = client.chat.completions.create(
            model=MODEL,
            messages=CHAT,  # type: ignore[arg-type]
            max_tokens=1,
            **({"tools": tools, "tool_choice": "none"} if tools else {}),  # type: ignore[arg-type]
        )
    assert answer.usage is not None and made["count"] == answer.usage.prompt_tokens
    # Without the generation prompt, fewer tokens: the assistant's opening is not rendered.
    closed = post(base, "/tokenize", messages=CHAT, add_generation_prompt=False, **extra).json()
    assert closed["tokens"] == made["tokens"][: closed["count"]]
    assert closed["count"] < made["count"]


@pytest.mark.parametrize(
    ("route", "body", "status", "named"),
    [
        ("/tokenize", {"prompt": "a", "messages": CHAT}, 400, "prompt"),
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": ""}, 400, "prompt"),
        ("/tokenize", {"prompt": "a", "continue_final_message": True}, 400, "continue_final"),
        ("/tokenize", {"prompt": "a", "tools": TOOLS}, 400, "tools"),
        ("/tokenize", {"messages": [{"role": "robot", "content": "a"}]}, 400, "messages[0].role"),
        ("/tokenize", {"prompt": "a", "model": "gpt-4"}, 404, "gpt-4"),
        ("/detokenize", {"tokens": [5, 10**6]}, 400, "tokens[1]"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens[0]"),
        ("/detokenize", {"tokens": list(range(3000))}, 400, "tokens"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ],
)
def test_bad_requests_are_refused_naming_the_field(
    base: str, route: str, body: dict[str, Any], status: int, named: str
) -> None:
    answer = post(base, route, **body)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert named in error["message"], error
