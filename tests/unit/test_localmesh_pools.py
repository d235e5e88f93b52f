"""The local mesh's worker pools: each pool's workers serve its model in the cluster of its
pool (the static discovery file), Envoy and the gateways name the same pools, and `make up`
serves the tiny model's generated adapter on a pool of its own unless it cannot."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from tokenmesh.common.registration import instance_for
from tokenmesh.localmesh import settings as localmesh_settings
from tokenmesh.localmesh.configs import endpoints
from tokenmesh.localmesh.layout import MeshFiles, Tools
from tokenmesh.localmesh.programs import ProcessTable
from tokenmesh.localmesh.settings import GIB, LocalMeshSettings, WorkerPool
from tokenmesh.worker.config import WorkerSettings

TOOLS = Tools(python="python", consul=None, prometheus=None, taskset=False, cores=2)


def table(settings: LocalMeshSettings, root: Path) -> ProcessTable:
    resolved, _ = settings.resolved()
    return ProcessTable(resolved, MeshFiles.of(resolved, root), TOOLS)


def test_each_pools_workers_serve_its_model_in_its_own_cluster(tmp_path: Path) -> None:
    adapter = tmp_path / "x"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 8}')
    settings = LocalMeshSettings.on_free_ports(
        tmp_path,
        workers=2,
        pools={"b": WorkerPool(model="models/other", lora_modules={"x": str(adapter)})},
    )
    processes = table(settings, tmp_path)
    workers = [p for p in processes.programs() if p.service == "worker"]
    assert [(p.name, p.pool, p.cluster) for p in workers] == [
        ("worker-0", "", "worker"),
        ("worker-1", "", "worker"),
        ("worker-2", "b", "worker-b"),
    ]
    other = workers[2].settings
    assert other is not None
    assert other.model == "models/other" and other.model_name == "other"  # type: ignore[attr-defined]
    assert other.lora_modules == {"x": adapter}  # type: ignore[attr-defined]
    # Three engines on two cores: each binds one, two share the first.
    binds = [p.settings.cpu_threads_bind for p in workers]  # type: ignore[union-attr]
    assert binds == ["0", "1", "0"]
    clusters = endpoints(processes.programs())["clusters"]
    assert clusters["worker"] == [workers[0].address, workers[1].address]
    assert clusters["worker-b"] == [workers[2].address]
    gateways = [p.settings for p in processes.programs() if p.service == "gateway"]
    assert all(g.worker_pools == ("b",) for g in gateways)  # type: ignore[union-attr]
    assert settings.resolved()[0].mesh().worker_pools == ("b",)


def adapter_files(root: Path) -> str:
    (root / "tiny-llama").mkdir()
    (root / "tiny-llama-lora").mkdir()
    (root / "tiny-llama-lora" / "adapter_config.json").write_text("{}")
    return str(root / "tiny-llama")


def test_make_up_serves_the_generated_adapter_on_a_pool_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    memory = SimpleNamespace(available=64 * GIB)
    monkeypatch.setattr(localmesh_settings.psutil, "virtual_memory", lambda: memory)
    model = adapter_files(tmp_path)
    resolved, why_not = LocalMeshSettings(model=model).resolved()
    assert why_not == "" and resolved.workers == 2 and not resolved.adapter_pool
    lora = resolved.pools["lora"]
    assert lora.model == model and lora.workers == 1
    assert lora.lora_modules == {"tiny-llama-lora": str(tmp_path / "tiny-llama-lora")}
    # Resolved once: the same again (make status and down read the saved settings).
    assert resolved.resolved()[0] == resolved
    # Not when the machine has no room for a third engine, saying so.
    memory.available = 11 * GIB
    resolved, why_not = LocalMeshSettings(model=model).resolved()
    assert "lora" not in resolved.pools and "12 GiB" in why_not
    memory.available = 64 * GIB
    # Nor when the user set adapters, or for tests' and benchmarks' meshes.
    taken = LocalMeshSettings(model=model, lora_modules={"a": "b"}).resolved()
    assert "lora" not in taken[0].pools and "lora_modules" in taken[1]
    private = LocalMeshSettings.on_free_ports(tmp_path / "run", model=model).resolved()
    assert private[0].pools == {}
    # Nor for another model.
    other = LocalMeshSettings(model=str(tmp_path / "other")).resolved()
    assert other[0].pools == {} and "no generated adapter" in other[1]


def test_with_consul_a_pools_workers_register_as_its_cluster(tmp_path: Path) -> None:
    settings = LocalMeshSettings.on_free_ports(
        tmp_path, workers=1, pools={"b": WorkerPool(model="models/other")}
    )
    resolved, _ = settings.resolved()
    tools = Tools(python="python", consul="consul", prometheus=None, taskset=False, cores=2)
    programs = ProcessTable(resolved, MeshFiles.of(resolved, tmp_path), tools).programs()
    controlplane = next(p.settings for p in programs if p.name == "controlplane")
    assert controlplane.consul_services[-1] == "worker-b"  # type: ignore[union-attr]
    pools = [p.settings.pool for p in programs if p.service == "worker"]  # type: ignore[union-attr]
    assert pools == ["", "b"]
    # The instance each registers: its pool's cluster, tagged with its pool.
    worker = instance_for(
        WorkerSettings(pool="b"), "worker", 50061, extra={"pool": "b"}, name="worker-b"
    )
    assert worker.name == "worker-b" and "pool=b" in worker.tags and "role=worker" in worker.tags
    with pytest.raises(ValueError, match="pool name"):
        WorkerSettings(pool="B")
