"""The worker's admission bound: past it, new streams are refused at once, named."""

from __future__ import annotations

import contextlib

import grpc
import pytest

from tokenmesh.common.errors import ResourceExhausted
from tokenmesh.worker.admission import Admission


def test_streams_past_batch_plus_queue_are_refused_naming_the_limits() -> None:
    admission = Admission(max_waiting=1)
    with contextlib.ExitStack() as held:
        for _ in range(3):
            held.enter_context(admission.admit(engine_waiting=0, max_running=2))
        with pytest.raises(ResourceExhausted) as refused:
            held.enter_context(admission.admit(engine_waiting=0, max_running=2))
        assert refused.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_num_seqs=2 + max_waiting_requests=1" in refused.value.message
    # Streams that ended free their places.
    assert admission.admitted == 0
    with admission.admit(engine_waiting=0, max_running=2):
        assert admission.admitted == 1


def test_a_long_engine_queue_refuses_even_below_the_stream_count() -> None:
    """vLLM keeps requests waiting when its KV cache is full, below max_num_seqs."""
    admission = Admission(max_waiting=2)
    with pytest.raises(ResourceExhausted), admission.admit(engine_waiting=3, max_running=8):
        pass
    with admission.admit(engine_waiting=2, max_running=8):
        pass


def test_a_failed_stream_frees_its_place() -> None:
    admission = Admission(max_waiting=0)
    with pytest.raises(RuntimeError), admission.admit(engine_waiting=0, max_running=1):
        raise RuntimeError("stream broke")
    assert admission.admitted == 0
