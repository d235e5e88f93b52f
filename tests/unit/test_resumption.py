"""What a relayed stream delivered, and the request that continues it on another worker."""

from __future__ import annotations

import grpc
import pytest
from grpc import aio

from tokenmesh.common.resumption import (
    CAUSE_RESET,
    CAUSE_UNAVAILABLE,
    Delivered,
    choice_count,
    resumable,
)
from tokenmesh.v1 import inference_pb2, token_pb2


def message(choice: int, index: int, ids: list[int], finish: int = 0) -> token_pb2.Token:
    return token_pb2.Token(
        choice=choice,
        index=index,
        token_id=ids[0] if ids else -1,
        token_ids=ids,
        finish_reason=finish,  # type: ignore[arg-type]
    )


def test_each_choice_keeps_its_own_tokens_and_end() -> None:
    original = inference_pb2.InferenceRequest(
        prompt="p", sampling=inference_pb2.SamplingParams(max_tokens=9, n=3), warnings=["w"]
    )
    delivered = Delivered(choice_count(original))
    for token in (
        message(0, 0, [11]),
        message(1, 0, [21, 22]),
        message(0, 1, [12, 13]),
        message(1, 2, [23], token_pb2.FINISH_REASON_STOP),
        message(2, 0, [], token_pb2.FINISH_REASON_UNSPECIFIED),
    ):
        delivered.add(token)
    assert delivered.tokens == 6 and not delivered.complete
    again = delivered.resumed(original, 2)
    assert again.prompt == "p" and list(again.warnings) == ["w"]
    assert again.sampling.max_tokens == 9  # the worker subtracts what was delivered
    assert again.resume.attempt == 2
    assert [(c.choice, list(c.token_ids), c.finished) for c in again.resume.choices] == [
        (0, [11, 12, 13], False),
        (1, [21, 22, 23], True),
        (2, [], False),
    ]
    # The original is left as it was; a second move replaces the first's record.
    assert not original.HasField("resume")
    delivered.add(message(0, 3, [14]))
    assert next(list(c.token_ids) for c in delivered.resumed(again, 3).resume.choices) == [
        11,
        12,
        13,
        14,
    ]


def test_a_batch_has_n_choices_for_each_prompt() -> None:
    batch = inference_pb2.InferenceRequest(
        prompts=[inference_pb2.PromptInput(text="a"), inference_pb2.PromptInput(text="b")],
        sampling=inference_pb2.SamplingParams(max_tokens=3, n=2),
    )
    assert choice_count(batch) == 4
    assert choice_count(inference_pb2.InferenceRequest(prompt="x")) == 1


class Failed(aio.AioRpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(code, aio.Metadata(), aio.Metadata(), details)


@pytest.mark.parametrize(
    ("code", "details", "cause"),
    [
        (grpc.StatusCode.INTERNAL, "Received RST_STREAM with error code 2", CAUSE_RESET),
        (grpc.StatusCode.UNKNOWN, "Stream removed", CAUSE_RESET),
        (grpc.StatusCode.UNAVAILABLE, "inference engine is down", CAUSE_UNAVAILABLE),
        (grpc.StatusCode.UNAVAILABLE, "upstream connect error", CAUSE_UNAVAILABLE),
        (grpc.StatusCode.INTERNAL, "inference engine failed the request", None),
        (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", None),
        (grpc.StatusCode.CANCELLED, "cancelled", None),
        (grpc.StatusCode.INVALID_ARGUMENT, "max_tokens: too many", None),
    ],
)
def test_only_a_worker_gone_away_resumes(
    code: grpc.StatusCode, details: str, cause: str | None
) -> None:
    assert resumable(Failed(code, details)) == cause


def test_the_stream_is_complete_once_its_last_message_is_delivered() -> None:
    delivered = Delivered(1)
    delivered.add(message(0, 0, [1, 2]))
    assert not delivered.complete
    last = message(0, 2, [3], token_pb2.FINISH_REASON_LENGTH)
    last.usage.completion_tokens = 3
    delivered.add(last)
    assert delivered.complete and delivered.tokens == 3
