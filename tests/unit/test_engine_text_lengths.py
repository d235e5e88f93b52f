"""How the worker splits one engine output's text between its tokens, and keeps it when merging."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from vllm.logprobs import FlatLogprobs, Logprob
from vllm.outputs import CompletionOutput

from tests.support import TINY_MODEL
from tokenmesh.common.openai_answers import per_token
from tokenmesh.v1 import token_pb2
from tokenmesh.worker.outputs import Tokens, output_tokens, split_text
from tokenmesh.worker.servicer import token_message

ALTERNATIVE = 9999


def position(token_id: int, decoded: str | None) -> dict[int, Logprob]:
    """vLLM's logprobs of one position: the sampled token and one alternative."""
    return {
        token_id: Logprob(-0.5, rank=1, decoded_token=decoded),
        ALTERNATIVE: Logprob(-2.0, rank=2, decoded_token="?"),
    }


def engine_output(
    token_ids: list[int],
    text: str,
    decoded: list[str | None] | None = None,
    finished: bool = False,
    flat: bool = False,
) -> Any:
    """A DELTA RequestOutput: vLLM's own CompletionOutput, with logprobs when decoded is given."""
    logprobs: Any = None
    if decoded is not None:
        logprobs = FlatLogprobs() if flat else []
        for token_id, piece in zip(token_ids, decoded, strict=True):
            logprobs.append(position(token_id, piece))
    completion = CompletionOutput(
        index=0,
        text=text,
        token_ids=token_ids,
        cumulative_logprob=None,
        logprobs=logprobs,
        finish_reason="stop" if finished else None,
    )
    return SimpleNamespace(outputs=[completion], finished=finished)


def texts(message: token_pb2.Token) -> list[str]:
    """Each token's text as the OpenAI logprobs give it."""
    return [text for text, _, _ in per_token(message)]


@pytest.mark.parametrize("flat", [False, True], ids=["dict-logprobs", "flat-logprobs"])
def test_an_output_of_several_tokens_gives_each_token_its_decoded_text(flat: bool) -> None:
    output = engine_output([1, 2, 3], "Hé llo wörld", ["Hé", " llo", " wörld"], flat=flat)
    tokens = output_tokens(output.outputs[0], 0, prompt_tokens=4, top_logprobs=1)
    assert tokens.lengths() == [3, 4, 7]
    message = token_message(tokens)
    assert list(message.text_lengths) == [3, 4, 7]
    assert texts(message) == ["Hé", " llo", " wörld"]
    assert [lp for _, lp, _ in per_token(message)] == [-0.5, -0.5, -0.5]


def test_a_character_split_across_tokens_counts_with_the_token_that_completes_it() -> None:
    # vLLM decodes a token that holds only the first bytes of a character as "".
    output = engine_output([1, 2, 3], "aé!", ["a", "", "é!"])
    tokens = output_tokens(output.outputs[0], 0, prompt_tokens=4, top_logprobs=1)
    assert tokens.lengths() == [1, 0, 3]
    assert texts(token_message(tokens)) == ["a", "", "é!"]


@pytest.mark.parametrize(
    ("text", "decoded", "lengths"),
    [
        # A stop string cut the text short within the last tokens.
        ("Hello wo", ["Hello", " wor", "ld"], [5, 0, 3]),
        # The stop token itself adds no text.
        ("Hi there", ["Hi", " there", "</s>"], [2, 6, 0]),
        # Bytes of a character that vLLM could not put together.
        ("aé", ["a", "\ufffd", "\ufffd"], [1, 0, 2]),
        # Text held back by an earlier output (for stop strings) comes first.
        ("lo wörld", [" wö", "rld"], [0, 9]),
        # Decoded tokens that spell more than the text.
        ("日", ["日本", "語"], [0, 3]),
        # No decoded text (vLLM without a tokenizer).
        ("ab", [None, None], [0, 2]),
        ("ab", ["a", None, "b"], [1, 0, 1]),
    ],
)
def test_decoded_tokens_that_do_not_spell_the_text_fall_back_to_the_last_token(
    text: str, decoded: list[str | None], lengths: list[int]
) -> None:
    output = engine_output(list(range(1, len(decoded) + 1)), text, decoded)
    tokens = output_tokens(output.outputs[0], 0, prompt_tokens=4, top_logprobs=1)
    assert tokens.lengths() == lengths
    assert sum(tokens.lengths()) == len(text.encode())
    assert "".join(texts(token_message(tokens))) == text  # no character cut in two


