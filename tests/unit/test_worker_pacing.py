"""The worker's stream pacing (decision 0039): how long a stream's later tokens gather while
the server loop is behind, and that the first and the last never wait."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest

from tokenmesh.worker.config import WorkerSettings
from tokenmesh.worker.engine import EngineLoad, VllmEngine
from tokenmesh.worker.engine_thread import EngineThread, Handoff, Inbox, Item
from tokenmesh.worker.outputs import Tokens
from tokenmesh.worker.pacing import StreamPacing

TARGET = 0.002
PERIOD = 0.05


def run_periods(pacing: StreamPacing, lag: float, periods: int, start: float) -> float:
    """Deliveries every 10 ms, each `lag` late, over that many periods; the time after."""
    now = start
    for _ in range(periods * 5):
        now += 0.01
        pacing.observe(lag, now)
    return now


def test_a_loop_that_keeps_up_never_holds() -> None:
    pacing = StreamPacing(TARGET, 0.05, PERIOD)
    run_periods(pacing, 0.0005, 20, 0.0)
    assert pacing.hold == 0
    assert pacing.lag == pytest.approx(0.0005)


def test_a_lagging_loop_doubles_the_hold_up_to_its_cap() -> None:
    pacing = StreamPacing(TARGET, 0.05, PERIOD)
    now = 0.0
    holds = []
    for _ in range(60):  # 600 ms of deliveries 5 ms late
        now += 0.01
        pacing.observe(0.005, now)
        holds.append(round(pacing.hold, 6))
    assert list(dict.fromkeys(holds)) == [0.0, 0.002, 0.004, 0.008, 0.016, 0.032, 0.05]
    assert holds[-10:] == [0.05] * 10


def test_the_hold_stays_between_and_shrinks_to_nothing_once_the_loop_keeps_up() -> None:
    pacing = StreamPacing(TARGET, 0.05, PERIOD)
    now = run_periods(pacing, 0.005, 10, 0.0)
    assert pacing.hold == 0.05
    now = run_periods(pacing, 0.0015, 5, now)  # between half the target and the target
    assert pacing.hold == 0.05
    holds = []
    for _ in range(20):
        now = run_periods(pacing, 0.0002, 1, now)
        holds.append(pacing.hold)
    assert holds[0] == pytest.approx(0.04)
    assert all(later < earlier for earlier, later in itertools.pairwise(holds) if later)
    assert holds[-1] == 0


def test_a_quiet_spell_ends_the_hold() -> None:
    pacing = StreamPacing(TARGET, 0.05, PERIOD)
    now = run_periods(pacing, 0.01, 10, 0.0)
    assert pacing.hold == 0.05
    pacing.observe(0.01, now + 1.0)  # a second without outputs, then one late delivery
    assert pacing.hold == 0


def test_the_gauges_read_nothing_through_a_quiet_spell() -> None:
    """Between bursts the loop has nothing of the engine's to send: the gauges fall to 0 at
    once, not at the next delivery."""
    pacing = StreamPacing(TARGET, 0.05, PERIOD)
    now = run_periods(pacing, 0.01, 10, 0.0)
    assert pacing.hold_at(now) == 0.05
    assert pacing.lag_at(now) == pytest.approx(0.01)
    later = now + 3 * PERIOD
    assert pacing.quiet(later)
    assert (pacing.hold_at(later), pacing.lag_at(later)) == (0, 0)
    pacing.observe(0.0001, later)  # the next burst measures afresh
    assert pacing.lag == 0


def test_a_cap_of_zero_never_holds_but_still_reports_the_lag() -> None:
    pacing = StreamPacing(TARGET, 0.0, PERIOD)
    run_periods(pacing, 0.02, 10, 0.0)
    assert pacing.hold == 0
    assert pacing.lag == pytest.approx(0.02)


@pytest.mark.parametrize(("target", "cap", "period"), [(0, 0.05, 0.05), (0.002, -1, 0.05)])
def test_pacing_refuses_meaningless_settings(target: float, cap: float, period: float) -> None:
    with pytest.raises(ValueError, match="lag_target"):
        StreamPacing(target, cap, period)


def test_the_worker_settings_make_the_pacing() -> None:
    assert WorkerSettings().stream_hold_max_ms == 50
    with pytest.raises(ValueError, match="stream_hold_lag_ms"):
        WorkerSettings(stream_hold_lag_ms=0)


def tokens(index: int, last: bool = False) -> Tokens:
    return Tokens(index, [index], f"t{index} ", last=last)


async def test_tokens_wait_for_the_hold_and_go_together() -> None:
    loop = asyncio.get_running_loop()
    inbox = Inbox(loop)
    not_before = loop.time() + 0.2
    for index in range(3):
        loop.call_later(0.01 * (index + 1), inbox.put, tokens(index))
    items = await asyncio.wait_for(inbox.take(not_before), 5)
    assert loop.time() >= not_before
    assert [item.index for item in items if isinstance(item, Tokens)] == [0, 1, 2]


@pytest.mark.parametrize("end", ["last", "none", "error"])
async def test_the_end_of_a_stream_never_waits_for_the_hold(end: str) -> None:
    loop = asyncio.get_running_loop()
    inbox = Inbox(loop)
    finals: dict[str, Item] = {
        "last": tokens(1, last=True),
        "none": None,
        "error": RuntimeError("engine failed"),
    }
    loop.call_later(0.01, inbox.put, tokens(0))
    loop.call_later(0.02, inbox.put, finals[end])
    started = loop.time()
    items = await asyncio.wait_for(inbox.take(started + 60), 5)
    assert len(items) == 2 and loop.time() - started < 30


async def test_a_hold_already_past_takes_at_once() -> None:
    loop = asyncio.get_running_loop()
    inbox = Inbox(loop)
    inbox.put(tokens(0))
    assert len(await asyncio.wait_for(inbox.take(loop.time() - 1), 5)) == 1


async def test_a_cancelled_hold_leaves_the_inbox_usable() -> None:
    loop = asyncio.get_running_loop()
    inbox = Inbox(loop)
    waiting = asyncio.create_task(inbox.take(loop.time() + 60))
    await asyncio.sleep(0.01)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    inbox.put(tokens(0))  # not held: the hold ended with the cancelled take
    assert len(await asyncio.wait_for(inbox.take(), 5)) == 1


class Recorded(StreamPacing):
    """Pacing that keeps every lag it was told of."""

    def __init__(self) -> None:
        super().__init__(TARGET, 0.05, PERIOD)
        self.lags: list[float] = []

    def observe(self, lag: float, now: float) -> None:
        self.lags.append(lag)


def step_while_busy(handoff: Handoff, inbox: Inbox, busy: float) -> None:
    """An engine step posts from its thread while the caller (the server loop) is blocked."""
    engine = threading.Thread(target=handoff.post, args=(inbox, tokens(0)))
    engine.start()
    engine.join()
    time.sleep(busy)


async def test_the_handoff_measures_how_late_the_server_loop_takes_its_delivery() -> None:
    loop = asyncio.get_running_loop()
    pacing = Recorded()
    handoff = Handoff(loop, pacing)
    inbox = Inbox(loop)
    # The server loop is busy (blocked) for 100 ms once the engine's step has arrived.
    step_while_busy(handoff, inbox, 0.1)
    await asyncio.wait_for(inbox.take(), 5)
    assert len(pacing.lags) == 1 and pacing.lags[0] >= 0.09


class Held(StreamPacing):
    """Pacing with a fixed hold, whatever the loop's lag."""

    def __init__(self, hold: float) -> None:
        super().__init__(TARGET, 1.0, PERIOD)
        self.hold = hold

    def observe(self, lag: float, now: float) -> None:
        pass


