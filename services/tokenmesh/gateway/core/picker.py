"""The endpoint picker: a worker for each request, by prefix affinity bounded by live load."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from grpc import aio
from prometheus_client import CollectorRegistry, Counter

from tokenmesh.common.backoff import Backoff
from tokenmesh.common.channels import SwappableChannel
from tokenmesh.gateway.config import PickerSettings
from tokenmesh.v1 import ops_pb2, ops_pb2_grpc

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerLoad:
    """One worker as the control plane last saw it: its address as Envoy knows the host
    (IP:port), whether it is serving, its engine's queue (running + waiting requests), and the
    prompt tokens its engine has computed since it started (looked up in its prefix cache and
    not found there: the prefill work it did)."""

    address: str
    serving: bool
    queued: int
    computed: int = 0
    # Its pool ("": the default): a request is placed among its pool's workers.
    pool: str = ""
    # The LoRA adapters its engine holds: an adapter's request prefers a worker holding it.
    held: frozenset[str] = frozenset()


# Why the picker named its first worker: the key's own (first in its ranking), a later one
# in the ranking (those before it were too busy), or none (no figures: Envoy chose).
CHOICES = ("first", "spilled", "none")


class PickerMetrics:
    """tokenmesh_gateway_worker_picks_total{choice}, choice one of CHOICES."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.picks = Counter(
            "tokenmesh_gateway_worker_picks_total",
            "Workers the endpoint picker named first, by why it chose that one.",
            ["choice"],
            registry=registry,
        )
        for choice in CHOICES:
            self.picks.labels(choice=choice)


def ranking(key: str, addresses: Iterable[str]) -> list[str]:
    """The workers in the key's own order (rendezvous hashing: each worker's score is a hash
    of the key and its address, highest first). Every gateway ranks a key alike, and a worker
    that leaves or joins moves only the keys it ranks first."""
    return sorted(
        addresses,
        key=lambda address: hashlib.blake2b(f"{key}|{address}".encode(), digest_size=8).digest(),
        reverse=True,
    )


