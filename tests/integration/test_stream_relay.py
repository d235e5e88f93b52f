"""The edge's stream relay (envoy/relay) on the session's shared mesh, which relays by default: a
worker SIGKILLed while 16 gRPC and 16 OpenAI streams of 1,000 tokens run through the edge, and
every stream completes whole, the moved ones counted by the relay; greedy streams moved that
way say exactly what the same requests say on the undisturbed mesh; with no worker left, every
stream ends with a clear error (the last of the shared mesh's tests: it leaves no worker)."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import pytest
from grpc import aio

from tests.harness.chaos import ScenarioMesh, clients_first, kill_an_engine
from tests.integration.test_mesh_dashboards import RELAY_ONLY, panel_targets, series, substitute
from tests.support import relay_metric
from tokenmesh.common.tokens import token_count
from tokenmesh.localmesh.mesh import LocalMesh
from tokenmesh.v1 import llm_pb2, llm_pb2_grpc

pytestmark = pytest.mark.integration

GREEDY_STREAMS, GREEDY_TOKENS = 4, 400


@pytest.fixture(scope="module")
def relay_mesh(mesh: LocalMesh) -> Iterator[ScenarioMesh]:
    """The session's shared mesh (tests/integration/conftest.py), behind this module's clients
    on the machine's cores while it runs (clients_first)."""
    assert mesh.settings.mesh().relays, "the shared mesh relays streams (stream_relay)"
    with clients_first(mesh):
        yield ScenarioMesh(mesh)


async def test_a_killed_worker_moves_every_stream_of_both_protocols(
    relay_mesh: ScenarioMesh,
) -> None:
    moved_before = relay_metric(relay_mesh.local_mesh.settings.envoy_admin_port, "resumptions")
    row = await kill_an_engine(
        relay_mesh, "worker_kill through the relay", lambda i: f"relay kill {i}", False, True
    )
    print(asdict(row))
    assert row.passed, row.violations
    moved = sum(row.notes["moved_grpc_openai"])
    # Every stream the relay moved is counted, by its cause (the dead worker's streams reset).
    assert (
        relay_metric(relay_mesh.local_mesh.settings.envoy_admin_port, "resumptions") - moved_before
        >= moved
        > 0
    )
    # And the dashboards' panels of the relay's own series show the moves' gap (Prometheus
    # scrapes this mesh's Envoy).
    local_mesh = relay_mesh.local_mesh
    if not local_mesh.tools.prometheus:
        pytest.skip("no prometheus on PATH: install Debian's prometheus to check the panels")
    targets = panel_targets(RELAY_ONLY)
    assert targets, "the dashboards show the relay's gap"

    def gaps() -> list[float]:
        found = [series(local_mesh, substitute(expr)) for _, _, expr in targets]
        return [float(s["value"][1]) for result in found for s in result]

    shown = await relay_mesh.wait_until(
        lambda: len(gaps()) == len(targets) and all(0 < gap < 60 for gap in gaps()), 120, 2
    )
    assert shown is not None, (targets, gaps())


@dataclass
class Greedy:
    text: str
    tokens: int
    resumed: int


async def greedy(stub: llm_pb2_grpc.LLMServiceStub, i: int) -> Greedy:
    request = llm_pb2.GenerateRequest(
        prompt=f"greedy relay {i}: the engine keeps every token",
        max_tokens=GREEDY_TOKENS,
        ignore_eos=True,
        temperature=0,
    )
    text, tokens, resumed = [], 0, 0
    async for token in stub.Generate(request, timeout=180):
        text.append(token.text)
        tokens += token_count(token)
        resumed = max(resumed, token.resumed)
    return Greedy("".join(text), tokens, resumed)


async def test_greedy_streams_moved_by_the_relay_equal_the_undisturbed_ones(
    relay_mesh: ScenarioMesh,
) -> None:
    local_mesh = relay_mesh.local_mesh
    workers = local_mesh.replicas("worker")
    assert await relay_mesh.wait_until(
        lambda: {w.address for w in workers} <= relay_mesh.healthy("worker"), 120, 1
    ), "both workers routable"
    killed: dict[str, object] = {}

    def kill(open_streams: dict[str, int]) -> None:
        victim = max(workers, key=lambda w: open_streams[w.name])
        killed["victim"] = victim
        os.kill(local_mesh.pid(victim.name), signal.SIGKILL)

    async with relay_mesh.channel() as channel:
        stub = llm_pb2_grpc.LLMServiceStub(channel)
        before = await asyncio.to_thread(relay_mesh.worker_counts)
        running = [asyncio.create_task(greedy(stub, i)) for i in range(GREEDY_STREAMS)]
        # The busiest worker is killed wherever the streams went (all of them may share one).
        at_kill, seen = await asyncio.to_thread(
            relay_mesh.kill_when_generating, 120, kill, before, True, True, True
        )
        assert at_kill is not None, seen
        disturbed = await asyncio.gather(*running)
        assert all(g.tokens == GREEDY_TOKENS for g in disturbed), disturbed
        assert any(g.resumed for g in disturbed), "some streams were on the killed worker"
        victim = killed["victim"]
        assert await relay_mesh.rejoined(victim)  # type: ignore[arg-type]
        undisturbed = await asyncio.gather(*(greedy(stub, i) for i in range(GREEDY_STREAMS)))
    assert not any(g.resumed for g in undisturbed)
    assert [g.text for g in disturbed] == [g.text for g in undisturbed]


# Both workers end: it runs after every other test of the shared mesh, which then stops.
@pytest.mark.ends_mesh
async def test_with_no_worker_left_every_stream_ends_with_a_clear_error(
    relay_mesh: ScenarioMesh,
) -> None:
    """Both workers SIGKILLed mid-stream: each stream ends UNAVAILABLE naming how far it got
    (or that no worker answered), well within its deadline."""
    local_mesh = relay_mesh.local_mesh
    workers = local_mesh.replicas("worker")
    assert await relay_mesh.wait_until(
        lambda: {w.address for w in workers} <= relay_mesh.healthy("worker"), 120, 1
    ), "both workers routable"

    def kill(_: dict[str, int]) -> None:
        for worker in workers:
            os.kill(local_mesh.pid(worker.name), signal.SIGKILL)

    async def one(stub: llm_pb2_grpc.LLMServiceStub, i: int) -> aio.AioRpcError | None:
        request = llm_pb2.GenerateRequest(
            prompt=f"no worker left {i}", max_tokens=1000, ignore_eos=True
        )
        try:
            async for _ in stub.Generate(request, timeout=120):
                pass
        except aio.AioRpcError as err:
            return err
        return None

    async with relay_mesh.channel() as channel:
        stub = llm_pb2_grpc.LLMServiceStub(channel)
        before = await asyncio.to_thread(relay_mesh.worker_counts)
        running = [asyncio.create_task(one(stub, i)) for i in range(4)]
        # Both workers are killed, wherever the streams went.
        at_kill, seen = await asyncio.to_thread(
            relay_mesh.kill_when_generating, 120, kill, before, True, True, True
        )
        assert at_kill is not None, seen
        errors = await asyncio.wait_for(asyncio.gather(*running), 60)
    assert all(err is not None for err in errors), errors
    for err in errors:
        assert err is not None and err.code().name == "UNAVAILABLE", err
        assert err.details(), err
    # (Their return is chaos' engines_all_dead's to check; the mesh stops after this test.)
