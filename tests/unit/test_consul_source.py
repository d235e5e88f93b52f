"""The Consul source against a fake agent that replays Consul's documented HTTP behaviour:
the health response format, blocking queries (X-Consul-Index, index, wait), the passing
filter, 500 errors (backoff, last known endpoints kept) and a restarted Consul."""

from __future__ import annotations

import asyncio
import itertools
import random
from typing import Any

import pytest

from tests.consul_fake import FakeConsul, Instance
from tests.support import eventually
from tokenmesh.common.backoff import Backoff
from tokenmesh.common.consul_http import ConsulAddress, consul_client
from tokenmesh.controlplane.consul_source import ConsulSource, endpoints_from_health
from tokenmesh.controlplane.endpoints import Endpoint, Snapshot

# Generous bound for "promptly" on a noisy 2-core machine; the design target is well under 1 s.
PROMPTLY = 5.0
QUIET = 0.3
BACKOFF_INITIAL = 0.1

# One entry of GET /v1/health/service/<name> as the Consul docs show it (trimmed).
DOCUMENTED_ENTRY: dict[str, Any] = {
    "Node": {"ID": "40e4a748", "Node": "foobar", "Address": "10.1.10.12", "Datacenter": "dc1"},
    "Service": {
        "ID": "redis",
        "Service": "redis",
        "Tags": ["primary"],
        "Address": "10.1.10.12",
        "Meta": {"redis_version": "4.0"},
        "Port": 8000,
    },
    "Checks": [
        {"Node": "foobar", "CheckID": "service:redis", "Status": "passing", "ServiceID": "redis"},
        {"Node": "foobar", "CheckID": "serfHealth", "Status": "passing", "ServiceID": ""},
    ],
}


def entry(address: str, port: int, *statuses: str, node_address: str = "10.0.0.9") -> Any:
    return {
        "Node": {"Node": "n", "Address": node_address},
        "Service": {"ID": f"s{port}", "Service": "worker", "Address": address, "Port": port},
        "Checks": [{"CheckID": f"c{i}", "Status": s} for i, s in enumerate(statuses)],
    }


def test_health_entries_become_endpoints_healthy_only_when_every_check_passes() -> None:
    assert endpoints_from_health([DOCUMENTED_ENTRY]) == [Endpoint("10.1.10.12", 8000)]
    assert endpoints_from_health(
        [
            entry("10.0.0.1", 1, "passing", "passing"),
            entry("10.0.0.2", 2, "passing", "warning"),
            entry("10.0.0.3", 3, "critical"),
            entry("", 4, "passing"),  # no service address: the node's
            entry("worker.internal", 5, "passing"),  # not an IP: skipped, Envoy would reject
        ]
    ) == [
        Endpoint("10.0.0.1", 1),
        Endpoint("10.0.0.2", 2, healthy=False),
        Endpoint("10.0.0.3", 3, healthy=False),
        Endpoint("10.0.0.9", 4),
    ]


@pytest.mark.parametrize(
    ("address", "parsed"),
    [
        ("127.0.0.1:8500", ("http", "127.0.0.1", 8500)),
        ("consul.service:8501", ("http", "consul.service", 8501)),
        ("https://consul:8501", ("https", "consul", 8501)),
        ("http://10.0.0.1", ("http", "10.0.0.1", 8500)),
    ],
)
def test_consul_addresses_parse_like_consul_http_addr(
    address: str, parsed: tuple[str, str, int]
) -> None:
    result = ConsulAddress.parse(address)
    assert (result.scheme, result.host, result.port) == parsed


def test_a_bad_consul_address_is_rejected() -> None:
    with pytest.raises(ValueError, match="expected"):
        ConsulAddress.parse("unix:///var/run/consul.sock")


class RecordingBackoff(Backoff):
    def __init__(self) -> None:
        super().__init__(BACKOFF_INITIAL, 1.0, random.Random(7))
        self.delays: list[float] = []

    def next_delay(self) -> float:
        delay = super().next_delay()
        self.delays.append(delay)
        return delay


