"""Local meshes for the tests and the load-test tools: one started on free ports, one already
running, a second Envoy in front of a mesh, and settings handed to a mesh through its
environment."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.support import ENVOY, ROOT
from tokenmesh.common.processes import stop_process
from tokenmesh.localmesh.mesh import LocalMesh, LocalMeshSettings, envoy_hosts
from tokenmesh.localmesh.probes import free_port
from tokenmesh.localmesh.relay_module import SEARCH_PATH, build_relay_module
from tokenmesh.meshconfig.__main__ import render_yaml
from tokenmesh.meshconfig.config import MeshSettings


def attached(run_dir: Path) -> LocalMesh:
    """The running mesh whose run directory is run_dir (its saved settings, else the
    defaults: `make up`'s)."""
    probe = LocalMesh(LocalMeshSettings(run_dir=run_dir), root=ROOT)
    if probe.settings_path.exists():
        return LocalMesh(
            LocalMeshSettings.model_validate_json(probe.settings_path.read_text()), root=ROOT
        )
    return probe


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """os.environ with values inside the block (a mesh started there passes them on)."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def own_mesh(gateways: int, workers: int) -> Iterator[LocalMesh | None]:
    """A mesh on free ports with its own run directory, stopped at the end (None if it did not
    come up)."""
    with tempfile.TemporaryDirectory(prefix="mesh-") as run_dir:
        settings = LocalMeshSettings.on_free_ports(
            Path(run_dir), gateways=gateways, workers=workers
        )
        local_mesh = LocalMesh(settings, root=ROOT)
        try:
            yield local_mesh if local_mesh.up() == 0 else None
        finally:
            local_mesh.down()


@contextlib.contextmanager
def second_envoy(
    local_mesh: LocalMesh, run_dir: Path, **overrides: Any
) -> Iterator[tuple[MeshSettings, int]]:
    """Another Envoy in front of the mesh's gateways and workers (their endpoints from the
    mesh's control plane), rendered with `overrides` (e.g. direct_token_path=True) and run on
    the mesh's cores like the mesh's own, its config and log in run_dir: its settings and
    process id, once it has a healthy gateway and worker."""
    ports = [free_port() for _ in range(4)]
    mesh = local_mesh.settings.mesh().model_dump()
    settings = MeshSettings(
        **{
            **mesh,
            "edge_port": ports[0],
            "admin_port": ports[1],
            "worker_listener_port": ports[2],
            "reranker_listener_port": ports[3],
            "node_id": f"tokenmesh-envoy-{ports[0]}",
            **overrides,
        }
    )
    config = run_dir / f"envoy-{ports[0]}.yaml"
    config.write_text(render_yaml(settings))
    cores = local_mesh.mesh_cores(local_mesh.settings.worker_count(), os.cpu_count() or 1)
    pinned = ["taskset", "-c", cores] if cores and shutil.which("taskset") else []
    envoy = ENVOY or "envoy"
    # Its access log (stdout) and errors beside its config.
    log = (run_dir / f"envoy-{ports[0]}.log").open("w")
    # With stream_relay, the relay built where this Envoy looks for it.
    modules = run_dir / "envoy-modules"
    if settings.relays:
        build_relay_module(local_mesh.files.relay_source, modules)
    # A session of its own: scheduled apart from the benchmark or test that started it
    # (Linux's autogroups are per session). Not alike the mesh's own Envoy, which shares
    # supervisord's group with the mesh's other programs (decision 0038).
    process = subprocess.Popen(
        [*pinned, envoy, "-c", str(config), "--base-id", str(ports[0]), "--log-level", "warn"],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, SEARCH_PATH: str(modules)},
    )
    try:
        deadline = time.monotonic() + 60
        while not all(
            any(ok for _, ok in envoy_hosts(settings.admin_port).get(cluster, []))
            for cluster in ("gateway", "worker")
        ):
            if process.poll() is not None:
                raise SystemExit(f"the second Envoy exited ({process.returncode})")
            if time.monotonic() > deadline:
                raise SystemExit("the second Envoy found no healthy gateway and worker in 60 s")
            time.sleep(0.2)
        yield settings, process.pid
    finally:
        stop_process(process, 30)
        log.close()
