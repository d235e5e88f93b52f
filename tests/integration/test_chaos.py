"""Failure behaviour, with real faults in the shared mesh: the short version of each
`make chaos` scenario (tests/harness/chaos.py). Each test injects its fault with a real signal to a
real process (or stops one), drives bounded traffic through the edge, asserts the scenario's
guarantees and that no request hung, and leaves the mesh as it found it (restarted programs
healthy in Envoy again) for the tests after it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import asdict

import pytest

from tests.harness.chaos import (
    REJOIN_WITHIN_SECONDS,
    SCENARIOS,
    Row,
    ScenarioMesh,
    clients_first,
    streams_move,
)
from tokenmesh.localmesh.mesh import LocalMesh

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def chaos_mesh(mesh: LocalMesh) -> Iterator[ScenarioMesh]:
    """The session's shared mesh (tests/integration/conftest.py), behind this module's clients
    on the machine's cores while it runs (clients_first)."""
    with clients_first(mesh):
        yield ScenarioMesh(mesh)


async def run(mesh: ScenarioMesh, name: str) -> Row:
    """Run a scenario's short version; every violated guarantee fails the test."""
    # Everything a scenario waits for is bounded; a restarted worker may take minutes to load
    # vLLM on a busy machine, which the 300 s test timeout covers.
    row = await SCENARIOS[name](mesh, True)
    print(json.dumps(asdict(row)))
    assert row.hung == 0, f"{row.hung} requests hung"
    assert not row.violations, row.violations
    return row


async def test_deadline_storm_ends_deadline_exceeded_and_empties_the_engines(
    chaos_mesh: ScenarioMesh,
) -> None:
    row = await run(chaos_mesh, "deadline_storm")
    assert set(row.failed) == {"DEADLINE_EXCEEDED"}


async def test_hung_reranker_opens_the_breaker_and_recovers_through_half_open(
    chaos_mesh: ScenarioMesh,
) -> None:
    row = await run(chaos_mesh, "reranker_hang")
    assert row.degraded and row.ok == row.sent


async def test_envoy_keeps_serving_while_the_control_plane_is_down(
    chaos_mesh: ScenarioMesh,
) -> None:
    row = await run(chaos_mesh, "controlplane_down")
    assert row.ok == row.sent


async def test_killed_worker_cuts_its_streams_unavailable_and_others_are_retried(
    chaos_mesh: ScenarioMesh,
) -> None:
    row = await run(chaos_mesh, "worker_kill")
    if streams_move(chaos_mesh.local_mesh):
        # The edge's stream relay or the gateways move the killed worker's streams.
        assert row.ok == row.sent and row.moved, row
        return
    # On the direct token path Envoy's router can only reset a stream whose headers it had
    # sent (INTERNAL).
    assert row.failed and set(row.failed) <= {"UNAVAILABLE", "INTERNAL"}, row.failed


# The killed engine's worker restarts and loads vLLM again (REJOIN_WITHIN_SECONDS bounds it).
@pytest.mark.timeout(REJOIN_WITHIN_SECONDS + 300)
async def test_a_killed_engine_hands_its_streams_over_and_every_stream_completes(
    chaos_mesh: ScenarioMesh,
) -> None:
    row = await run(chaos_mesh, "engine_kill")
    assert row.ok == row.sent == 32
    assert sum(row.notes["moved_grpc_openai"]) > 0


async def test_envoy_restart_fails_only_in_flight_streams(chaos_mesh: ScenarioMesh) -> None:
    row = await run(chaos_mesh, "envoy_restart")
    assert set(row.failed) <= {"UNAVAILABLE"}


# Its own waits are bounded (REJOIN_WITHIN_SECONDS for the set to be healthy first, and again
# for the restarted worker): they, not the default test timeout, end it on a stalled machine.
@pytest.mark.timeout(2 * REJOIN_WITHIN_SECONDS + 120)
async def test_rolling_restart_of_a_worker_under_load_fails_nothing(
    chaos_mesh: ScenarioMesh,
) -> None:
    row = await run(chaos_mesh, "rolling_restart")
    assert row.ok == row.sent > 0
