"""The whole local mesh as `make up` runs it, shared by every module that needs it (starting it
takes about a minute), and stopped as soon as the last test using it is done."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import free_port
from tokenmesh.localstack.stack import Stack, StackSettings

MESH_KEY = pytest.StashKey[Stack]()


@pytest.fixture(scope="session")
def mesh(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """supervisord, control plane, Envoy, 2 gateways, 2 workers, the reranker, and Prometheus
    when its binary is on PATH, on free ports with their own run directory."""
    ports = {
        name: free_port()
        for name in (
            "gateway_metrics_port", "worker_metrics_port", "reranker_port",
            "reranker_metrics_port", "controlplane_port", "controlplane_metrics_port",
            "edge_port", "envoy_admin_port", "worker_listener_port", "reranker_listener_port",
            "prometheus_port",
        )
    }  # fmt: skip
    # Replicas take consecutive ports from these bases.
    ports["gateway_port"], ports["worker_port"] = free_port(), free_port()
    settings = StackSettings(
        run_dir=tmp_path_factory.mktemp("mesh"),
        gateways=2,
        workers=2,
        envoy_base_id=random.randint(10_000, 60_000),
        ready_timeout_seconds=600,
        **ports,
    )
    stack = Stack(settings, root=Path(__file__).resolve().parents[2])
    request.config.stash[MESH_KEY] = stack
    try:
        assert stack.up() == 0, "the mesh did not come up (see the logs above)"
        yield stack
    finally:
        stack.down()


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Stop the mesh right after the last test that uses it: its two vLLM engines, Envoy health
    checks and Prometheus scrapes would otherwise slow every later test on a small machine."""
    stack = item.config.stash.get(MESH_KEY, None)
    if stack is None or "mesh" not in getattr(item, "fixturenames", ()):
        return
    later = item.session.items[item.session.items.index(item) + 1 :]
    if not any("mesh" in getattr(other, "fixturenames", ()) for other in later):
        stack.down()
        del item.config.stash[MESH_KEY]
