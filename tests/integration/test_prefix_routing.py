"""Prefix-aware routing on the real mesh: second Envoys with worker_routing prefix (Maglev) and
picker (the gateways' endpoint picker) in front of the session mesh's gateways and two workers.
Repeats of a prefix reach one worker, prefixes spread over both, a hot prefix spills under
load, and a worker out of rotation hands its prefixes to the other without an error (Envoy's
own per-host counters say where each went)."""

from __future__ import annotations

import asyncio
import contextlib
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator, Iterator

import psutil
import pytest
from grpc import aio

from tests.harness.meshes import second_envoy
from tests.support import eventually, metric_value, scrape_metrics
from tests.timing import unstalled
from tokenmesh.common.tokens import token_count
from tokenmesh.gateway.core.picker import CHOICES
from tokenmesh.localmesh.mesh import LocalMesh
from tokenmesh.meshconfig.config import MeshSettings
from tokenmesh.v1 import llm_pb2, llm_pb2_grpc, ops_pb2, ops_pb2_grpc

pytestmark = pytest.mark.integration

# Longer than the gateway's affinity_prefix_chars (1024): only this part makes the key.
PREFIX_WORDS = 220


@pytest.fixture(scope="module")
def prefix_edge(mesh: LocalMesh) -> Iterator[MeshSettings]:
    with second_envoy(mesh, mesh.log_dir, worker_routing="prefix") as (settings, _):
        yield settings


@pytest.fixture
async def edge(prefix_edge: MeshSettings) -> AsyncIterator[llm_pb2_grpc.LLMServiceStub]:
    async with aio.insecure_channel(f"127.0.0.1:{prefix_edge.edge_port}") as channel:
        yield llm_pb2_grpc.LLMServiceStub(channel)


def prefix(name: str) -> str:
    return " ".join(f"{name}-{index}" for index in range(PREFIX_WORDS))


def worker_hosts(settings: MeshSettings) -> dict[str, dict[str, str]]:
    """The workers' cluster as this Envoy sees it: per host, its counters and health flags
    (admin /clusters: worker::HOST::NAME::VALUE)."""
    url = f"http://127.0.0.1:{settings.admin_port}/clusters"
    with urllib.request.urlopen(url, timeout=5) as response:
        lines = response.read().decode().splitlines()
    hosts: dict[str, dict[str, str]] = {}
    for line in lines:
        parts = line.split("::")
        # HOST is an address:port; the cluster's own lines (default_priority::...) are not.
        if len(parts) == 4 and parts[0] == "worker" and ":" in parts[1]:
            hosts.setdefault(parts[1], {})[parts[2]] = parts[3]
    return hosts


def requests_by_host(settings: MeshSettings) -> Counter[str]:
    return Counter({host: int(stats["rq_total"]) for host, stats in worker_hosts(settings).items()})


async def generate(edge: llm_pb2_grpc.LLMServiceStub, prompt: str, tokens: int = 4) -> int:
    received = 0
    async for token in edge.Generate(
        llm_pb2.GenerateRequest(prompt=prompt, max_tokens=tokens, ignore_eos=True), timeout=60
    ):
        received += token_count(token)
    return received


async def placements(
    settings: MeshSettings, edge: llm_pb2_grpc.LLMServiceStub, names: list[str], tokens: int = 4
) -> dict[str, set[str]]:
    """Three questions after each named prefix, one after another: the workers each prefix's
    questions reached (Envoy's counters before and after each)."""
    placed: dict[str, set[str]] = {}
    for name in names:
        for question in range(3):
            before = requests_by_host(settings)
            await generate(edge, f"{prefix(name)} question {question}?", tokens)
            [(host, count)] = (requests_by_host(settings) - before).items()
            assert count == 1
            placed.setdefault(name, set()).add(host)
    return placed


async def warm_connections(settings: MeshSettings, edge: llm_pb2_grpc.LLMServiceStub) -> None:
    """Requests of other prefixes on this channel until both workers have taken one."""
    reached: set[str] = set()
    for number in range(24):  # both reached within 24 keys but for 1 chance in 8 million
        before = requests_by_host(settings)
        await generate(edge, f"{prefix(f'warm{number}')} ?")
        reached |= (requests_by_host(settings) - before).keys()
        if len(reached) == 2:
            return
    raise AssertionError(f"24 prefixes all reached {reached}")


async def test_repeats_of_a_prefix_reach_one_worker_and_prefixes_spread_over_both(
    prefix_edge: MeshSettings, edge: llm_pb2_grpc.LLMServiceStub
) -> None:
    assert len(worker_hosts(prefix_edge)) == 2
    placed = await placements(prefix_edge, edge, [f"topic{number}" for number in range(12)])
    assert all(len(hosts) == 1 for hosts in placed.values()), placed
    # 12 keys over 2 workers all on one: 1 chance in 2,048.
    assert len(set().union(*placed.values())) == 2, placed


