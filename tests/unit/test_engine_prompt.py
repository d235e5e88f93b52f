"""What the worker hands vLLM for a request: templated messages, the plain fallback, the budget."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
from vllm.renderers.chat_utils import ChatTemplateResolutionError

from tokenmesh.common.errors import InvalidArgument
from tokenmesh.v1 import inference_pb2
from tokenmesh.worker.config import WorkerSettings
from tokenmesh.worker.engine import EngineLoad, VllmEngine
from tokenmesh.worker.requests import EngineRequest, Message
from tokenmesh.worker.sampling import engine_options

CONTEXT = 64


@dataclass(frozen=True)
class TokenizeParams:
    max_total_tokens: int | None = CONTEXT


class Renderer:
    """vLLM's renderer as the engine calls it: one token per word of the prompt, or of each
    message with a role marker; no template at all when template is False."""

    def __init__(self, template: bool) -> None:
        self.template = template
        self.default_cmpl_tok_params = TokenizeParams()
        self.default_chat_tok_params = TokenizeParams()
        self.tokenizer = object()

    async def render_chat_async(self, conversations: Any, params: Any, tokenize: Any) -> Any:
        if not self.template:
            raise ChatTemplateResolutionError("no chat template")
        (conversation,) = conversations
        words = [w for m in conversation for w in (f"<{m['role']}>", *m["content"].split())]
        return None, ({"prompt_token_ids": list(range(len(words) + 1))},)

    async def render_cmpl_async(self, prompts: Any, params: Any) -> Any:
        ((prompt,),) = [[p["prompt"] for p in prompts]]
        return ({"prompt_token_ids": list(range(len(prompt.split())))},)


def engine(template: bool) -> VllmEngine:
    """An engine around the renderer alone (it must be made on a running loop)."""
    # The context and batch vLLM settled on are read from its configuration.
    llm = SimpleNamespace(
        renderer=Renderer(template),
        model_config=SimpleNamespace(max_model_len=CONTEXT),
        vllm_config=SimpleNamespace(
            structured_outputs_config=None, scheduler_config=SimpleNamespace(max_num_seqs=8)
        ),
    )
    settings = WorkerSettings()
    return VllmEngine(llm, EngineLoad(), settings, thread=None)  # type: ignore[arg-type]


def spec(prompt: str = "", *messages: tuple[str, str], **fields: Any) -> EngineRequest:
    values: dict[str, Any] = dict(
        request_id="r",
        prompt=prompt,
        max_tokens=8,
        options=engine_options(inference_pb2.SamplingParams(max_tokens=8), "p"),
        messages=tuple(Message(role, content) for role, content in messages),
    )
    return EngineRequest(**(values | fields))


def tokenize(template: bool, request: EngineRequest) -> tuple[int, int]:
    """Prompt tokens and the tokens the request may generate."""

    async def run() -> tuple[int, int]:
        engine_input, max_tokens = await engine(template)._tokenize(request)
        return len(engine_input["prompt_token_ids"]), max_tokens

    return asyncio.run(run())


def test_messages_are_templated_even_with_a_fallback_prompt() -> None:
    # 2 role markers + 3 words + the generation prompt's token.
    assert tokenize(True, spec("plain words here", ("system", "s"), ("user", "hi there"))) == (
        6,
        8,
    )


def test_a_model_without_a_template_uses_the_fallback_prompt() -> None:
    assert tokenize(False, spec("User: hi\nAssistant:", ("user", "hi"))) == (3, 8)


def test_a_model_without_a_template_and_no_fallback_refuses_the_messages() -> None:
    with pytest.raises(ChatTemplateResolutionError):
        tokenize(False, spec("", ("user", "hi")))


def test_max_tokens_past_the_context_is_refused_naming_both_limits() -> None:
    with pytest.raises(InvalidArgument) as error:
        tokenize(True, spec(" ".join(["w"] * 60), max_tokens=8))
    assert error.value.field == "max_tokens"
    assert "8 plus the prompt's 60 tokens exceeds the model context of 64" in error.value.message
    assert "(at most 4 here)" in error.value.message


def test_max_tokens_within_context_is_cut_to_what_the_context_leaves() -> None:
    long = " ".join(["w"] * 60)
    assert tokenize(True, spec(long, max_tokens=8, max_tokens_within_context=True)) == (60, 4)
    assert tokenize(True, spec("w w", max_tokens=8, max_tokens_within_context=True)) == (2, 8)


def test_a_prompt_that_fills_the_context_is_refused_even_within_context() -> None:
    with pytest.raises(InvalidArgument) as error:
        tokenize(True, spec(" ".join(["w"] * 64), max_tokens_within_context=True))
    assert error.value.field == "prompt"
    assert error.value.message == "prompt: is 64 tokens; the model context is 64 tokens"


def test_a_model_found_without_a_template_is_not_asked_again_for_requests_with_a_fallback() -> None:
    async def run() -> list[int]:
        worker = engine(False)
        renderer = worker._llm.renderer
        calls = []
        render = renderer.render_chat_async

        async def counted(*args: Any) -> Any:
            calls.append(1)
            return await render(*args)

        renderer.render_chat_async = counted
        for _ in range(3):
            await worker._tokenize(spec("User: hi\nAssistant:", ("user", "hi")))
        with pytest.raises(ChatTemplateResolutionError):
            await worker._tokenize(spec("", ("user", "hi")))
        return calls

    # The first request learns it; one without a fallback still gets vLLM's own error.
    assert len(asyncio.run(run())) == 2
