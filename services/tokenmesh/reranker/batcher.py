"""Micro-batching: concurrent callers' items are gathered briefly and processed in one call."""

# Hand-written on purpose: no maintained asyncio micro-batching library fits. The closest, PyPI
# `batched` (0.1.x), polls with a fixed sleep instead of timing the window from the oldest
# queued item and has no shutdown that releases waiting callers; the rest are unmaintained,
# thread-based, or part of a serving framework (Ray Serve, BentoML). This class is small, counts
# batch size in texts rather than requests, drops work whose caller cancelled, runs the model
# call in a thread so the event loop stays free, and is unit-tested on its own.

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from tokenmesh.common.errors import Internal, ServiceError, Unavailable

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


@dataclass(eq=False)
class _Pending(Generic[T, R]):
    """One caller's item, waiting in the queue or in the batch being processed."""

    item: T
    size: int
    enqueued_at: float
    # Cancelled when its caller cancels (asyncio cancels the future a cancelled task awaits).
    future: asyncio.Future[R] = field(repr=False)


class MicroBatcher(Generic[T, R]):
    """Gathers items submitted by concurrent callers into batches and runs process(batch) in a
    worker thread, one batch at a time.

    A batch is sent when max_wait has passed since its oldest item was queued, or as soon as
    the queued items' sizes add up to max_size (an item is never split: one bigger than
    max_size is sent alone). While a batch is being processed, new items queue up and form
    the next batch, so batches grow with load. process must return one result per item, in
    order; a result that is a ServiceError (one item's bad input) is raised to its caller
    alone. If process raises, every caller in that batch gets Internal. A caller that cancels
    while queued is dropped from the queue; one that cancels during processing has its
    result discarded."""

    def __init__(
        self,
        process: Callable[[list[T]], Sequence[R]],
        *,
        max_wait_seconds: float,
        max_size: int,
        size: Callable[[T], int] = lambda _: 1,
        on_batch: Callable[[int], None] | None = None,
    ) -> None:
        self._process = process
        self._max_wait = max_wait_seconds
        self._max_size = max_size
        self._size = size
        # Told the number of items in each batch, just before it is processed.
        self._on_batch = on_batch
        self._queue: deque[_Pending[T, R]] = deque()
        self._in_flight: list[_Pending[T, R]] = []
        self._arrived = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    def start(self) -> None:
        """Start the batching task on the running event loop."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="micro-batcher")

    async def close(self) -> None:
        """Stop batching; callers still waiting get Unavailable. A model call already running
        in its thread finishes there, but nobody waits for it."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def submit(self, item: T) -> R:
        """Queue item and return its result once its batch has been processed."""
        if self._closed or self._task is None or self._task.done():
            raise Unavailable("reranker: not accepting work (shutting down)")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[R] = loop.create_future()
        self._queue.append(_Pending(item, self._size(item), loop.time(), future))
        self._arrived.set()
        return await future

    async def _run(self) -> None:
        try:
            while True:
                batch = await self._next_batch()
                await self._execute(batch)
        finally:
            # Closed (or a bug ended the loop): nobody may be left waiting.
            for pending in (*self._in_flight, *self._queue):
                _fail(pending, Unavailable("reranker: shutting down"))
            self._in_flight = []
            self._queue.clear()

    def _drop_cancelled(self) -> None:
        self._queue = deque(pending for pending in self._queue if not pending.future.done())

    async def _next_batch(self) -> list[_Pending[T, R]]:
        """Wait until a batch is due, then take it from the front of the queue."""
        loop = asyncio.get_running_loop()
        while True:
            self._drop_cancelled()
            if not self._queue:
                self._arrived.clear()
                await self._arrived.wait()
                continue
            deadline = self._queue[0].enqueued_at + self._max_wait
            queued = sum(pending.size for pending in self._queue)
            if queued >= self._max_size or loop.time() >= deadline:
                return self._take()
            self._arrived.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(deadline):
                    await self._arrived.wait()

    def _take(self) -> list[_Pending[T, R]]:
        batch: list[_Pending[T, R]] = []
        total = 0
        while self._queue:
            head = self._queue[0]
            if batch and total + head.size > self._max_size:
                break
            batch.append(self._queue.popleft())
            total += head.size
        return batch

    async def _execute(self, batch: list[_Pending[T, R]]) -> None:
        self._in_flight = batch
        if self._on_batch is not None:
            self._on_batch(len(batch))
        try:
            results = await asyncio.to_thread(self._process, [pending.item for pending in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"returned {len(results)} results for {len(batch)} items")
        except Exception as exc:
            log.exception("model call failed for a batch of %d requests", len(batch))
            for pending in batch:
                error = Internal(
                    f"reranker: the model call failed for a batch of {len(batch)} requests: "
                    f"{type(exc).__name__}: {exc}"
                )
                error.__cause__ = exc
                _fail(pending, error)
        else:
            for pending, result in zip(batch, results, strict=True):
                if isinstance(result, ServiceError):
                    _fail(pending, result)
                elif not pending.future.done():
                    pending.future.set_result(result)
        self._in_flight = []


def _fail(pending: _Pending[T, R], error: ServiceError) -> None:
    if not pending.future.done():
        pending.future.set_exception(error)
