"""The micro-batcher gathers concurrent callers into few model calls, within its time and size
bounds, drops cancelled callers, fails a whole batch on a model error and never leaves a caller
hanging; ranking orders by score with ties in request order.

A fake model stands in for the real one: the batching logic does not depend on what the model
computes, only on which items reach it together."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from tokenmesh.common.errors import Internal, Unavailable
from tokenmesh.reranker.batcher import MicroBatcher
from tokenmesh.reranker.model import rank

# Generous bounds for "does not hang"; the behaviour itself is asserted on call contents.
HANG = 10.0


class FakeModel:
    """Upper-cases each item; records every call's items; can fail or block until released."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        # Set when a call has started (it may then be blocked on the gate).
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.gate.set()
        self.fail_on: str | None = None
        self.wrong_count = False

    def __call__(self, items: list[str]) -> list[str]:
        self.calls.append(list(items))
        self.entered.set()
        self.gate.wait(HANG)
        if self.fail_on is not None and self.fail_on in items:
            raise RuntimeError("model exploded")
        results = [item.upper() for item in items]
        return results[1:] if self.wrong_count else results


Make = Callable[..., MicroBatcher[str, str]]


@pytest.fixture
def model() -> FakeModel:
    return FakeModel()


@pytest.fixture
async def make(model: FakeModel) -> AsyncIterator[Make]:
    batchers: list[MicroBatcher[str, str]] = []

    def build(**options: Any) -> MicroBatcher[str, str]:
        settings = {"max_wait_seconds": 0.05, "max_size": 100, **options}
        batcher: MicroBatcher[str, str] = MicroBatcher(model, **settings)
        batcher.start()
        batchers.append(batcher)
        return batcher

    yield build
    model.gate.set()
    for batcher in batchers:
        await batcher.close()


async def wait_for_a_call(model: FakeModel) -> None:
    assert await asyncio.to_thread(model.entered.wait, HANG), "the model was never called"


async def test_concurrent_callers_share_one_model_call_and_get_their_own_results(
    make: Make, model: FakeModel
) -> None:
    sizes: list[int] = []
    batcher = make(on_batch=sizes.append)
    items = [f"item-{n}" for n in range(8)]
    async with asyncio.timeout(HANG):
        results = await asyncio.gather(*(batcher.submit(item) for item in items))
    assert model.calls == [items]
    assert results == [item.upper() for item in items]
    assert sizes == [8]


async def test_callers_further_apart_than_max_wait_get_separate_calls(
    make: Make, model: FakeModel
) -> None:
    batcher = make(max_wait_seconds=0.05)
    first = asyncio.create_task(batcher.submit("a"))
    # b arrives once a's window has closed by itself (no other caller, far from max_size),
    # however late a slow machine runs the batcher.
    await wait_for_a_call(model)
    second = asyncio.create_task(batcher.submit("b"))
    async with asyncio.timeout(HANG):
        assert await asyncio.gather(first, second) == ["A", "B"]
    assert model.calls == [["a"], ["b"]]


async def test_the_window_is_timed_from_the_oldest_waiting_caller(
    make: Make, model: FakeModel
) -> None:
    """Later arrivals join the batch but do not push its deadline back, so a steady trickle
    of callers cannot hold the first one indefinitely."""
    batcher = make(max_wait_seconds=1.0, max_size=1_000_000)  # only the window closes it
    tasks: list[asyncio.Task[str]] = []
    # A caller every 20 ms, far inside the 1 s window, until the model is called: were the
    # window timed from the newest caller, it would never close and this would time out.
    async with asyncio.timeout(HANG):
        while not model.entered.is_set():
            tasks.append(asyncio.create_task(batcher.submit(f"item-{len(tasks)}")))
            await asyncio.sleep(0.02)
        results = await asyncio.gather(*tasks)
    items = [f"item-{n}" for n in range(len(tasks))]
    assert results == [item.upper() for item in items]
    first = model.calls[0]
    assert len(first) > 1 and first == items[: len(first)], model.calls  # later arrivals joined
    assert [item for call in model.calls for item in call] == items


async def test_a_batch_waits_out_max_wait_unless_it_fills_up(make: Make, model: FakeModel) -> None:
    batcher = make(max_wait_seconds=60, max_size=3)
    waiting = [asyncio.create_task(batcher.submit(item)) for item in ("a", "b")]
    await asyncio.sleep(0.2)
    assert model.calls == []
    assert not any(task.done() for task in waiting)
    waiting.append(asyncio.create_task(batcher.submit("c")))
    async with asyncio.timeout(HANG):
        assert await asyncio.gather(*waiting) == ["A", "B", "C"]
    assert model.calls == [["a", "b", "c"]]