async def test_a_hot_prefix_spills_to_the_other_worker_under_load(
    prefix_edge: MeshSettings, edge: llm_pb2_grpc.LLMServiceStub
) -> None:
    """Bounded load: with 16 streams of one prefix in flight at once (long enough that none
    ends before the last begins), its worker would hold all of them; past 125 % of the mean,
    Envoy sends the next to the other worker."""
    # Envoy counts a stream toward a host's load only once the stream holds a connection:
    # while this channel's Envoy thread opens its first connection to the other worker, the
    # streams waiting for it count nowhere, the home worker stays over its bound, and every
    # stream of the burst goes to the other (seen: home kept 5 of 16 when the burst opened
    # that connection). Both connections open first, as on any Envoy that has carried traffic.
    await warm_connections(prefix_edge, edge)
    hot = prefix("hot")
    before = requests_by_host(prefix_edge)
    await generate(edge, f"{hot} alone")
    [home] = (requests_by_host(prefix_edge) - before).keys()
    before = requests_by_host(prefix_edge)
    counts = await asyncio.gather(
        *(generate(edge, f"{hot} burst {number}", tokens=512) for number in range(16))
    )
    assert counts == [512] * 16
    spread = requests_by_host(prefix_edge) - before
    assert sum(spread.values()) == 16
    assert len(spread) == 2, spread
    # Its own worker still takes the larger share.
    assert spread[home] >= 8, spread


async def test_a_worker_out_of_rotation_loses_its_prefixes_to_the_other_without_errors(
    mesh: LocalMesh, prefix_edge: MeshSettings, edge: llm_pb2_grpc.LLMServiceStub
) -> None:
    names = [f"moved{number}" for number in range(8)]
    home: dict[str, str] = {}
    for name in names:
        before = requests_by_host(prefix_edge)
        await generate(edge, f"{prefix(name)} first")
        [home[name]] = (requests_by_host(prefix_edge) - before).keys()
    stopped_host = Counter(home.values()).most_common(1)[0][0]
    [program] = [p for p in mesh.replicas("worker") if p.address == stopped_host]
    worker = psutil.Process(mesh.pid(program.name))
    worker.suspend()  # SIGSTOP: its health checks time out and Envoy takes it out
    try:
        await eventually(
            lambda: (
                "failed_active_hc"
                in worker_hosts(prefix_edge)[stopped_host].get("health_flags", "")
            ),
            within=15,
        )
        moved = [name for name in names if home[name] == stopped_host]
        before = requests_by_host(prefix_edge)
        counts = await asyncio.gather(*(generate(edge, f"{prefix(name)} again") for name in moved))
        assert counts == [4] * len(moved)
        after = requests_by_host(prefix_edge) - before
        assert after[stopped_host] == 0 and sum(after.values()) == len(moved), after
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            worker.resume()
    # Back in rotation, its prefixes return to it.
    await eventually(
        lambda: "failed" not in worker_hosts(prefix_edge)[stopped_host].get("health_flags", ""),
        within=15,
    )
    before = requests_by_host(prefix_edge)
    await generate(edge, f"{prefix(moved[0])} home again")
    assert (requests_by_host(prefix_edge) - before)[stopped_host] == 1


@pytest.fixture(scope="module")
def picker_edge(mesh: LocalMesh) -> Iterator[MeshSettings]:
    """An Envoy that sends each stream where the gateways' endpoint picker says (the session
    mesh's gateways run it: LocalMeshSettings.picker_feed)."""
    with second_envoy(mesh, mesh.log_dir, worker_routing="picker") as (settings, _):
        yield settings


@pytest.fixture
async def picked(
    mesh: LocalMesh, picker_edge: MeshSettings
) -> AsyncIterator[llm_pb2_grpc.LLMServiceStub]:
    """The picker's edge once the control plane's feed shows every worker serving: a worker
    an earlier test stopped may still be out of the picker's figures after Envoy's health
    checks took it back, and picks made meanwhile would go to the other one."""
    for program in mesh.replicas("worker"):
        await worker_reported(mesh, program.address, serving=True, within=30)
    async with aio.insecure_channel(f"127.0.0.1:{picker_edge.edge_port}") as channel:
        yield llm_pb2_grpc.LLMServiceStub(channel)


def picks_by_choice(mesh: LocalMesh) -> Counter[str]:
    """The gateways' endpoint pickers' picks, summed, by why they chose (picker.CHOICES)."""
    pages = [scrape_metrics(program.metrics_port or 0) for program in mesh.replicas("gateway")]
    return Counter(
        {
            choice: sum(
                metric_value(page, "tokenmesh_gateway_worker_picks_total", 0.0, choice=choice)
                for page in pages
            )
            for choice in CHOICES
        }
    )


