"""The whole local mesh as `make up` runs it, shared by every module that needs it (starting it
takes about a minute), and stopped as soon as the last test using it is done."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support import running_stack
from tokenmesh.localstack.stack import Stack, StackSettings

MESH_KEY = pytest.StashKey[Stack]()


@pytest.fixture(scope="session")
def mesh(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """supervisord, control plane, Envoy, 2 gateways, 2 workers, the reranker, and Prometheus
    when its binary is on PATH, on free ports with their own run directory."""
    settings = StackSettings.on_free_ports(
        tmp_path_factory.mktemp("mesh"), gateways=2, workers=2, ready_timeout_seconds=600
    )
    with running_stack(settings) as stack:
        request.config.stash[MESH_KEY] = stack
        yield stack


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
