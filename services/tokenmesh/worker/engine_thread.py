"""The engine's own thread and the hand-off of its outputs to the gRPC server's loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections import deque
from collections.abc import Coroutine
from typing import Any, TypeVar

import uvloop

from tokenmesh.worker.outputs import Tokens

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


class Inbox:
    """One stream's engine outputs, on the server's loop: the stream takes everything that
    arrived since it last looked, at once."""

    __slots__ = ("_items", "_loop", "_waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._items: deque[Item] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def put(self, item: Item) -> None:
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def take(self) -> list[Item]:
        while not self._items:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items = list(self._items)
        self._items.clear()
        return items


class Handoff:
    """Hands items from the engine's loop to inboxes on the server's loop: one wake-up of the
    server's loop carries everything posted since the last (an engine step's outputs for every
    stream), instead of one cross-thread call per output."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._posted: list[tuple[Inbox, Item]] = []

    def post(self, inbox: Inbox, item: Item) -> None:
        """On the engine's loop."""
        with self._lock:
            self._posted.append((inbox, item))
            if len(self._posted) > 1:
                return  # a delivery is already on its way
        self._loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self._lock:
            posted, self._posted = self._posted, []
        for inbox, item in posted:
            inbox.put(item)