async def test_the_picker_keeps_repeats_of_a_prefix_on_one_worker_and_spreads_prefixes(
    mesh: LocalMesh, picker_edge: MeshSettings, picked: llm_pb2_grpc.LLMServiceStub
) -> None:
    # Between two reports of the control plane the picker counts every stream it sent as still
    # running (it does not see a direct stream end), so repeats sent faster than the reports
    # come can spill: the questions are long enough (64 tokens) for the reports to keep up. A
    # round the machine itself stalled during (stolen CPU time, a kernel lockup) is measured
    # again with new prefixes; nothing else is.
    attempts = iter(range(3))

    async def place() -> tuple[dict[str, set[str]], Counter[str]]:
        before, attempt = picks_by_choice(mesh), next(attempts)
        names = [f"theme{number + 12 * attempt}" for number in range(12)]
        placed = await placements(picker_edge, picked, names, tokens=64)
        return placed, picks_by_choice(mesh) - before

    (placed, picks), stalled = await unstalled(place, again=2)
    assert picks == Counter({"first": 36, "spilled": 0, "none": 0}), (placed, picks, stalled)
    assert all(len(hosts) == 1 for hosts in placed.values()), (placed, picks)
    # A new prefix goes to the less loaded worker, the last one's to the other: both get some.
    assert len(set().union(*placed.values())) == 2, placed


async def test_the_picker_spreads_a_hot_prefix_by_load(
    picker_edge: MeshSettings, picked: llm_pb2_grpc.LLMServiceStub
) -> None:
    """16 streams of one prefix at once: its worker takes them while it is at most a couple of
    streams ahead of the other, which then takes its share. How the 16 split is not asserted:
    the mesh's two gateways each count only their own picks between the control plane's
    reports, so the split follows where the reports fall in the burst (9/7 either way seen);
    the one picker's bounded-load rule is test_picker.py's."""
    hot = prefix("heat")
    before = requests_by_host(picker_edge)
    await generate(picked, f"{hot} alone")
    [home] = (requests_by_host(picker_edge) - before).keys()
    before = requests_by_host(picker_edge)
    counts = await asyncio.gather(
        *(generate(picked, f"{hot} burst {number}", tokens=64) for number in range(16))
    )
    assert counts == [64] * 16
    spread = requests_by_host(picker_edge) - before
    assert sum(spread.values()) == 16
    assert len(spread) == 2 and spread[home] > 0, spread


async def worker_reported(mesh: LocalMesh, address: str, serving: bool, within: float) -> None:
    """Until the control plane's worker feed (the picker's figures) has shown the worker
    serving, or not (a probe that timed out counts as not), twice running: the gateways'
    own subscriptions see it by then too."""
    async with aio.insecure_channel(f"127.0.0.1:{mesh.settings.controlplane_port}") as channel:
        feed = ops_pb2_grpc.OpsServiceStub(channel).SubscribeWorkers(
            ops_pb2.WorkersRequest(interval_ms=100), timeout=within
        )
        running = 0
        async for snapshot in feed:
            [worker] = [worker for worker in snapshot.workers if worker.address == address]
            running = running + 1 if (worker.serving and not worker.error) == serving else 0
            if running == 2:
                feed.cancel()
                return


async def test_a_worker_the_picker_sees_stop_loses_its_prefixes_without_errors(
    mesh: LocalMesh, picker_edge: MeshSettings, picked: llm_pb2_grpc.LLMServiceStub
) -> None:
    names = [f"shift{number}" for number in range(6)]
    home: dict[str, str] = {}
    for name in names:
        before = requests_by_host(picker_edge)
        await generate(picked, f"{prefix(name)} first")
        [home[name]] = (requests_by_host(picker_edge) - before).keys()
    stopped_host = Counter(home.values()).most_common(1)[0][0]
    [program] = [p for p in mesh.replicas("worker") if p.address == stopped_host]
    worker = psutil.Process(mesh.pid(program.name))
    worker.suspend()  # SIGSTOP: the control plane's probes of it time out
    try:
        await worker_reported(mesh, stopped_host, serving=False, within=15)
        moved = [name for name in names if home[name] == stopped_host]
        before = requests_by_host(picker_edge)
        counts = await asyncio.gather(
            *(generate(picked, f"{prefix(name)} again") for name in moved)
        )
        assert counts == [4] * len(moved)
        after = requests_by_host(picker_edge) - before
        assert after[stopped_host] == 0 and sum(after.values()) == len(moved), after
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            worker.resume()
    await worker_reported(mesh, stopped_host, serving=True, within=15)
