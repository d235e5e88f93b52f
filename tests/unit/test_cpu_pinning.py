"""CPU affinity: the setting's core lists, refused cores, and threads moved onto the cores."""

from __future__ import annotations

import os
import threading

import pytest
from pydantic import ValidationError

from tokenmesh.common.cpu_pinning import parse_cores, pin_threads
from tokenmesh.gateway.config import GatewaySettings
from tokenmesh.localmesh.mesh import LocalMesh, LocalMeshSettings


@pytest.mark.parametrize(
    ("text", "cores"),
    [("", set()), ("1", {1}), ("0-2", {0, 1, 2}), ("0, 2-3", {0, 2, 3}), ("3,3", {3})],
)
def test_core_lists(text: str, cores: set[int]) -> None:
    assert parse_cores(text) == cores


@pytest.mark.parametrize("text", ["x", "3-1", "-1", "1-"])
def test_a_bad_core_list_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_cores(text)


def test_a_core_the_machine_lacks_is_refused_naming_the_setting() -> None:
    missing = max(os.sched_getaffinity(0)) + 1
    with pytest.raises(ValidationError) as error:
        GatewaySettings(cpu_affinity=str(missing))
    assert "cpu_affinity" in str(error.value) and f"[{missing}]" in str(error.value)


def test_every_thread_and_the_threads_started_later_keep_to_the_cores() -> None:
    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        pytest.skip(f"needs 2 cores to move threads between, this machine allows {allowed}")
    target = frozenset({max(allowed)})
    started, stop = threading.Event(), threading.Event()
    seen: dict[str, set[int]] = {}

    def before() -> None:
        started.set()
        stop.wait(10)
        seen["before"] = os.sched_getaffinity(0)

    early = threading.Thread(target=before)
    early.start()
    started.wait(10)
    try:
        pin_threads(target)
        later = threading.Thread(target=lambda: seen.setdefault("later", os.sched_getaffinity(0)))
        later.start()
        later.join(10)
        stop.set()
        early.join(10)
        assert seen == {"before": set(target), "later": set(target)}
        assert os.sched_getaffinity(0) == target
    finally:
        pin_threads(frozenset(allowed))


def test_the_local_mesh_runs_beside_its_engines_not_on_their_cores(tmp_path) -> None:
    local_mesh = LocalMesh(
        LocalMeshSettings.on_free_ports(tmp_path, gateways=1, workers=1), root=tmp_path
    )
    assert local_mesh.mesh_cores(workers=1, cores=2) == "1"
    assert local_mesh.mesh_cores(workers=2, cores=8) == "2-7"
    assert local_mesh.mesh_cores(workers=2, cores=2) == ""  # no free core: no pinning
    off = LocalMesh(
        LocalMeshSettings.on_free_ports(tmp_path, gateways=1, workers=1, pin_mesh_cores=False),
        root=tmp_path,
    )
    assert off.mesh_cores(workers=1, cores=2) == ""
