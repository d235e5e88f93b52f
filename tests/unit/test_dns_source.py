"""The DNS endpoint source (Kubernetes headless Services): names resolved to endpoints, a
missing name empties its cluster, a failing resolver keeps the last known endpoints, and a
snapshot only when something changed."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import pytest

from tokenmesh.controlplane.config import ControlPlaneSettings
from tokenmesh.controlplane.dns_source import DnsSource, parse_target, resolve
from tokenmesh.controlplane.endpoints import Endpoint, Snapshot

# Generous bound on a change being noticed (the poll interval below is 0.01 s).
NOTICED_WITHIN = 5.0
# Long enough for a wrongly produced snapshot to show up; only to show one does NOT.
QUIET = 0.2


class FakeDns:
    """Answers from a mutable table; a name mapped to an exception raises it."""

    def __init__(self, table: dict[str, list[str] | OSError]) -> None:
        self.table = table
        self.lookups = 0

    async def __call__(self, host: str) -> list[str]:
        self.lookups += 1
        answer = self.table[host]
        if isinstance(answer, OSError):
            raise answer
        return list(answer)


class Snapshots:
    """The source's snapshots, collected by a task (cancelling anext would close the source)."""

    def __init__(self, source: DnsSource) -> None:
        self._queue: asyncio.Queue[Snapshot] = asyncio.Queue()
        self._task = asyncio.create_task(self._run(source.snapshots()))

    async def _run(self, snapshots: AsyncIterator[Snapshot]) -> None:
        async for snapshot in snapshots:
            self._queue.put_nowait(snapshot)

    async def next(self, within: float = NOTICED_WITHIN) -> Snapshot:
        return await asyncio.wait_for(self._queue.get(), within)

    async def nothing_within(self, seconds: float = QUIET) -> None:
        with pytest.raises(TimeoutError):
            await self.next(seconds)

    async def stop(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


Watch = Callable[[DnsSource], Snapshots]


@pytest.fixture
async def watch() -> AsyncIterator[Watch]:
    """Start collecting a source's snapshots; every collector is stopped after the test."""
    started: list[Snapshots] = []

    def start(source: DnsSource) -> Snapshots:
        started.append(Snapshots(source))
        return started[-1]

    yield start
    for snapshots in started:
        await snapshots.stop()


async def test_each_cluster_gets_one_endpoint_per_address_on_its_port(watch: Watch) -> None:
    dns = FakeDns({"w.svc": ["10.0.0.2", "10.0.0.1", "10.0.0.2"], "r.svc": ["fd00::5"]})
    source = DnsSource({"worker": "w.svc:50061", "reranker": "r.svc:50071"}, 0.01, dns)
    snapshot = await watch(source).next()
    assert snapshot == {
        "reranker": (Endpoint("fd00::5", 50071),),
        "worker": (Endpoint("10.0.0.1", 50061), Endpoint("10.0.0.2", 50061)),
    }


async def test_changes_are_pushed_and_repeats_are_not(watch: Watch) -> None:
    dns = FakeDns({"w.svc": ["10.0.0.1"]})
    snapshots = watch(DnsSource({"worker": "w.svc:50061"}, 0.01, dns))
    assert await snapshots.next() == {"worker": (Endpoint("10.0.0.1", 50061),)}
    # The name keeps being polled, and the same answers again are not pushed.
    lookups = dns.lookups
    async with asyncio.timeout(NOTICED_WITHIN):
        while dns.lookups <= lookups + 2:  # noqa: ASYNC110 (a counter, not an event)
            await asyncio.sleep(0.01)
    await snapshots.nothing_within()
    dns.table["w.svc"] = ["10.0.0.1", "10.0.0.3"]
    changed = await snapshots.next()
    assert changed["worker"] == (Endpoint("10.0.0.1", 50061), Endpoint("10.0.0.3", 50061))


async def test_a_name_without_addresses_empties_its_cluster(watch: Watch) -> None:
    """A headless Service with no ready pod answers NXDOMAIN: Envoy must get no hosts."""
    dns = FakeDns({"w.svc": ["10.0.0.1"]})
    snapshots = watch(DnsSource({"worker": "w.svc:50061"}, 0.01, dns))
    await snapshots.next()
    dns.table["w.svc"] = []
    assert await snapshots.next() == {"worker": ()}


async def test_a_failing_resolver_keeps_the_last_known_endpoints(watch: Watch) -> None:
    errors: list[int] = []
    dns = FakeDns({"w.svc": ["10.0.0.1"], "r.svc": ["10.0.0.9"]})
    source = DnsSource(
        {"worker": "w.svc:50061", "reranker": "r.svc:50071"},
        0.01,
        dns,
        on_error=lambda: errors.append(1),
    )
    snapshots = watch(source)
    await snapshots.next()
    dns.table["w.svc"] = OSError("resolver timed out")
    dns.table["r.svc"] = ["10.0.0.8"]
    changed = await snapshots.next()
    assert changed == {
        "reranker": (Endpoint("10.0.0.8", 50071),),
        "worker": (Endpoint("10.0.0.1", 50061),),
    }
    assert errors


async def test_nothing_is_served_until_every_name_has_answered(watch: Watch) -> None:
    dns = FakeDns({"w.svc": OSError("no resolver yet"), "r.svc": ["10.0.0.9"]})
    snapshots = watch(DnsSource({"worker": "w.svc:1", "reranker": "r.svc:2"}, 0.01, dns))
    await snapshots.nothing_within()
    dns.table["w.svc"] = ["10.0.0.1"]
    assert set(await snapshots.next()) == {"worker", "reranker"}


async def test_unusable_addresses_are_skipped(watch: Watch) -> None:
    dns = FakeDns({"w.svc": ["w-0.w.svc", "10.0.0.1"]})
    snapshot = await watch(DnsSource({"worker": "w.svc:50061"}, 0.01, dns)).next()
    assert snapshot == {"worker": (Endpoint("10.0.0.1", 50061),)}


async def test_the_system_resolver_resolves_localhost_and_not_a_missing_name() -> None:
    assert "127.0.0.1" in await resolve("localhost")
    # .invalid never resolves (RFC 2606): the answer is "no addresses", not an error.
    assert await resolve("no-such-service.invalid") == []


@pytest.mark.parametrize("target", ["w.svc", "w.svc:", ":50061", "w.svc:0", "w.svc:http"])
def test_bad_targets_are_refused(target: str) -> None:
    with pytest.raises(ValueError, match=r"worker|not in 1\.\.65535"):
        parse_target("worker", target)


def test_settings_take_targets_as_json_and_require_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENMESH_CONTROLPLANE_SOURCE", "dns")
    monkeypatch.setenv("TOKENMESH_CONTROLPLANE_DNS_TARGETS", '{"worker": "w.svc:50061"}')
    assert ControlPlaneSettings().dns_targets == {"worker": "w.svc:50061"}
    monkeypatch.delenv("TOKENMESH_CONTROLPLANE_DNS_TARGETS")
    with pytest.raises(ValueError, match="dns_targets"):
        ControlPlaneSettings()