@dataclass(frozen=True)
class TokenizeParams:
    max_total_tokens: int | None = 64


def engine_posting(outputs: list[Item], gap: float, hold: float) -> VllmEngine:
    """An engine whose requests post these outputs, `gap` s apart, from the engine's thread."""
    thread = EngineThread()
    thread.start()
    llm = SimpleNamespace(
        renderer=SimpleNamespace(
            default_cmpl_tok_params=TokenizeParams(),
            default_chat_tok_params=TokenizeParams(),
            tokenizer=object(),
        ),
        model_config=SimpleNamespace(max_model_len=64),
        vllm_config=SimpleNamespace(
            structured_outputs_config=None, scheduler_config=SimpleNamespace(max_num_seqs=8)
        ),
    )
    engine = VllmEngine(llm, EngineLoad(), WorkerSettings(), thread)  # type: ignore[arg-type]
    engine.pacing = Held(hold)
    engine._handoff = Handoff(asyncio.get_running_loop(), engine.pacing)

    async def produce(spec: Any, post: Any) -> None:
        for item in outputs:
            post(item)
            await asyncio.sleep(gap)

    engine._produce = produce  # type: ignore[method-assign]
    return engine


async def received(engine: VllmEngine) -> list[tuple[float, Tokens]]:
    loop = asyncio.get_running_loop()
    spec = SimpleNamespace(model="", engine_ids=("r",))
    messages = []
    try:
        async for message in engine.stream(spec):  # type: ignore[arg-type]
            messages.append((loop.time(), message))
    finally:
        engine._thread.stop()
    return messages


