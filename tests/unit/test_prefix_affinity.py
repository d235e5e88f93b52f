"""The prefix-affinity key: alike starts share it, different ones don't, a conversation keeps it."""

from __future__ import annotations

from tokenmesh.gateway.core.documents import ContextPrompt
from tokenmesh.gateway.core.prefix_key import affinity_key, affinity_text
from tokenmesh.gateway.core.prompts import Conversation, message

SYSTEM = "You are a careful assistant for the operators of a GPU cluster. " * 4


def chat(*turns: tuple[str, str]) -> Conversation:
    return Conversation(tuple(message(role, content) for role, content in turns))


def test_prompts_that_start_alike_share_the_key() -> None:
    long_start = "Background: " + "the cluster runs vLLM behind Envoy. " * 40
    first = affinity_key(long_start + "What is the first question?", 256)
    second = affinity_key(long_start + "And a different second one?", 256)
    assert first == second
    assert len(first) == 16


def test_prompts_that_start_differently_do_not() -> None:
    keys = {affinity_key(f"Prompt number {number}: tell me a story.", 256) for number in range(50)}
    assert len(keys) == 50


def test_a_short_prompt_is_its_own_key() -> None:
    assert affinity_key("hi", 256) == affinity_key("hi", 256)
    assert affinity_key("hi", 256) != affinity_key("hi there", 256)


def test_every_turn_of_a_conversation_keeps_the_first_turns_key() -> None:
    opening = (("system", SYSTEM), ("user", "How do I drain a worker?"))
    first = chat(*opening)
    second = chat(*opening, ("assistant", "Send SIGTERM."), ("user", "And then?"))
    third = chat(
        *opening,
        ("assistant", "Send SIGTERM."),
        ("user", "And then?"),
        ("assistant", "Wait for the grace period."),
        ("user", "Thanks."),
    )
    keys = {affinity_key(turns, 4096) for turns in (first, second, third)}
    assert len(keys) == 1


def test_conversations_with_one_system_prompt_but_other_questions_differ() -> None:
    first = chat(("system", SYSTEM), ("user", "How do I drain a worker?"))
    other = chat(("system", SYSTEM), ("user", "Why is TTFT high?"))
    assert affinity_key(first, 4096) != affinity_key(other, 4096)
    # Cut within the shared system prompt, they share the key (and so the worker).
    assert affinity_key(first, 64) == affinity_key(other, 64)


def test_roles_are_part_of_the_key() -> None:
    as_system = chat(("system", "Be brief."), ("user", "Hello"))
    as_user = chat(("user", "Be brief."), ("user", "Hello"))
    assert affinity_key(as_system, 4096) != affinity_key(as_user, 4096)


def test_documents_as_context_lead_the_key() -> None:
    documents = ("Envoy balances streams per request. " * 20, "Workers run vLLM. " * 20)
    asked = ContextPrompt("What balances streams?", documents, (0, 1))
    other = ContextPrompt("What runs vLLM?", documents, (0, 1))
    assert affinity_text(asked.prompt, 256).startswith("user\x1fContext:\n[1] Envoy")
    assert affinity_key(asked.prompt, 256) == affinity_key(other.prompt, 256)


def test_a_batch_has_its_first_prompts_key_and_ids_never_a_texts() -> None:
    from tokenmesh.gateway.core.prompts import PromptBatch
    from tokenmesh.v1 import inference_pb2

    batch = PromptBatch(
        (inference_pb2.PromptInput(text="same start"), inference_pb2.PromptInput(text="x"))
    )
    assert affinity_key(batch, 64) == affinity_key("same start", 64)
    ids = PromptBatch(token_ids=(1, 2, 3))
    assert affinity_key(ids, 64) == affinity_key(
        PromptBatch((inference_pb2.PromptInput(token_ids=[1, 2, 3]),)), 64
    )
    assert affinity_key(ids, 64) != affinity_key("1 2 3", 64)
    assert affinity_text(PromptBatch(token_ids=tuple(range(100))), 16) == affinity_text(
        PromptBatch(token_ids=tuple(range(50))), 16
    )
