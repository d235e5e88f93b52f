"""OpenAI's answers (objects, stream chunks, errors) made from a stream's Token messages."""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from tokenmesh.common.errors import HTTP_STATUS, DependencyError, ServiceError, error_body
from tokenmesh.common.tokens import ends_stream, token_count
from tokenmesh.v1 import inference_pb2, token_pb2

log = logging.getLogger(__name__)

# A refusal's message that begins with the field it is about: "messages[1].tool_call_id: ...".
FIELD_FIRST = re.compile(r"([A-Za-z_][\w.\[\]]*): ")

# The back-off a client is told when every worker was full (a batch turns over in about this).
OVERLOADED_RETRY_AFTER_MS = 1000

FINISH_REASONS = {
    token_pb2.FINISH_REASON_STOP: "stop",
    token_pb2.FINISH_REASON_LENGTH: "length",
    # Stopped by the tenant's token quota: OpenAI has no word for it; the answer was cut short.
    token_pb2.FINISH_REASON_QUOTA_EXHAUSTED: "length",
    token_pb2.FINISH_REASON_ABORTED: "abort",
    token_pb2.FINISH_REASON_CANCELLED: "abort",
    token_pb2.FINISH_REASON_TOOL_CALLS: "tool_calls",
}


def usage(token: token_pb2.Token) -> dict[str, int]:
    prompt, completion = token.usage.prompt_tokens, token.usage.completion_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def finish_reason(token: token_pb2.Token) -> str | None:
    return FINISH_REASONS.get(token.finish_reason) if token.finish_reason else None


def per_token(token: token_pb2.Token) -> list[tuple[str, float | None, Sequence[Any]]]:
    """(text, logprob, alternatives) for each token of a message: its text split by
    text_lengths (UTF-8 bytes each token adds) when the worker merged outputs; none for a
    message that holds no token (one that only ends its choice)."""
    count = token_count(token)
    if not count:
        return []
    logprobs: list[tuple[float | None, Sequence[Any]]] = [
        (token.logprob if token.HasField("logprob") else None, token.top_logprobs)
    ]
    logprobs += [
        (p.logprob if p.HasField("logprob") else None, p.top_logprobs)
        for p in token.following_logprobs
    ]
    if token.text_lengths and len(token.text_lengths) == count:
        raw, texts, at = token.text.encode(), [], 0
        for length in token.text_lengths:
            texts.append(raw[at : at + length].decode(errors="replace"))
            at += length
    else:
        texts = [""] * (count - 1) + [token.text]
    return [
        (text, *(logprobs[i] if i < len(logprobs) else (None, ()))) for i, text in enumerate(texts)
    ]


def chat_logprobs(token: token_pb2.Token) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": text,
                "logprob": logprob if logprob is not None else 0.0,
                "bytes": list(text.encode()),
                "top_logprobs": [
                    {"token": alt.text, "logprob": alt.logprob, "bytes": list(alt.text.encode())}
                    for alt in alternatives
                ],
            }
            for text, logprob, alternatives in per_token(token)
        ]
    }


def completion_logprobs(token: token_pb2.Token, offset: int) -> dict[str, Any]:
    """A completion message's logprobs, an echoed prompt's first, text_offset counting on from
    offset."""
    made: dict[str, list[Any]] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    if token.HasField("prompt") and token.prompt.text:
        made = prompt_completion_logprobs(token.prompt, offset)
        # On from the reported tokens' texts, as vLLM's server counts.
        offset += sum(len(text) for text in made["tokens"])
    for text, logprob, alternatives in per_token(token):
        made["tokens"].append(text)
        made["token_logprobs"].append(logprob)
        made["top_logprobs"].append({alt.text: alt.logprob for alt in alternatives})
        made["text_offset"].append(offset)
        offset += len(text)
    return made


