"""The affinity key: prompts that start alike get one key, and so one worker; an adapter's
requests, whatever their prompts, one key of their own."""

from __future__ import annotations

import hashlib

from tokenmesh.gateway.core.prompts import Conversation, PromptBatch

# Between a message's role and its content, and after its content: characters no role holds, so
# no two conversations serialise alike.
_ROLE_END = "\x1f"
_MESSAGE_END = "\x1e"
# Before a prompt of token ids: no text prompt's key is the same.
_IDS = "\x1d"
# BLAKE2b's personalisation of an adapter's key: no prompt hashes as an adapter does.
_ADAPTER = b"tokenmesh-lora"


def affinity_text(prompt: str | Conversation | PromptBatch, prefix_chars: int) -> str:
    """The start of what the engine will see first: a plain prompt's first prefix_chars; for a
    conversation, its messages up to and including the first user message (system prompts,
    documents as context, the opening question), so every later turn of one conversation keeps
    the key of its first and follows it to the worker that holds its cache; for a batch, its
    first prompt's (ids as their decimal list: prompts of one start share the key)."""
    if isinstance(prompt, str):
        return prompt[:prefix_chars]
    if isinstance(prompt, PromptBatch):
        first = prompt.items[0]
        if first.token_ids:
            return _IDS + " ".join(map(str, first.token_ids[:prefix_chars]))[:prefix_chars]
        return first.text[:prefix_chars]
    return _opening(prompt)[:prefix_chars]


def _opening(conversation: Conversation) -> str:
    parts: list[str] = []
    for message in conversation.messages:
        parts.append(f"{message.role}{_ROLE_END}{message.content}{_MESSAGE_END}")
        if message.role == "user":
            break
    return "".join(parts)


def affinity_key(
    prompt: str | Conversation | PromptBatch, prefix_chars: int, adapter: str = ""
) -> str:
    """A short digest (a header value; Envoy hashes it again onto its ring) of affinity_text,
    or, for an adapter's request, of the adapter's name alone: all of an adapter's requests go
    to the worker that holds it, and only the load bound (prefix routing's balance factor, or
    the picker's slack) spills a hot adapter to a second worker, which loads it too. Its
    prefixes are cached there as well (vLLM keeps an adapter's prefix cache apart from the
    model's), so adapter affinity is prefix affinity for its requests; keying by adapter and
    prompt would spread one adapter's prompts over every worker, each loading it (docs/
    decisions/0033). BLAKE2b from the standard library: a few microseconds a request."""
    if adapter:
        return hashlib.blake2b(adapter.encode(), digest_size=8, person=_ADAPTER).hexdigest()
    return hashlib.blake2b(affinity_text(prompt, prefix_chars).encode(), digest_size=8).hexdigest()