def test_without_logprobs_an_outputs_text_counts_with_its_last_token() -> None:
    tokens = output_tokens(
        engine_output([1, 2, 3], "abç").outputs[0], 0, prompt_tokens=4, top_logprobs=0
    )
    assert tokens.text_lengths is None
    assert tokens.lengths() == [0, 0, 4]


def test_merged_outputs_keep_each_outputs_split() -> None:
    outputs = [
        engine_output([1], "Hé", ["Hé"]),
        engine_output([2, 3, 4], "llo wörld", ["llo", " wö", "rld"]),
        engine_output([5, 6], "!!", ["!?", "!"]),  # falls back: "!!" does not start "!?"
        engine_output([], "", finished=True),
    ]
    merged: Tokens | None = None
    index = 0
    for output in outputs:
        tokens = output_tokens(output.outputs[0], index, prompt_tokens=4, top_logprobs=1)
        index += len(tokens.token_ids)
        if merged is None:
            merged = tokens
        else:
            merged.extend(tokens)
    assert merged is not None
    assert merged.text == "Héllo wörld!!"
    assert merged.lengths() == [3, 3, 4, 3, 0, 2]
    message = token_message(merged)
    assert list(message.text_lengths) == [3, 3, 4, 3, 0, 2]
    assert texts(message) == ["Hé", "llo", " wö", "rld", "", "!!"]
    assert message.finish_reason == token_pb2.FINISH_REASON_STOP


def test_split_text_never_cuts_a_character() -> None:
    for text, pieces in [("é", ["\xc3", "\xa9"]), ("日本", ["日", "本語"]), ("", ["", ""])]:
        lengths = split_text(text, pieces)
        assert sum(lengths) == len(text.encode())
        raw, at = text.encode(), 0
        for length in lengths:
            raw[at : at + length].decode()  # strict: raises on a cut character
            at += length


@pytest.mark.skipif(not (TINY_MODEL / "tokenizer.json").exists(), reason="no tiny model")
def test_vllms_own_decoded_tokens_split_byte_level_characters() -> None:
    """The tiny model's byte-level tokenizer splits é, ö and 日 into several tokens; vLLM's
    logprobs processor decodes them as the engine does, in one output of every token."""
    from vllm.tokenizers import get_tokenizer
    from vllm.v1.engine.logprobs import LogprobsProcessor
    from vllm.v1.outputs import LogprobsLists

    tokenizer = get_tokenizer(str(TINY_MODEL))
    text = "Héllo wörld 日本"
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    processor = LogprobsProcessor(
        tokenizer=tokenizer,
        logprobs=[],
        prompt_logprobs=None,
        cumulative_logprob=0.0,
        num_logprobs=1,
        num_prompt_logprobs=None,
    )
    for token_id in token_ids:  # one engine step a token
        processor.update_from_output(
            SimpleNamespace(  # type: ignore[arg-type]
                new_logprobs=LogprobsLists(
                    np.array([[token_id, ALTERNATIVE % len(tokenizer)]]),
                    np.array([[-0.5, -2.0]]),
                    np.array([1]),
                ),
                new_prompt_logprobs_tensors=None,
                prompt_token_id_logprobs=None,
            )
        )
    completion = CompletionOutput(0, text, token_ids, None, processor.logprobs)
    output = SimpleNamespace(outputs=[completion], finished=False)
    tokens = output_tokens(output.outputs[0], 0, prompt_tokens=4, top_logprobs=1)
    assert len(token_ids) > len(text.split())  # several tokens a word
    assert sum(tokens.lengths()) == len(text.encode())
    pieces = texts(token_message(tokens))
    assert "".join(pieces) == text
    assert "\ufffd" not in "".join(pieces)
    assert [piece for piece in pieces if piece and not piece.isascii()] == ["é", "ö", "日", "本"]


