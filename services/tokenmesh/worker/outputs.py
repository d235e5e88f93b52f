"""vLLM's outputs as the worker's Tokens: one choice's consecutive generated tokens, their text
split between them, their log probabilities and how the choice ended."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenmesh.v1 import token_pb2

FINISH_REASONS = {
    "stop": token_pb2.FINISH_REASON_STOP,
    "length": token_pb2.FINISH_REASON_LENGTH,
    "abort": token_pb2.FINISH_REASON_ABORTED,
}


@dataclass(frozen=True)
class Candidate:
    """A token the model considered at one position, with its log probability."""

    token_id: int
    text: str
    logprob: float


@dataclass(frozen=True)
class ToolCallPiece:
    """A piece of one tool call as a stream adds it (token.proto's ToolCall): its first piece
    has the id and the function's name, later ones of the same index continue the arguments."""

    index: int
    id: str = ""
    name: str = ""
    arguments: str = ""


@dataclass(frozen=True)
class PromptPart:
    """The prompt a choice continues, sent with the choice's first tokens (token.proto's
    PromptTokens): its text when echoed, its ids, and with prompt logprobs each token's text
    and (logprob, rank, alternatives), the first token's none."""

    text: str
    token_ids: tuple[int, ...]
    token_texts: tuple[str, ...] = ()
    logprobs: tuple[tuple[float | None, int | None, tuple[Candidate, ...]], ...] = ()


def prompt_part(
    text: str, token_ids: Sequence[int], prompt_logprobs: Any, top: int, decode: Any
) -> PromptPart:
    """A PromptPart from vLLM's prompt_logprobs (None first, then {token_id: Logprob} of each
    position, holding the prompt's token and the `top` alternatives) or None when not asked
    for; decode(token_id) spells a token whose text vLLM gives none of (the first)."""
    if prompt_logprobs is None:
        return PromptPart(text, tuple(token_ids))
    texts: list[str] = []
    logprobs: list[tuple[float | None, int | None, tuple[Candidate, ...]]] = []
    for token_id, position in zip(token_ids, prompt_logprobs, strict=False):
        entry = position.get(token_id) if position else None
        if entry is None:
            texts.append(decode(token_id))
            logprobs.append((None, None, ()))
            continue
        logprob, candidates = token_logprobs(position, token_id, top)
        texts.append(entry.decoded_token if entry.decoded_token is not None else decode(token_id))
        logprobs.append((logprob, entry.rank, candidates))
    return PromptPart(text, tuple(token_ids), tuple(texts), tuple(logprobs))


@dataclass(slots=True)
class Tokens:
    """Consecutive generated tokens of one choice of a request: one engine output, or several
    merged."""

    index: int
    token_ids: list[int]
    text: str
    # Set on the last tokens of a choice only.
    finish_reason: int = token_pb2.FINISH_REASON_UNSPECIFIED
    prompt_tokens: int = 0
    # When the request asked for logprobs: each token's, and its most likely alternatives.
    logprobs: list[tuple[float | None, tuple[Candidate, ...]]] = field(default_factory=list)
    # UTF-8 bytes of text each token adds (None: all the text counts with the last token, as
    # for an engine output of several tokens without logprobs to split its text by).
    text_lengths: list[int] | None = None
    # Which of the request's choices (0..n-1) the tokens continue.
    choice: int = 0
    # The stream's last tokens (every choice has ended): the completion tokens of all choices.
    last: bool = False
    completion_tokens: int = 0
    # A conversation's reasoning and tool-call pieces, apart from text (worker/parsing.py).
    reasoning: str = ""
    tool_calls: list[ToolCallPiece] = field(default_factory=list)
    # On a choice's first tokens, when the request asked for its prompt (echo, prompt_logprobs).
    prompt: PromptPart | None = None

    def lengths(self) -> list[int]:
        if self.text_lengths is not None:
            return self.text_lengths
        if not self.token_ids:
            return []
        return [0] * (len(self.token_ids) - 1) + [len(self.text.encode())]

    def extend(self, later: Tokens) -> None:
        """Append the choice's next output."""
        lengths = self.lengths()
        if later.token_ids:
            lengths = lengths + later.lengths()
        elif lengths:
            # An end with no token of its own: its text, if any, counts with the last token.
            lengths = [*lengths[:-1], lengths[-1] + len(later.text.encode())]
        self.text_lengths = lengths
        self.token_ids.extend(later.token_ids)
        self.text += later.text
        self.reasoning += later.reasoning
        self.tool_calls = join_pieces(self.tool_calls, later.tool_calls)
        self.logprobs.extend(later.logprobs)
        if later.finish_reason:
            self.finish_reason = later.finish_reason
        if later.last:
            self.last, self.completion_tokens = True, later.completion_tokens

    def split(self, most: int) -> list[Tokens]:
        """These tokens (more than `most`) as consecutive pieces of at most `most` tokens each:
        each piece has its tokens, their logprobs and the text they add by their text lengths
        (without lengths the whole text counts with the last token, so it goes with the last
        piece); the prompt goes with the first piece, the finish, the stream's end, reasoning
        and tool-call pieces with the last. Text lengths always end at whole characters: they
        come from the tokens' decoded strings (split_text), or put all the text on the last."""
        lengths = self.lengths()
        text = self.text.encode()
        pieces: list[Tokens] = []
        offset = 0
        for start in range(0, len(self.token_ids), most):
            end = start + most
            size = sum(lengths[start:end])
            piece = Tokens(
                self.index + start,
                self.token_ids[start:end],
                text[offset : offset + size].decode(),
                prompt_tokens=self.prompt_tokens,
                logprobs=self.logprobs[start:end],
                text_lengths=lengths[start:end],
                choice=self.choice,
            )
            offset += size
            pieces.append(piece)
        pieces[0].prompt = self.prompt
        last = pieces[-1]
        last.finish_reason = self.finish_reason
        last.last, last.completion_tokens = self.last, self.completion_tokens
        last.reasoning, last.tool_calls = self.reasoning, self.tool_calls
        return pieces


def join_pieces(earlier: list[ToolCallPiece], later: list[ToolCallPiece]) -> list[ToolCallPiece]:
    """Tool-call pieces of two consecutive outputs as one message's: a later piece of the call
    the earlier ones ended with continues it (its arguments appended), others follow."""
    if not later:
        return earlier
    joined = list(earlier)
    for piece in later:
        last = joined[-1] if joined else None
        if last is not None and last.index == piece.index and not piece.id and not piece.name:
            arguments = last.arguments + piece.arguments
            joined[-1] = ToolCallPiece(last.index, last.id, last.name, arguments)
        else:
            joined.append(piece)
    return joined


def token_logprobs(
    position_logprobs: Any, token_id: int, top: int
) -> tuple[float | None, tuple[Candidate, ...]]:
    """This token's logprob and the `top` best candidates from vLLM's {token_id: Logprob} of
    one position (which holds the sampled token, ranked, plus the top alternatives)."""
    if not position_logprobs:
        return None, ()
    sampled = position_logprobs.get(token_id)
    ranked = sorted(
        (entry.rank or 0, candidate, entry) for candidate, entry in position_logprobs.items()
    )
    candidates = tuple(
        Candidate(candidate, entry.decoded_token or "", entry.logprob)
        for rank, candidate, entry in ranked
        if 0 < rank <= top
    )
    return (sampled.logprob if sampled is not None else None), candidates


def output_tokens(
    completion: Any, first_index: int, prompt_tokens: int, top_logprobs: int
) -> Tokens:
    """The tokens of one choice's output (vLLM's CompletionOutput of a DELTA request output),
    numbered from first_index; its finish reason once the choice has ended (a choice that ends
    with nothing new, e.g. aborted by the engine, is a message that holds no token)."""
    token_ids = list(completion.token_ids)
    finish = 0
    if completion.finish_reason is not None:
        finish = FINISH_REASONS.get(completion.finish_reason, token_pb2.FINISH_REASON_ABORTED)
    logprobs: list[tuple[float | None, tuple[Candidate, ...]]] = []
    pieces: list[str | None] = []
    if completion.logprobs:
        for position, token_id in enumerate(token_ids):
            position_logprobs = completion.logprobs[position]
            logprobs.append(token_logprobs(position_logprobs, token_id, top_logprobs))
            sampled = position_logprobs.get(token_id) if position_logprobs else None
            pieces.append(sampled.decoded_token if sampled is not None else None)
    # Several tokens in one output: their decoded texts (logprobs only) split the text.
    lengths = split_text(completion.text, pieces) if len(pieces) > 1 else None
    return Tokens(
        first_index,
        token_ids,
        completion.text,
        finish,
        prompt_tokens,
        logprobs,
        lengths,
        choice=completion.index,
    )


def split_text(text: str, pieces: Sequence[str | None]) -> list[int]:
    """The UTF-8 bytes of `text` each token adds, from the tokens' decoded texts (None where
    unknown): each its own while they spell the start of the text, the rest on the last token.
    The text is authoritative: stop strings, text held back for them, or a character split
    across tokens can make it differ from the pieces."""
    lengths = []
    offset = 0
    for piece in pieces[:-1]:
        if piece is None or not text.startswith(piece, offset):
            break
        lengths.append(len(piece.encode()))
        offset += len(piece)
    lengths.extend([0] * (len(pieces) - 1 - len(lengths)))
    lengths.append(len(text[offset:].encode()))
    return lengths
