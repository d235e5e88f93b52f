"""Failure behaviour that needs small limits: overload and a client that stops reading, the short
version of their `make chaos` scenarios (tests/harness/chaos.py) on a mesh of their own (1 gateway,
1 worker admitting 4 running + 4 waiting streams, a 5 s stream idle timeout)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import asdict

import pytest

from tests.harness.chaos import SMALL_MESH_ENV, SMALL_SCENARIOS, Row, ScenarioMesh
from tests.harness.meshes import environment, own_mesh

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def small_mesh() -> Iterator[ScenarioMesh]:
    with environment(SMALL_MESH_ENV), own_mesh(gateways=1, workers=1) as local_mesh:
        assert local_mesh is not None, "the small mesh did not come up (see the logs above)"
        yield ScenarioMesh(local_mesh)


async def run(mesh: ScenarioMesh, name: str) -> Row:
    with environment(SMALL_MESH_ENV):  # the scenarios read the limits the mesh was given
        row = await SMALL_SCENARIOS[name](mesh, True)
    print(json.dumps(asdict(row)))
    assert row.hung == 0, f"{row.hung} requests hung"
    assert not row.violations, row.violations
    return row


async def test_overload_is_refused_fast_with_resource_exhausted(small_mesh: ScenarioMesh) -> None:
    row = await run(small_mesh, "overload")
    assert set(row.failed) == {"RESOURCE_EXHAUSTED"}


async def test_stalled_streams_are_bounded_and_cut_by_the_idle_timeout(
    small_mesh: ScenarioMesh,
) -> None:
    row = await run(small_mesh, "stalled_client")
    assert row.notes["all_cut_after_s"] is not None
