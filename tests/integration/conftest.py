"""The whole local mesh as `make up` runs it, shared by every module that needs it (starting it
takes about a minute), and stopped as soon as the last test using it is done."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support import running_mesh
from tokenmesh.localmesh.mesh import LocalMesh, LocalMeshSettings

MESH_KEY = pytest.StashKey[LocalMesh]()


@pytest.fixture(scope="session")
def mesh(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalMesh]:
    """supervisord, control plane, Envoy, 2 gateways, 2 workers, the reranker, and Prometheus
    when its binary is on PATH, on free ports with their own run directory."""
    settings = LocalMeshSettings.on_free_ports(
        tmp_path_factory.mktemp("mesh"), gateways=2, workers=2, ready_timeout_seconds=600
    )
    with running_mesh(settings) as local_mesh:
        request.config.stash[MESH_KEY] = local_mesh
        yield local_mesh


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Stop the mesh right after the last test that uses it: its two vLLM engines, Envoy health
    checks and Prometheus scrapes would otherwise slow every later test on a small machine."""
    local_mesh = item.config.stash.get(MESH_KEY, None)
    if local_mesh is None or "mesh" not in getattr(item, "fixturenames", ()):
        return
    later = item.session.items[item.session.items.index(item) + 1 :]
    if not any("mesh" in getattr(other, "fixturenames", ()) for other in later):
        local_mesh.down()
        del item.config.stash[MESH_KEY]
