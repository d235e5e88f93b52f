"""Failure behaviour that needs small limits: overload and a client that stops reading, the short
version of their `make chaos` scenarios (tests/harness/chaos.py) on a mesh of their own (1 gateway,
1 worker admitting 4 running + 4 waiting streams, a 5 s stream idle timeout); and, the suite's
one-worker mesh, where such a mesh's processes run."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import asdict

import psutil
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


def test_the_mesh_runs_off_the_engines_core(small_mesh: ScenarioMesh) -> None:
    """A 1-worker mesh on a machine with more cores: Envoy, the gateway and the worker's own
    threads run on the cores its engine does not bind (the engine binds core 0)."""
    cores = os.cpu_count() or 1
    if cores < 2:
        pytest.skip(f"needs 2 cores to keep the mesh off the engine's, this machine has {cores}")
    mesh = set(range(1, cores))
    for name in ("envoy", "gateway-0", "worker-0"):
        process = psutil.Process(small_mesh.local_mesh.pid(name))
        threads = {thread.id: os.sched_getaffinity(thread.id) for thread in process.threads()}
        assert all(allowed == mesh for allowed in threads.values()), (name, threads)
    # The engine's processes, all of them (the engine core that schedules and busy-waits, as
    # well as the runner vLLM binds), keep to the engine's core 0.
    worker = psutil.Process(small_mesh.local_mesh.pid("worker-0"))
    engine = [child for child in worker.children(recursive=True) if "VLLM" in child.name()]
    assert {child.name() for child in engine} >= {"VLLM::EngineCore", "VLLM::Worker"}, engine
    placed = {(c.name(), t.id): os.sched_getaffinity(t.id) for c in engine for t in c.threads()}
    assert all(allowed == {0} for allowed in placed.values()), placed


async def test_overload_is_refused_fast_with_resource_exhausted(small_mesh: ScenarioMesh) -> None:
    row = await run(small_mesh, "overload")
    assert set(row.failed) == {"RESOURCE_EXHAUSTED"}


async def test_stalled_streams_are_bounded_and_cut_by_the_idle_timeout(
    small_mesh: ScenarioMesh,
) -> None:
    row = await run(small_mesh, "stalled_client")
    assert row.notes["all_cut_after_s"] is not None
