"""How the gateway turns questions, context documents, long texts and chats into prompts."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass


def with_context(prompt: str, documents: Sequence[str]) -> str:
    """The prompt with the chosen documents as numbered context, best first."""
    if not documents:
        return prompt
    context = "\n".join(f"[{number}] {text}" for number, text in enumerate(documents, 1))
    return f"Context:\n{context}\n\nQuestion: {prompt}\nAnswer:"


def summary_request(instruction: str, text: str) -> str:
    return f"{instruction}\n\n{text}\n\nSummary:"


@dataclass
class ChatTurn:
    user: str
    assistant: str
    # Prompt tokens this turn added (measured by the worker) plus its completion tokens.
    tokens: int


class ChatHistory:
    """A conversation's past turns, bounded in turns and tokens; oldest dropped first."""

    def __init__(self, max_turns: int, max_tokens: int) -> None:
        self._max_turns = max_turns
        self._max_tokens = max_tokens
        self._turns: deque[ChatTurn] = deque()

    @property
    def tokens(self) -> int:
        return sum(turn.tokens for turn in self._turns)

    def __len__(self) -> int:
        return len(self._turns)

    def prompt(self, user_message: str) -> str:
        lines = [f"User: {turn.user}\nAssistant: {turn.assistant}" for turn in self._turns]
        lines.append(f"User: {user_message}\nAssistant:")
        return "\n".join(lines)

    def add(self, turn: ChatTurn) -> int:
        """Append a finished turn; returns how many old turns were dropped to stay in bounds."""
        self._turns.append(turn)
        dropped = 0
        while len(self._turns) > 1 and (
            len(self._turns) > self._max_turns or self.tokens > self._max_tokens
        ):
            self._turns.popleft()
            dropped += 1
        return dropped
