"""How the gateway turns questions, context documents, long texts and chats into prompts."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from tokenmesh.v1 import inference_pb2


@dataclass(frozen=True)
class Conversation:
    """Messages for the worker to render with the model's chat template, and the plain text it
    uses instead when the model has none ("": no fallback, such a model refuses them)."""

    messages: tuple[inference_pb2.ConversationMessage, ...]
    fallback: str = ""
    # The functions the model may call (an OpenAI chat's tools and tool_choice).
    tools: inference_pb2.ToolCalling | None = None


@dataclass(frozen=True)
class PromptBatch:
    """Several prompts generated together (OpenAI completions' list prompt): texts or the
    vocabulary ids the model sees; or one prompt of ids (token_ids, prompts empty)."""

    prompts: tuple[inference_pb2.PromptInput, ...] = ()
    token_ids: tuple[int, ...] = ()

    @property
    def items(self) -> tuple[inference_pb2.PromptInput, ...]:
        """Every prompt (one of ids alone as an item)."""
        return self.prompts or (inference_pb2.PromptInput(token_ids=self.token_ids),)


def message(role: str, content: str) -> inference_pb2.ConversationMessage:
    return inference_pb2.ConversationMessage(role=role, content=content)


def context_question(prompt: str, documents: Sequence[str]) -> str:
    """The question with the chosen documents as numbered context, best first: one user
    message for a chat template."""
    if not documents:
        return prompt
    context = "\n".join(f"[{number}] {text}" for number, text in enumerate(documents, 1))
    return f"Context:\n{context}\n\nQuestion: {prompt}"


def with_context(prompt: str, documents: Sequence[str]) -> str:
    """The question with its context as plain text for the model to continue."""
    if not documents:
        return prompt
    return f"{context_question(prompt, documents)}\nAnswer:"


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

    def conversation(self, user_message: str) -> Conversation:
        """The past turns and the new user message, for the model's chat template; the
        documented plain fallback ("User: ...\nAssistant: ..." lines) for a model without one."""
        messages: list[inference_pb2.ConversationMessage] = []
        lines = []
        for turn in self._turns:
            messages += [message("user", turn.user), message("assistant", turn.assistant)]
            lines.append(f"User: {turn.user}\nAssistant: {turn.assistant}")
        messages.append(message("user", user_message))
        lines.append(f"User: {user_message}\nAssistant:")
        return Conversation(tuple(messages), "\n".join(lines))

    def add(self, turn: ChatTurn) -> int:
        """Append a finished turn; returns how many old turns were dropped to stay in bounds.
        A turn without an answer (cancelled before its first token) is not kept: a template
        wants an answer, so the conversation could not send it, and it counts no tokens."""
        if not turn.assistant:
            return 0
        self._turns.append(turn)
        dropped = 0
        while len(self._turns) > 1 and (
            len(self._turns) > self._max_turns or self.tokens > self._max_tokens
        ):
            self._turns.popleft()
            dropped += 1
        return dropped