async def test_a_held_stream_sends_its_first_token_alone_then_gathers() -> None:
    outputs: list[Item] = [tokens(i) for i in range(12)] + [tokens(12, last=True), None]
    messages = await asyncio.wait_for(received(engine_posting(outputs, 0.01, 0.06)), 10)
    counts = [len(message.token_ids) for _, message in messages]
    assert counts[0] == 1
    assert sum(counts) == 13 and len(messages) < 8
    # Each later message waited the hold after the one before it, but the last.
    times = [at for at, _ in messages]
    assert all(b - a >= 0.06 for a, b in itertools.pairwise(times[:-1]))
    assert "".join(message.text for _, message in messages) == "".join(f"t{i} " for i in range(13))


async def test_a_stream_ends_the_moment_its_last_tokens_come_however_long_the_hold() -> None:
    outputs: list[Item] = [tokens(i) for i in range(4)] + [tokens(4, last=True), None]
    messages = await asyncio.wait_for(received(engine_posting(outputs, 0.005, 60.0)), 10)
    assert [len(message.token_ids) for _, message in messages] == [1, 4]
    assert messages[-1][1].last


async def test_without_a_hold_each_output_goes_alone() -> None:
    outputs: list[Item] = [tokens(i) for i in range(6)] + [tokens(6, last=True), None]
    messages = await asyncio.wait_for(received(engine_posting(outputs, 0.05, 0.0)), 10)
    assert [len(message.token_ids) for _, message in messages] == [1] * 7


async def test_an_output_longer_than_a_message_goes_out_in_pieces() -> None:
    """An engine output of 150 tokens (vLLM merged them while the worker's reader was behind)
    goes out as messages of at most max_message_tokens, in order, the end on the last."""
    long = Tokens(1, list(range(1, 151)), "x" * 150, text_lengths=[1] * 150)
    outputs: list[Item] = [tokens(0), long, tokens(151, last=True), None]
    messages = await asyncio.wait_for(received(engine_posting(outputs, 0.01, 0.0)), 10)
    per_message = WorkerSettings().max_message_tokens
    counts = [len(message.token_ids) for _, message in messages]
    assert max(counts) <= per_message and sum(counts) == 152
    assert [i for _, message in messages for i in message.token_ids] == list(range(152))
    assert [message.last for _, message in messages][-1] and not any(
        message.last for _, message in messages[:-1]
    )