async def test_batches_stay_within_max_size_and_never_split_an_item(
    make: Make, model: FakeModel
) -> None:
    batcher = make(max_wait_seconds=60, max_size=6, size=len)
    items = ["aa", "bbb", "c", "dddd", "e" * 10]
    async with asyncio.timeout(HANG):
        results = await asyncio.gather(*(batcher.submit(item) for item in items))
    assert results == [item.upper() for item in items]
    # First in, first out; a batch closes before the item that would overflow it; an item
    # bigger than max_size goes alone.
    assert model.calls == [["aa", "bbb", "c"], ["dddd"], ["e" * 10]]


async def test_a_caller_cancelled_while_queued_is_dropped(make: Make, model: FakeModel) -> None:
    batcher = make(max_wait_seconds=60, max_size=3)
    cancelled = asyncio.create_task(batcher.submit("gone"))
    kept = asyncio.create_task(batcher.submit("b"))
    await asyncio.sleep(0.05)
    cancelled.cancel()
    later = [asyncio.create_task(batcher.submit(item)) for item in ("c", "d")]
    async with asyncio.timeout(HANG):
        assert await asyncio.gather(kept, *later) == ["B", "C", "D"]
    assert cancelled.cancelled()
    assert model.calls == [["b", "c", "d"]]


async def test_a_caller_cancelled_during_the_model_call_leaves_the_others_served(
    make: Make, model: FakeModel
) -> None:
    batcher = make()
    model.gate.clear()
    leaving = asyncio.create_task(batcher.submit("a"))
    staying = asyncio.create_task(batcher.submit("b"))
    await wait_for_a_call(model)
    leaving.cancel()
    model.gate.set()
    async with asyncio.timeout(HANG):
        assert await staying == "B"
        with pytest.raises(asyncio.CancelledError):
            await leaving
        # The batcher goes on serving.
        assert await batcher.submit("c") == "C"
    assert model.calls == [["a", "b"], ["c"]]


async def test_a_failed_model_call_fails_every_caller_in_that_batch(
    make: Make, model: FakeModel
) -> None:
    batcher = make()
    model.fail_on = "boom"
    async with asyncio.timeout(HANG):
        outcomes = await asyncio.gather(
            batcher.submit("x"), batcher.submit("boom"), return_exceptions=True
        )
        assert all(isinstance(outcome, Internal) for outcome in outcomes), outcomes
        assert "batch of 2 requests: RuntimeError: model exploded" in str(outcomes[0])
        # The next batch is unaffected.
        assert await batcher.submit("y") == "Y"
    assert model.calls == [["x", "boom"], ["y"]]


async def test_a_model_returning_the_wrong_number_of_results_fails_the_batch(
    make: Make, model: FakeModel
) -> None:
    batcher = make()
    model.wrong_count = True
    async with asyncio.timeout(HANG):
        with pytest.raises(Internal, match="returned 1 results for 2 items"):
            await asyncio.gather(batcher.submit("x"), batcher.submit("y"))


async def test_close_releases_queued_and_in_flight_callers(make: Make, model: FakeModel) -> None:
    batcher = make(max_wait_seconds=0.01, max_size=1)
    model.gate.clear()
    in_flight = asyncio.create_task(batcher.submit("a"))
    await wait_for_a_call(model)
    queued = asyncio.create_task(batcher.submit("b"))
    await asyncio.sleep(0.05)
    async with asyncio.timeout(HANG):
        await batcher.close()
        for task in (in_flight, queued):
            with pytest.raises(Unavailable):
                await task
        with pytest.raises(Unavailable):
            await batcher.submit("c")
    assert model.calls == [["a"]]


async def test_submit_before_start_is_refused(model: FakeModel) -> None:
    batcher: MicroBatcher[str, str] = MicroBatcher(model, max_wait_seconds=0.01, max_size=4)
    with pytest.raises(Unavailable):
        await batcher.submit("a")


def test_rank_puts_the_highest_score_first_and_ties_in_request_order() -> None:
    scores = [0.1, 0.9, 0.5, 0.9, 0.1]
    assert rank(scores, 5) == [(1, 0.9), (3, 0.9), (2, 0.5), (0, 0.1), (4, 0.1)]
    assert rank(scores, 2) == [(1, 0.9), (3, 0.9)]
    assert rank(list(reversed(scores)), 5) == [(1, 0.9), (3, 0.9), (2, 0.5), (0, 0.1), (4, 0.1)]


def test_rank_puts_nan_scores_last() -> None:
    nan = float("nan")
    ranked = rank([nan, 0.2, -0.3, nan], 4)
    assert [index for index, _ in ranked] == [1, 2, 0, 3]