def prompt_completion_logprobs(prompt: token_pb2.PromptTokens, offset: int) -> dict[str, list[Any]]:
    """An echoed prompt's tokens in a completion's logprobs, before the generated ones (as
    vLLM's server and OpenAI's legacy completions give them): the first token has none."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for text, position in zip(prompt.token_texts, prompt.logprobs, strict=False):
        tokens.append(text)
        has = position.HasField("logprob")
        token_logprobs.append(position.logprob if has else None)
        top.append({alt.text: alt.logprob for alt in position.top_logprobs} if has else None)
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }


def prompt_logprobs(prompt: token_pb2.PromptTokens) -> list[dict[str, Any] | None] | None:
    """vLLM's prompt_logprobs: None for the first token, then for each token {id: {logprob,
    rank, decoded_token}} of the token itself and its position's alternatives."""
    if not prompt.logprobs:
        return None
    listed: list[dict[str, Any] | None] = []
    for token_id, text, position in zip(
        prompt.token_ids, prompt.token_texts, prompt.logprobs, strict=False
    ):
        if not position.HasField("logprob"):
            listed.append(None)
            continue
        entries = {
            str(alt.token_id): {"logprob": alt.logprob, "rank": rank, "decoded_token": alt.text}
            for rank, alt in enumerate(position.top_logprobs, 1)
        }
        entries[str(token_id)] = {
            "logprob": position.logprob,
            "rank": position.rank,
            "decoded_token": text,
        }
        listed.append(entries)
    return listed


def echoed(token: token_pb2.Token) -> str:
    """The message's text, after the prompt when the message carries it echoed."""
    return token.prompt.text + token.text if token.HasField("prompt") else token.text


@dataclass
class Shape:
    """One response's identity and the JSON of its parts. Each streamed chunk is a fixed head,
    the generated text as a JSON string, and a fixed tail: a token costs one json.dumps of
    its text, not of a whole chunk (the chunk's other fields never change within a stream)."""

    chat: bool
    model: str
    id: str
    created: int
    # A degraded answer's marker (and the reranker's warnings), in every object and chunk.
    extra: dict[str, Any]

    @classmethod
    def of(cls, answer: inference_pb2.OpenAIAnswer, extra: dict[str, Any]) -> Shape:
        return cls(answer.chat, answer.model, answer.id, answer.created, extra)

    @staticmethod
    def new_answer(
        chat: bool, model: str, stream: bool, include_usage: bool
    ) -> inference_pb2.OpenAIAnswer:
        """A new answer's identity and options, as a prepared request carries them."""
        prefix = "chatcmpl-" if chat else "cmpl-"
        return inference_pb2.OpenAIAnswer(
            chat=chat,
            id=prefix + uuid.uuid4().hex,
            created=int(time.time()),
            model=model,
            stream=stream,
            include_usage=include_usage,
        )

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def resumed(self, times: int) -> None:
        """The answer moved to another worker mid-stream: every part from here on says how
        many times, in its "tokenmesh" field."""
        self.extra = {"tokenmesh": {**self.extra.get("tokenmesh", {}), "resumed": times}}

    def base(self, object_name: str | None = None) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": object_name or self.object,
            "created": self.created,
            "model": self.model,
            **self.extra,
        }

    def chunk(self, choice: dict[str, Any]) -> bytes:
        name = "chat.completion.chunk" if self.chat else "text_completion"
        return sse({**self.base(name), "choices": [choice]})

    def text_chunk_parts(self, index: int = 0) -> tuple[bytes, bytes]:
        """The bytes before and after the JSON string of a chunk's text (no logprobs, not
        a choice's last), for the choice of that index."""
        marker = "\x00"
        if self.chat:
            choice = {"index": index, "delta": {"content": marker}, "logprobs": None}
        else:
            choice = {"index": index, "text": marker, "logprobs": None}
        choice["finish_reason"] = None
        head, tail = self.chunk(choice).split(json.dumps(marker).encode())
        return head, tail

    def usage_chunk(self, token: token_pb2.Token) -> bytes:
        name = "chat.completion.chunk" if self.chat else "text_completion"
        return sse({**self.base(name), "choices": [], "usage": usage(token)})


def sse(data: Any) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


def reasoning_fields(reasoning: str) -> dict[str, str]:
    """Reasoning as OpenAI-compatible servers name it: "reasoning_content" (DeepSeek's name,
    which most clients read) and "reasoning" (vLLM's since 0.10), both."""
    return {"reasoning_content": reasoning, "reasoning": reasoning} if reasoning else {}