class EndpointPicker:
    """Chooses workers for an affinity key: the first serving worker in the key's ranking whose
    load is within the policy's slack of the least-loaded serving worker's. Load is the
    engine's own queue (running + waiting) at the control plane's last report plus the streams
    this picker sent the worker since. So repeats of a prefix reach one worker (its prefix
    cache holds their KV blocks), whichever gateway picks, until that worker is busier than
    the least-loaded by more than the slack; then they spill to the key's next worker, whose
    cache warms to them in turn, never to a worker busier than the slack allows.

    A worker that has computed more than work_bound_percent of the mean worker's prompt tokens
    over the last work_window_seconds (from the same reports: every gateway sees alike) has
    no slack: it takes a key only while it is as little loaded as the least-loaded worker.
    The queues alone cannot see this imbalance at a few streams in flight (a hot prefix and
    the keys that happen to rank its worker first all stay there); an idle worker keeps its
    keys whatever it did before, so a lone conversation never moves.

    Written here rather than taken from a router (SGLang's cache-aware policy, llm-d's
    scorers): those run as proxies or Envoy filters of their own, with one router's view of
    what it sent; this only names the hosts, from the workers' own queues, and Envoy's
    override-host policy routes to them (worker_routing picker)."""

    def __init__(
        self,
        policy: PickerSettings,
        metrics: PickerMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._policy = policy
        self._metrics = metrics
        self._clock = clock
        self._workers: dict[str, WorkerLoad] = {}
        # Streams sent to each worker since its last report (not yet in its queue figure).
        self._sent: dict[str, int] = {}
        # Each worker's (time, computed) reports spanning the work window, oldest first.
        self._computed: dict[str, deque[tuple[float, int]]] = {}
        # The serving workers by pool and those of them over the work bound, as of the last
        # report.
        self._serving: dict[str, list[str]] = {}
        self._overworked: set[str] = set()
        self._updated_at: float | None = None

    def update(self, workers: Iterable[WorkerLoad]) -> None:
        """A new report of every worker (those missing from it are gone)."""
        now = self._clock()
        self._workers = {worker.address: worker for worker in workers}
        self._sent = dict.fromkeys(self._workers, 0)
        self._computed = {
            address: self._computed.get(address, deque()) for address in self._workers
        }
        for address, worker in self._workers.items():
            reports = self._computed[address]
            if reports and worker.computed < reports[-1][1]:
                reports.clear()  # the engine restarted: its count began again
            reports.append((now, worker.computed))
            # Keep the newest report at or before the window's start: the window is spanned.
            while len(reports) > 1 and reports[1][0] <= now - self._policy.work_window_seconds:
                reports.popleft()
        self._serving = {}
        for address, worker in self._workers.items():
            if worker.serving:
                self._serving.setdefault(worker.pool, []).append(address)
        self._overworked = set().union(*map(self.overworked, self._serving.values()))
        self._updated_at = now

    def forget(self) -> None:
        """No figures any more (the feed broke): pick nothing until the next report."""
        self._updated_at = None

    def load(self, address: str) -> int:
        return self._workers[address].queued + self._sent[address]

    def work(self, address: str) -> int:
        """Prompt tokens the worker computed over the work window (as far as reports span it)."""
        reports = self._computed[address]
        return reports[-1][1] - reports[0][1]

    def overworked(self, serving: Sequence[str]) -> set[str]:
        """The serving workers over the work bound (none with the bound off, or no work)."""
        if not self._policy.work_bound_percent:
            return set()
        work = {address: self.work(address) for address in serving}
        total = sum(work.values())
        # work > bound% of the mean, in integers: work * 100 * n > bound * total.
        return {
            address
            for address, done in work.items()
            if done * 100 * len(serving) > self._policy.work_bound_percent * total
        }

    def pick(self, key: str, pool: str = "", adapter: str = "") -> list[str]:
        """The workers of the pool for a request with this affinity key (and LoRA adapter, if
        it names one), best first; empty when the figures are missing or stale or none of the
        pool's workers is serving."""
        picked, choice = self._pick(key, pool, adapter)
        if self._metrics is not None:
            self._metrics.picks.labels(choice=choice).inc()
        return picked

    def _pick(self, key: str, pool: str, adapter: str) -> tuple[list[str], str]:
        if (
            self._updated_at is None
            or self._clock() - self._updated_at > self._policy.stale_seconds
        ):
            return [], "none"
        serving = self._serving.get(pool, [])
        if not serving:
            return [], "none"
        least = min(self.load(address) for address in serving)
        bound = least + max(self._policy.slack_streams, least * self._policy.slack_percent // 100)
        overworked = self._overworked
        ranked = ranking(key, serving)
        if adapter:
            # The workers holding the adapter first (a load spared), each group in the key's
            # order; the load bound below still spills a hot adapter to one that must load it.
            ranked.sort(key=lambda address: adapter not in self._workers[address].held)
        # The least-loaded worker is within either bound: there is always one.
        chosen = next(
            address
            for address in ranked
            if self.load(address) <= (least if address in overworked else bound)
        )
        self._sent[chosen] += 1
        # A retry (the chosen one refused) goes to the least loaded of the rest.
        others = sorted((address for address in ranked if address != chosen), key=self.load)
        choice = "first" if chosen == ranked[0] else "spilled"
        return [chosen, *others][: self._policy.candidates], choice


def loads(snapshot: ops_pb2.WorkersSnapshot) -> list[WorkerLoad]:
    """The workers of a control-plane report; one that did not answer counts as not serving."""
    return [
        WorkerLoad(
            worker.address,
            worker.serving and not worker.error,
            worker.running_requests + worker.waiting_requests,
            worker.prefix_cache_queries - worker.prefix_cache_hits,
            worker.pool,
            frozenset(worker.held_adapters),
        )
        for worker in snapshot.workers
    ]


class WorkerFeed:
    """Keeps the picker's figures current from the control plane's OpsService.SubscribeWorkers
    stream, subscribing again (with back-off) whenever it breaks."""

    def __init__(
        self,
        channel: aio.Channel | SwappableChannel,
        picker: EndpointPicker,
        interval_ms: int,
        backoff: Backoff,
    ) -> None:
        self._channel = channel
        self._picker = picker
        self._interval_ms = interval_ms
        self._backoff = backoff

    async def run(self) -> None:
        """Until cancelled."""
        while True:
            try:
                await self._follow()
            except aio.AioRpcError as exc:
                log.warning(
                    "worker feed broke: picking no workers until it is back",
                    extra={"code": exc.code().name, "details": exc.details()},
                )
            self._picker.forget()
            await asyncio.sleep(self._backoff.next_delay())

    async def _follow(self) -> None:
        stub = ops_pb2_grpc.OpsServiceStub(self._channel)
        call = stub.SubscribeWorkers(ops_pb2.WorkersRequest(interval_ms=self._interval_ms))
        async for snapshot in call:
            self._picker.update(loads(snapshot))
            self._backoff.reset()


def header_value(addresses: Sequence[str]) -> str:
    """The picked workers as Envoy's override-host policy reads them."""
    return ",".join(addresses)
