"""A client that stops reading pushes back through HTTP/2 flow control: the gateway stops sending,
Envoy holds only about a window per stream, other clients are not held up, and every token still
arrives, in order, once the client reads again."""

from __future__ import annotations

import os
from collections.abc import Iterator

import psutil
import pytest

from tests.harness.slow_consumer import SlowConsumerProbe, slow_consumer_env
from tests.support import running_mesh
from tokenmesh.localmesh.mesh import LocalMesh, LocalMeshSettings
from tokenmesh.meshconfig.config import MeshSettings

pytestmark = pytest.mark.integration

STREAMS = 16
# With 20 logprobs per token, a stream of 1900 tokens carries ~650 KB: ten times the window.
MAX_TOKENS = 1900
# The mesh's default stream window; the tiny model's streams overflow it ten times over.
WINDOW = MeshSettings().stream_window_bytes
# Envoy's hops on the direct token path: caller <- edge, and edge <- worker; through the edge's
# stream relay one more, edge <- relay (an internal listener), with what the relay holds.
HOPS = 2


@pytest.fixture(scope="module")
def slow_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalMesh]:
    settings = LocalMeshSettings.on_free_ports(
        tmp_path_factory.mktemp("slow"), gateways=1, workers=1
    )
    with slow_consumer_env(), running_mesh(settings) as local_mesh:
        yield local_mesh


async def test_slow_reader_stops_the_senders_and_bounds_memory(slow_mesh: LocalMesh) -> None:
    # The engine takes ~30 s to make these streams on an idle 2-core machine; a loaded CI
    # machine gets ten times that before the probe gives up.
    result = await SlowConsumerProbe(slow_mesh).run(STREAMS, MAX_TOKENS, limit=300.0)
    print(result)
    # Nothing is lost or truncated: every stream arrives whole once it is read.
    assert result.complete
    # Another client, meanwhile, got its whole stream through the same gateway and worker.
    assert result.bystander_tokens == 64
    # The gateway waited on flow control instead of sending everything.
    assert result.gateway_sent_fraction < 0.5
    # Per stream and hop Envoy holds at most the window it granted upstream plus the buffer
    # towards the slow side, about two windows; three leaves room for framing and headers.
    hops = HOPS + (1 if slow_mesh.settings.mesh().relays else 0)
    assert result.envoy_growth_bytes < STREAMS * hops * 3 * WINDOW < result.output_bytes


def test_the_mesh_runs_off_the_engines_core(slow_mesh: LocalMesh) -> None:
    """A 1-worker mesh on a machine with more cores: Envoy, the gateway and the worker's own
    threads run on the cores its engine does not bind (the engine binds core 0)."""
    cores = os.cpu_count() or 1
    if cores < 2:
        pytest.skip(f"needs 2 cores to keep the mesh off the engine's, this machine has {cores}")
    mesh = set(range(1, cores))
    for name in ("envoy", "gateway-0", "worker-0"):
        process = psutil.Process(slow_mesh.pid(name))
        threads = {thread.id: os.sched_getaffinity(thread.id) for thread in process.threads()}
        assert all(allowed == mesh for allowed in threads.values()), (name, threads)
    # The engine's processes, all of them (the engine core that schedules and busy-waits, as
    # well as the runner vLLM binds), keep to the engine's core 0.
    worker = psutil.Process(slow_mesh.pid("worker-0"))
    engine = [child for child in worker.children(recursive=True) if "VLLM" in child.name()]
    assert {child.name() for child in engine} >= {"VLLM::EngineCore", "VLLM::Worker"}, engine
    placed = {(c.name(), t.id): os.sched_getaffinity(t.id) for c in engine for t in c.threads()}
    assert all(allowed == {0} for allowed in placed.values()), placed