def tool_call_delta(piece: token_pb2.ToolCall) -> dict[str, Any]:
    """A tool-call piece as OpenAI streams it: id, type and name on a call's first piece."""
    delta: dict[str, Any] = {"index": piece.index}
    function: dict[str, str] = {"arguments": piece.arguments}
    if piece.id or piece.name:
        delta["id"], delta["type"] = piece.id, "function"
        function = {"name": piece.name, "arguments": piece.arguments}
    delta["function"] = function
    return delta


def chat_delta(token: token_pb2.Token) -> dict[str, Any]:
    """A message's delta of a chat: its content, reasoning and tool-call pieces."""
    delta: dict[str, Any] = {"content": token.text}
    if token.reasoning or token.tool_calls:
        if not token.text:
            delta["content"] = None
        delta.update(reasoning_fields(token.reasoning))
        if token.tool_calls:
            delta["tool_calls"] = [tool_call_delta(piece) for piece in token.tool_calls]
    return delta


def choice(
    shape: Shape,
    piece: Any,
    reason: str | None,
    logprobs: dict[str, Any] | None,
    index: int = 0,
) -> Any:
    key = "delta" if shape.chat else "text"
    return {"index": index, key: piece, "logprobs": logprobs, "finish_reason": reason}


class EventStream:
    """A streamed answer's Server-Sent Events, one Token message at a time (a request's choices
    interleaved, each chunk naming its choice's index). A message that neither ends its choice
    nor carries logprobs costs one json.dumps of its text (Shape's fixed head and tail around
    it)."""

    def __init__(self, shape: Shape, logprobs: bool, include_usage: bool, choices: int = 1) -> None:
        self._shape = shape
        self._logprobs = logprobs
        self._include_usage = include_usage
        self._choices = choices
        # Each choice's fixed chunk parts, and with logprobs its text so far (completions'
        # text_offset).
        self._parts: dict[int, tuple[bytes, bytes]] = {0: shape.text_chunk_parts()}
        self._offsets: dict[int, int] = {}
        # Whether the last message given to token() ended the stream (ends_stream).
        self.ended = False

    def start(self) -> bytes:
        """What goes before the first token: a chat's assistant role, for every choice."""
        if not self._shape.chat:
            return b""
        return b"".join(
            self._shape.chunk(
                choice(self._shape, {"role": "assistant", "content": ""}, None, None, index)
            )
            for index in range(self._choices)
        )

    def token(self, token: token_pb2.Token) -> bytes:
        """The message's chunk; after the stream's last one, the usage chunk (when asked) and
        [DONE]. Runs for every message: a plain one reads each field it needs once."""
        shape = self._shape
        if token.resumed:
            shape.resumed(token.resumed)
            self._parts = {}  # they hold the extra field
        index = token.choice
        reason = finish_reason(token)
        text = echoed(token)
        if reason is None and not self._logprobs and not token.reasoning and not token.tool_calls:
            parts = self._parts.get(index)
            if parts is None:
                parts = self._parts[index] = shape.text_chunk_parts(index)
            data = parts[0] + json.dumps(text).encode() + parts[1]
        else:
            logprobs = None
            if self._logprobs:
                # Each message of a choice with logprobs comes here: its text so far counted.
                offset = self._offsets.get(index, 0)
                self._offsets[index] = offset + len(text)
                logprobs = (
                    chat_logprobs(token) if shape.chat else completion_logprobs(token, offset)
                )
            piece = chat_delta(token) if shape.chat else text
            data = shape.chunk(choice(shape, piece, reason, logprobs, index))
        self.ended = ends_stream(token)
        if not self.ended:
            return data
        if self._include_usage:
            data += shape.usage_chunk(token)
        return data + DONE

    @staticmethod
    def failed(body: dict[str, Any]) -> bytes:
        """An error after the answer began: in the stream, as OpenAI's servers send it."""
        return sse(body) + DONE

    @staticmethod
    def done() -> bytes:
        return DONE


@dataclass
class _Choice:
    """One choice of a whole answer, as its messages arrive."""

    parts: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    # Tool calls by index: id, name and the arguments' pieces.
    calls: dict[int, tuple[str, str, list[str]]] = field(default_factory=dict)
    content: list[Any] = field(default_factory=list)
    merged: dict[str, list[Any]] = field(default_factory=dict)
    offset: int = 0
    reason: str | None = None
    # vLLM's prompt_logprobs, when the request asked for them.
    prompt_logprobs: list[dict[str, Any] | None] | None = None


