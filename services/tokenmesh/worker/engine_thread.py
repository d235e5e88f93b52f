"""The engine's own thread and the hand-off of its outputs to the gRPC server's loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections import deque
from collections.abc import Coroutine
from typing import Any, TypeVar

import uvloop

from tokenmesh.worker.outputs import Tokens
from tokenmesh.worker.pacing import StreamPacing

T = TypeVar("T")


class EngineThread:
    """A thread with an event loop of its own, where AsyncLLM and its output tasks run.

    vLLM's output handler holds its loop for as long as engine steps are queued (it takes each
    without yielding), which with logprob-heavy streams is seconds: on a loop of its own it
    never delays the gRPC server's (health checks, token writes, cancels). The engine's
    processes are started from this thread, which lives until the engine is shut down, so
    their parent-death signal (lifetime.py) fires exactly when the worker process dies.
    """

    def __init__(self) -> None:
        self._loop = uvloop.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="vllm-engine", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def submit(self, work: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(work, self._loop)

    async def call(self, work: Coroutine[Any, Any, T]) -> T:
        """Run `work` on the engine's loop and wait for it from the caller's loop."""
        return await asyncio.wrap_future(self.submit(work))

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def abandon(self) -> None:
        """Stop the loop once what runs on it returns, without waiting: work in the thread (a
        model load) cannot be interrupted, and a daemon thread ends with the process."""
        self._loop.call_soon_threadsafe(self._loop.stop)


Item = Tokens | Exception | None


def ends_stream(item: Item) -> bool:
    """The stream's end: its last tokens, the error that ended it, or None (the engine's end)."""
    return not isinstance(item, Tokens) or item.last


class Inbox:
    """One stream's engine outputs, on the server's loop: the stream takes everything that
    arrived since it last looked, at once."""

    __slots__ = ("_holding", "_items", "_loop", "_waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._items: deque[Item] = deque()
        self._waiter: asyncio.Future[None] | None = None
        # While a take holds tokens back (not_before): only the stream's end wakes it.
        self._holding = False

    def put(self, item: Item) -> None:
        self._items.append(item)
        if self._holding and not ends_stream(item):
            return
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _wait(self) -> None:
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _ended(self) -> bool:
        return any(ends_stream(item) for item in self._items)

    async def take(self, not_before: float = 0.0) -> list[Item]:
        """Everything that arrived since the last take, once there is something. Tokens that
        arrive before not_before (the loop's time) wait for it, to go out together; the
        stream's end (its last tokens, an error, None) goes at once, with what came before."""
        delay = not_before - self._loop.time()
        if delay > 0 and not self._ended():
            self._holding = True
            timer = self._loop.call_later(delay, self._wake)
            try:
                await self._wait()
            finally:
                self._holding = False
                timer.cancel()
        while not self._items:
            await self._wait()
        items = list(self._items)
        self._items.clear()
        return items


class Handoff:
    """Hands items from the engine's loop to inboxes on the server's loop: one wake-up of the
    server's loop carries everything posted since the last (an engine step's outputs for every
    stream), instead of one cross-thread call per output. How late each wake-up runs (the
    server loop's lag) sets the streams' pacing."""

    def __init__(self, loop: asyncio.AbstractEventLoop, pacing: StreamPacing | None = None) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._posted: list[tuple[Inbox, Item]] = []
        self._pacing = pacing
        self._since = 0.0  # when the first item of the coming delivery was posted

    def post(self, inbox: Inbox, item: Item) -> None:
        """On the engine's loop."""
        with self._lock:
            self._posted.append((inbox, item))
            if len(self._posted) > 1:
                return  # a delivery is already on its way
            self._since = time.perf_counter()
        self._loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        now = time.perf_counter()
        with self._lock:
            posted, self._posted = self._posted, []
            since = self._since
        if self._pacing is not None:
            self._pacing.observe(now - since, now)
        for inbox, item in posted:
            inbox.put(item)
