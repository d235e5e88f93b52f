"""One choice of a resumed stream on this worker's engine: its delivered tokens appended to the
prompt as ids, the rest of its tokens to generate, and its text as the first worker's engine
would have gone on making it (docs/decisions/0029)."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

from vllm import SamplingParams
from vllm.v1.engine.detokenizer import IncrementalDetokenizer


class ContinuedText:
    """The choice's text from its new tokens: vLLM's own incremental detokenizer over the
    original prompt, fed the delivered tokens first. The engine's own text for the continuing
    request starts after a prompt that ends with them, and so loses a character a delivered
    token began and a new one completes."""

    def __init__(
        self, tokenizer: Any, request_id: str, prompt_ids: Sequence[int], params: SamplingParams
    ) -> None:
        # The three fields of vLLM's EngineCoreRequest the detokenizer reads.
        original = SimpleNamespace(
            request_id=request_id, prompt_token_ids=list(prompt_ids), sampling_params=params
        )
        self._text = IncrementalDetokenizer.from_new_request(tokenizer, original)  # type: ignore[arg-type]

    def delivered(self, token_ids: Sequence[int]) -> None:
        """The tokens the caller had, and their text (already delivered, so dropped)."""
        self._text.update(list(token_ids), False)
        self._text.get_next_output_text(False, True)

    def next(self, token_ids: Sequence[int], finished: bool) -> str:
        """The text these new tokens add."""
        self._text.update(list(token_ids), False)
        return self._text.get_next_output_text(finished, True)


def continue_choice(
    params: SamplingParams,
    prompt_ids: Sequence[int],
    delivered: Sequence[int],
    max_tokens: int,
) -> dict[str, Any]:
    """The engine input of a choice that delivered `delivered` of its max_tokens, and its
    parameters (changed in place): one choice, the rest of max_tokens and min_tokens, no
    prompt logprobs (the caller had them)."""
    params.max_tokens = max_tokens - len(delivered)
    params.min_tokens = max(0, params.min_tokens - len(delivered))
    params.n = 1
    params.prompt_logprobs = None
    return {"prompt_token_ids": [*prompt_ids, *delivered]}