@dataclass
class WholeAnswer:
    """A whole (not streamed) answer, gathered from a stream's Token messages: its choices in
    index order, and the usage of all of them."""

    shape: Shape
    logprobs: bool
    choices: dict[int, _Choice] = field(default_factory=dict)
    last: token_pb2.Token | None = None

    def add(self, token: token_pb2.Token) -> None:
        if token.resumed:
            self.shape.resumed(token.resumed)
        made = self.choices.get(token.choice)
        if made is None:
            made = self.choices[token.choice] = _Choice()
        if self.logprobs:
            if self.shape.chat:
                made.content.extend(chat_logprobs(token)["content"])
            else:
                for key, values in completion_logprobs(token, made.offset).items():
                    made.merged.setdefault(key, []).extend(values)
        text = echoed(token)
        made.parts.append(text)
        made.offset += len(text)
        if token.HasField("prompt"):
            made.prompt_logprobs = prompt_logprobs(token.prompt)
        if token.reasoning:
            made.reasoning.append(token.reasoning)
        for piece in token.tool_calls:
            call = made.calls.get(piece.index)
            if call is None:
                call = made.calls[piece.index] = (piece.id, piece.name, [])
            call[2].append(piece.arguments)
        if token.finish_reason:
            made.reason = finish_reason(token)
        if ends_stream(token):
            self.last = token

    def body(self) -> dict[str, Any]:
        choices = [self._choice(index, made) for index, made in sorted(self.choices.items())]
        made = {
            **self.shape.base(),
            "choices": choices or [self._choice(0, _Choice())],
            "usage": usage(self.last) if self.last is not None else None,
        }
        first = self.choices.get(0)
        if self.shape.chat and first is not None and first.prompt_logprobs is not None:
            # A chat's prompt is every choice's: vLLM's server gives its logprobs once.
            made["prompt_logprobs"] = first.prompt_logprobs
        return made

    def _choice(self, index: int, made: _Choice) -> dict[str, Any]:
        text = "".join(made.parts)
        if self.shape.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            message.update(reasoning_fields("".join(made.reasoning)))
            if made.calls:
                message["content"] = text or None
                message["tool_calls"] = [
                    {
                        "id": id_,
                        "type": "function",
                        "function": {"name": name, "arguments": "".join(arguments)},
                    }
                    for _, (id_, name, arguments) in sorted(made.calls.items())
                ]
            return {
                "index": index,
                "message": message,
                "logprobs": {"content": made.content} if self.logprobs else None,
                "finish_reason": made.reason,
            }
        answer = {
            "index": index,
            "text": text,
            "logprobs": made.merged if self.logprobs else None,
            "finish_reason": made.reason,
        }
        if made.prompt_logprobs is not None:
            answer["prompt_logprobs"] = made.prompt_logprobs
        return answer


def error_response(exc: Exception) -> tuple[int, dict[str, Any], list[tuple[bytes, bytes]]]:
    """An exception as OpenAI's error object, its HTTP status and headers (retry-after). The
    one place OpenAI answers turn errors into statuses, from the same codes as gRPC's."""
    if isinstance(exc, ServiceError):
        status = HTTP_STATUS.get(exc.code, 500)
        param = getattr(exc, "field", None)
        if param is None and exc.code == grpc.StatusCode.INVALID_ARGUMENT:
            # A refusal passed on from another service ("field: reason", a worker's on either
            # token path): its field is the param.
            named = FIELD_FIRST.match(exc.message)
            param = named.group(1) if named else None
        headers = []
        retry_after_ms = getattr(exc, "retry_after_ms", None)
        if isinstance(exc, DependencyError) and exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            # The workers are full, not the caller over a limit of its own: 503, as OpenAI
            # answers an overloaded engine (429 stays the tenant's limits).
            status, retry_after_ms = 503, OVERLOADED_RETRY_AFTER_MS
        if retry_after_ms is not None:
            headers.append((b"retry-after", str(max(1, -(-retry_after_ms // 1000))).encode()))
            headers.append((b"retry-after-ms", str(retry_after_ms).encode()))
        return status, error_body(exc.message, status, param), headers
    log.exception("internal error in an OpenAI answer")
    return 500, error_body("internal error", 500), []