class Watch:
    def __init__(self, fake_consul: FakeConsul, services: list[str], passing_only: bool = False):
        self.client = consul_client(fake_consul.address, request_timeout=10)
        self.errors = 0
        self.backoffs: list[RecordingBackoff] = []
        self.source = ConsulSource(
            self.client,
            services,
            passing_only=passing_only,
            wait_seconds=5,
            backoff=self._backoff,
            on_error=self._error,
        )
        self.snapshots: asyncio.Queue[Snapshot] = asyncio.Queue()
        self._task = asyncio.create_task(self._run())

    def _backoff(self) -> Backoff:
        self.backoffs.append(RecordingBackoff())
        return self.backoffs[-1]

    def _error(self) -> None:
        self.errors += 1

    async def _run(self) -> None:
        async for snapshot in self.source.snapshots():
            self.snapshots.put_nowait(snapshot)

    async def next(self, within: float = PROMPTLY) -> Snapshot:
        return await asyncio.wait_for(self.snapshots.get(), within)

    async def nothing_within(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
        assert self.snapshots.empty(), self.snapshots.get_nowait()

    async def stop(self) -> None:
        self._task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await self._task
        await self.client.close()


def worker(port: int, status: str = "passing") -> Instance:
    return Instance(f"worker-{port}", "worker", "127.0.0.1", port, check_status=status)


async def test_first_snapshot_waits_for_every_service_then_lists_them(
    fake_consul: FakeConsul,
) -> None:
    fake_consul.put_instance(worker(50061))
    watch = Watch(fake_consul, ["worker", "gateway"])
    try:
        assert await watch.next() == {"gateway": (), "worker": (Endpoint("127.0.0.1", 50061),)}
    finally:
        await watch.stop()


async def test_blocking_query_is_held_until_a_change_and_returns_it_at_once(
    fake_consul: FakeConsul,
) -> None:
    fake_consul.put_instance(worker(50061))
    watch = Watch(fake_consul, ["worker"])
    try:
        await watch.next()
        first = fake_consul.requests_to("/v1/health/service/worker")[0]
        assert "index" not in first.query  # the first query answers at once
        await eventually(lambda: fake_consul.blocked == 1)  # the next one is held by the agent
        held = fake_consul.requests_to("/v1/health/service/worker")[-1]
        assert held.query["index"] == "2" and held.query["wait"] == "5s"  # X-Consul-Index
        fake_consul.put_instance(worker(50062))
        assert (await watch.next())["worker"] == (
            Endpoint("127.0.0.1", 50061),
            Endpoint("127.0.0.1", 50062),
        )
        # Nothing changed since: the following query waits again instead of polling.
        await eventually(lambda: fake_consul.blocked == 1)
        assert len(fake_consul.requests_to("/v1/health/service/worker")) == 3
    finally:
        await watch.stop()


async def test_a_failing_check_marks_the_endpoint_unhealthy(fake_consul: FakeConsul) -> None:
    fake_consul.put_instance(worker(50061))
    watch = Watch(fake_consul, ["worker"])
    try:
        await watch.next()
        fake_consul.set_status("worker-50061", "critical")
        assert (await watch.next())["worker"] == (Endpoint("127.0.0.1", 50061, healthy=False),)
        assert all("passing" not in r.query for r in fake_consul.requests_to("/v1/health/"))
    finally:
        await watch.stop()


async def test_passing_only_asks_consul_to_filter(fake_consul: FakeConsul) -> None:
    fake_consul.put_instance(worker(50061))
    fake_consul.put_instance(worker(50062, "critical"))
    watch = Watch(fake_consul, ["worker"], passing_only=True)
    try:
        assert (await watch.next())["worker"] == (Endpoint("127.0.0.1", 50061),)
        assert fake_consul.requests_to("/v1/health/service/worker")[0].query["passing"] == "1"
        fake_consul.set_status("worker-50062", "passing")
        assert len((await watch.next())["worker"]) == 2
    finally:
        await watch.stop()


async def test_errors_back_off_and_keep_the_last_known_endpoints(fake_consul: FakeConsul) -> None:
    fake_consul.put_instance(worker(50061))
    watch = Watch(fake_consul, ["worker"])
    try:
        await watch.next()
        await eventually(lambda: fake_consul.blocked == 1)
        failures = 4
        fake_consul.fail_next(failures)
        fake_consul.put_instance(worker(50062))  # the held query returns this change ...
        assert len((await watch.next())["worker"]) == 2
        # ... then the next 4 queries fail with 500s: nothing is yielded meanwhile (the
        # consumer keeps serving what it has), and the watch recovers by itself.
        await eventually(lambda: watch.errors == failures, within=PROMPTLY + 2)
        await eventually(lambda: fake_consul.blocked == 1)
        await watch.nothing_within(QUIET)

        queries = fake_consul.requests_to("/v1/health/service/worker")
        failed = [r for r in queries if r.status == 500]
        assert len(failed) == failures
        # Each retry waited at least half its doubling step (equal jitter), so no hot loop.
        backoff = watch.backoffs[0]
        assert len(backoff.delays) == failures
        gaps = [b.at - a.at for a, b in itertools.pairwise(failed)]
        for failure, gap in enumerate(gaps, start=1):
            assert gap >= backoff.step(failure) / 2 * 0.9, (gaps, backoff.delays)
        # After an error the watch starts over without an index.
        recovered = queries[queries.index(failed[-1]) + 1]
        assert recovered.status == 200 and "index" not in recovered.query
        assert backoff.failures == 0  # reset by the success

        fake_consul.remove("worker-50061")
        assert (await watch.next())["worker"] == (Endpoint("127.0.0.1", 50062),)
    finally:
        await watch.stop()


async def test_a_restarted_consul_is_followed_despite_its_index_going_back(
    fake_consul: FakeConsul,
) -> None:
    for port in (50061, 50062, 50063):
        fake_consul.put_instance(worker(port))
    watch = Watch(fake_consul, ["worker"])
    try:
        assert len((await watch.next())["worker"]) == 3
        await eventually(lambda: fake_consul.blocked == 1)
        # A -dev agent: everything forgotten, index back to 1.
        await fake_consul.restart(downtime=0.3)
        assert await watch.next() == {"worker": ()}
        fake_consul.put_instance(worker(50064))  # index 2: below what the watch had seen before
        assert await watch.next() == {"worker": (Endpoint("127.0.0.1", 50064),)}
        assert watch.errors >= 1
    finally:
        await watch.stop()


def test_backoff_doubles_up_to_the_cap_with_jitter_and_resets() -> None:
    backoff = Backoff(0.1, 1.0, random.Random(1))
    delays = [backoff.next_delay() for _ in range(7)]
    steps = [0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0]
    for delay, step in zip(delays, steps, strict=True):
        assert step / 2 <= delay <= step
    assert len(set(delays)) == len(delays)  # jittered, not a fixed schedule
    backoff.reset()
    assert backoff.next_delay() <= 0.1
    assert Backoff(0.1, 5.0).step(10_000) == 5.0  # no overflow after a long outage
