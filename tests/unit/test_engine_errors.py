"""vLLM's errors for a request as the worker's domain errors (no engine started)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from vllm.exceptions import VLLMValidationError

from tokenmesh.common.errors import InvalidArgument, Unavailable
from tokenmesh.worker.engine import _mapped


def template_less_tokenizer():  # type: ignore[no-untyped-def]
    """A Hugging Face tokenizer with no chat template, built in memory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    inner = Tokenizer(models.WordLevel({"[UNK]": 0, "hi": 1}, unk_token="[UNK]"))
    inner.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=inner, unk_token="[UNK]")


def test_a_model_without_a_chat_template_gets_invalid_argument_naming_messages() -> None:
    from vllm.renderers.hf import safe_apply_chat_template

    # What vLLM's renderer needs of the model config to look for a template.
    model_config = SimpleNamespace(
        tokenizer="tiny",
        model="tiny",
        tokenizer_revision=None,
        code_revision=None,
        trust_remote_code=False,
        hf_config=SimpleNamespace(model_type="llama"),
    )
    with pytest.raises(Exception) as raised:
        safe_apply_chat_template(
            model_config,  # type: ignore[arg-type]
            template_less_tokenizer(),
            [{"role": "user", "content": "hi"}],
            tokenize=False,
            add_generation_prompt=True,
        )
    error = _mapped(raised.value)
    assert field(error) == "messages"
    assert str(error) == (
        "messages: the model has no chat template to render them with; send a prompt"
    )


def field(error: Exception) -> str:
    assert isinstance(error, InvalidArgument), error
    return error.field


def test_a_validation_error_naming_no_parameter_names_the_requests_subject() -> None:
    rejected = VLLMValidationError("the template rejected the conversation")
    assert field(_mapped(rejected, "messages")) == "messages"
    assert field(_mapped(rejected)) == "request"
    named = VLLMValidationError("too large", parameter="max_tokens")
    assert field(_mapped(named, "messages")) == "max_tokens"


def test_other_errors_keep_their_mapping() -> None:
    from vllm.v1.engine.exceptions import EngineDeadError

    assert isinstance(_mapped(EngineDeadError()), Unavailable)
    error = ValueError("unexpected")
    assert _mapped(error, "messages") is error