def test_a_prompts_logprobs_keep_its_tokens_ranks_and_the_asked_alternatives() -> None:
    from tokenmesh.worker.outputs import prompt_part

    # vLLM's prompt_logprobs: none for the first token; then the token (rank 4) and the best
    # two, or the token that is itself the best.
    positions = [
        None,
        {
            8: Logprob(-3.0, rank=4, decoded_token="lo"),
            1: Logprob(-0.5, rank=1, decoded_token="a"),
            2: Logprob(-0.7, rank=2, decoded_token="b"),
        },
        {9: Logprob(-0.1, rank=1, decoded_token=" you")},
    ]
    made = prompt_part("Hello you", [7, 8, 9], positions, 2, lambda token_id: f"<{token_id}>")
    assert made.text == "Hello you" and made.token_ids == (7, 8, 9)
    assert made.token_texts == ("<7>", "lo", " you")
    assert made.logprobs[0] == (None, None, ())
    logprob, rank, alternatives = made.logprobs[1]
    assert (logprob, rank) == (-3.0, 4)
    assert [(a.token_id, a.text, a.logprob) for a in alternatives] == [
        (1, "a", -0.5),
        (2, "b", -0.7),
    ]
    assert made.logprobs[2][:2] == (-0.1, 1)
    # Echo without logprobs: the text and ids only.
    assert prompt_part("Hi", [7], None, 0, str).token_texts == ()


def test_an_output_longer_than_a_message_goes_in_pieces_each_with_its_tokens_text() -> None:
    """vLLM merges a request's outputs while its reader is behind (hundreds of tokens in one
    output were seen): such an output goes out in pieces of at most max_message_tokens, each
    with its tokens, their logprobs and their own text; the end and usage on the last."""
    decoded = ["Hé", "llo", " wö", "rld", "!", " 日", "本"]
    merged = output_tokens(
        engine_output(list(range(1, 8)), "".join(decoded), decoded, finished=True).outputs[0],
        10,
        prompt_tokens=4,
        top_logprobs=1,
    )
    merged.last, merged.completion_tokens = True, 17
    pieces = merged.split(3)
    assert [piece.index for piece in pieces] == [10, 13, 16]
    assert [piece.token_ids for piece in pieces] == [[1, 2, 3], [4, 5, 6], [7]]
    assert [piece.text for piece in pieces] == ["Héllo wö", "rld! 日", "本"]
    assert [len(piece.logprobs) for piece in pieces] == [3, 3, 1]
    messages = [token_message(piece) for piece in pieces]
    assert [text for message in messages for text in texts(message)] == decoded
    assert [message.finish_reason for message in messages] == [0, 0, token_pb2.FINISH_REASON_STOP]
    assert [piece.last for piece in pieces] == [False, False, True]
    assert pieces[-1].completion_tokens == 17
    assert merged.split(7) == [merged]


def test_an_output_without_per_token_text_puts_its_text_on_its_last_piece() -> None:
    tokens = output_tokens(
        engine_output([1, 2, 3, 4, 5], "abçde").outputs[0], 0, prompt_tokens=4, top_logprobs=0
    )
    pieces = tokens.split(2)
    assert [piece.token_ids for piece in pieces] == [[1, 2], [3, 4], [5]]
    assert [piece.text for piece in pieces] == ["", "", "abçde"]
    assert [piece.lengths() for piece in pieces] == [[0, 0], [0, 0], [6]]
