"""Adapters at run time (decision 0034). The worker's part, against a stand-in for vLLM's adapter
cache: an adapter added gets the next id (never a forgotten one's) and loads as any other,
counted; unloading drops it from the engine and the next request loads it again (or is refused
when loading on use is off); forgetting makes it NOT_FOUND; what cannot be added is refused
naming the field and the limit. The control plane's part, over real gRPC servers (two stand-in
workers serving the worker's WorkerAdmin): the key, each worker's result, a pool's cluster,
and the remembered loads and forgets reaching a worker that joins later.
tests/integration/test_adapters.py runs it on a real mesh through the edge."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc import aio
from prometheus_client import CollectorRegistry

from tests.unit.test_adapters import AdapterCache, adapter_dir, counted
from tokenmesh.common.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
)
from tokenmesh.common.interceptors import ErrorMappingInterceptor
from tokenmesh.controlplane.admin import AdapterAdminServicer, AdapterFleet, AdminKeys
from tokenmesh.controlplane.endpoints import Endpoint
from tokenmesh.controlplane.ops import GrpcWorkerProbe
from tokenmesh.controlplane.snapshots import SnapshotCache
from tokenmesh.v1 import admin_pb2, admin_pb2_grpc, inference_pb2, inference_pb2_grpc
from tokenmesh.worker.adapters import AdapterMetrics, Adapters
from tokenmesh.worker.admin import WorkerAdminServicer
from tokenmesh.worker.config import WorkerSettings
from tokenmesh.worker.engine_args import engine_args

LOADS = "tokenmesh_worker_adapter_loads_total"


def lora_on(adapters: Adapters, rank: int = 16) -> Adapters:
    adapters.max_rank = rank  # as the engine sets it once started with LoRA on
    return adapters


async def test_an_adapter_added_at_run_time_gets_the_next_id_and_loads_counted(
    tmp_path: Path,
) -> None:
    registry = CollectorRegistry()
    adapters = lora_on(
        Adapters("base", {"a": adapter_dir(tmp_path, "a")}, AdapterMetrics.register(registry))
    )
    engine = AdapterCache(capacity=1)
    await adapters.load(engine, 1)
    request, new = await adapters.add(engine, "live", adapter_dir(tmp_path, "live"))
    assert new and request.lora_int_id == 2 and adapters.names == ("a", "live")
    # Loaded now, in place of the one the engine held, and counted as a load on use is.
    assert await adapters.held(engine) == ("live",)
    assert counted(registry, LOADS, "live") == 1
    assert counted(registry, "tokenmesh_worker_adapter_evictions_total", "a") == 1
    # Again with the same directory: nothing new, made held if it was not.
    await adapters.unload(engine, "live")
    again, new = await adapters.add(engine, "live", tmp_path / "live")
    assert not new and again is request and await adapters.held(engine) == ("live",)
    assert counted(registry, LOADS, "live") == 2


async def test_an_unloaded_adapter_is_loaded_again_by_its_next_request(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    adapters = lora_on(
        Adapters("base", {"a": adapter_dir(tmp_path, "a")}, AdapterMetrics.register(registry))
    )
    engine = AdapterCache(capacity=2)
    await adapters.load(engine, 2)
    assert await adapters.unload(engine, "a") is True
    assert await adapters.held(engine) == () and adapters.names == ("a",)
    assert await adapters.unload(engine, "a") is False  # not held: nothing to drop
    await adapters.ensure(engine, "a")
    assert await adapters.held(engine) == ("a",) and counted(registry, LOADS, "a") == 2


async def test_with_loading_on_use_off_an_unheld_adapter_is_refused_naming_the_admin_api(
    tmp_path: Path,
) -> None:
    adapters = lora_on(Adapters("base", {"a": adapter_dir(tmp_path, "a")}, load_on_use=False))
    engine = AdapterCache(capacity=1)
    await adapters.load(engine, 1)  # at start, as ever
    assert await adapters.ensure(engine, "a") is not None
    await adapters.unload(engine, "a")
    with pytest.raises(FailedPrecondition) as refused:
        await adapters.ensure(engine, "a")
    assert "'a'" in refused.value.message and "AdapterAdmin/LoadAdapter" in refused.value.message
    assert refused.value.trailing_metadata == ()  # no retry hint: the operator's to load
    assert engine.adds == 1
    assert WorkerSettings().adapter_load_on_use is True


async def test_a_forgotten_adapter_is_not_found_and_its_id_is_never_reused(
    tmp_path: Path,
) -> None:
    adapters = lora_on(Adapters("base", {"a": adapter_dir(tmp_path, "a")}))
    engine = AdapterCache(capacity=2)
    await adapters.load(engine, 2)
    await adapters.add(engine, "b", adapter_dir(tmp_path, "b"))
    assert await adapters.forget(engine, "b") is True
    assert adapters.names == ("a",) and await adapters.held(engine) == ("a",)
    with pytest.raises(NotFound, match="'b' is not served here; served: base, a"):
        adapters.for_model("b")
    with pytest.raises(NotFound, match="name: adapter 'b' is not served here; adapters: a"):
        await adapters.unload(engine, "b")
    # vLLM caches adapters by id: a new one never takes a forgotten one's.
    request, _ = await adapters.add(engine, "b", tmp_path / "b")
    assert request.lora_int_id == 3


async def test_what_cannot_be_added_is_refused_naming_the_field_and_limit(
    tmp_path: Path,
) -> None:
    engine = AdapterCache(capacity=1)
    off = Adapters("base", {})
    with pytest.raises(FailedPrecondition, match='"enable_lora": true, "max_lora_rank"'):
        await off.add(engine, "x", adapter_dir(tmp_path, "x"))
    adapters = lora_on(Adapters("base", {"a": adapter_dir(tmp_path, "a")}), rank=8)
    cases: list[tuple[str, Path, type[Exception], str]] = [
        ("base", tmp_path / "x", AlreadyExists, "the model's own name"),
        ("a", tmp_path / "x", AlreadyExists, f"already served from {tmp_path / 'a'}"),
        ("y", tmp_path / "missing", InvalidArgument, "directory: .*missing has no adapter_config"),
        ("y", Path("relative"), InvalidArgument, "directory: relative is not an absolute path"),
        (
            "y",
            adapter_dir(tmp_path, "big", 16),
            InvalidArgument,
            "16 is over .*_rank 8",
        ),
        (" y", tmp_path / "x", InvalidArgument, "name: ' y' is not an adapter name"),
    ]
    for name, directory, error, message in cases:
        with pytest.raises(error, match=message):
            await adapters.add(engine, name, directory)
    assert adapters.names == ("a",) and engine.adds == 0


async def test_an_adapter_that_fails_to_load_when_added_is_not_served(tmp_path: Path) -> None:
    adapters = lora_on(Adapters("base", {}))
    engine = AdapterCache(capacity=1, broken="bad")
    with pytest.raises(Exception, match="'bad' could not be loaded"):
        await adapters.add(engine, "bad", adapter_dir(tmp_path, "bad"))
    assert adapters.names == ()


def test_a_worker_with_lora_on_and_no_adapters_starts_for_the_admin_api() -> None:
    settings = WorkerSettings(engine_args={"enable_lora": True, "max_lora_rank": 32})
    arguments = engine_args(settings)
    assert arguments.enable_lora is True and arguments.max_lora_rank == 32


# The control plane's part.


class StandInEngine:
    """The worker's engine as WorkerAdmin sees it, over Adapters and the stand-in cache."""

    def __init__(self, adapters: Adapters) -> None:
        self.adapters, self.cache = adapters, AdapterCache(capacity=1)

    async def add_adapter(self, name: str, directory: Path) -> tuple[int, bool]:
        request, new = await self.adapters.add(self.cache, name, directory)
        return request.lora_int_id, new

    async def unload_adapter(self, name: str) -> bool:
        return await self.adapters.unload(self.cache, name)

    async def forget_adapter(self, name: str) -> bool:
        return await self.adapters.forget(self.cache, name)

    def get(self) -> StandInEngine:  # the EngineSlot
        return self


class StandInStats(inference_pb2_grpc.InferenceServiceServicer):
    def __init__(self, engine: StandInEngine) -> None:
        self._engine = engine

    async def GetEngineStats(self, request: Any, context: Any) -> inference_pb2.EngineStats:
        adapters = self._engine.adapters
        return inference_pb2.EngineStats(
            model="base",
            adapters=adapters.names,
            held_adapters=await adapters.held(self._engine.cache),
        )


@dataclass
class Served:
    server: aio.Server
    address: str
    engine: StandInEngine


async def serve_worker(adapters: Adapters, frontends: int = 1) -> Served:
    engine = StandInEngine(adapters)
    server = aio.server(interceptors=[ErrorMappingInterceptor()])
    settings = WorkerSettings(frontends=frontends)
    admin_pb2_grpc.add_WorkerAdminServicer_to_server(
        WorkerAdminServicer(engine, settings),  # type: ignore[arg-type]
        server,
    )
    inference_pb2_grpc.add_InferenceServiceServicer_to_server(StandInStats(engine), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return Served(server, f"127.0.0.1:{port}", engine)


@dataclass
class ControlPlane:
    stub: admin_pb2_grpc.AdapterAdminStub
    cache: SnapshotCache
    fleet: AdapterFleet
    workers: list[Served]
    root: Path

    def discover(self, clusters: dict[str, list[Served]]) -> None:
        self.cache.update(
            {
                name: [Endpoint("127.0.0.1", int(w.address.rsplit(":", 1)[1])) for w in served]
                for name, served in clusters.items()
            }
        )


KEY = "s3cret-admin-key"
AUTH = (("authorization", f"Bearer {KEY}"),)


async def admin_server(keys: AdminKeys, fleet: AdapterFleet) -> tuple[aio.Server, int]:
    server = aio.server(interceptors=[ErrorMappingInterceptor()])
    admin_pb2_grpc.add_AdapterAdminServicer_to_server(AdapterAdminServicer(keys, fleet), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


@pytest.fixture
async def control_plane(tmp_path: Path) -> AsyncIterator[ControlPlane]:
    keys = tmp_path / "admin-keys"
    keys.write_text(f"# the operators' key\n\n{KEY}\n")
    workers = [await serve_worker(lora_on(Adapters("base", {}))) for _ in range(2)]
    cache = SnapshotCache()
    probe = GrpcWorkerProbe(5.0, 1 << 20)
    fleet = AdapterFleet(cache, probe, 5.0)
    server, port = await admin_server(AdminKeys(keys), fleet)
    channel = aio.insecure_channel(f"127.0.0.1:{port}")
    plane = ControlPlane(admin_pb2_grpc.AdapterAdminStub(channel), cache, fleet, workers, tmp_path)
    plane.discover({"worker": workers})
    try:
        yield plane
    finally:
        await channel.close()
        await server.stop(None)
        await probe.close()
        for worker in plane.workers:
            await worker.server.stop(None)


async def test_a_load_reaches_every_worker_of_the_pool_each_reported(
    control_plane: ControlPlane,
) -> None:
    directory = str(adapter_dir(control_plane.root, "live"))
    reply = await control_plane.stub.LoadAdapter(
        admin_pb2.AdapterAdminRequest(name="live", directory=directory), metadata=AUTH
    )
    assert reply.cluster == "worker"
    assert sorted((w.address, w.code, w.held) for w in reply.workers) == sorted(
        (w.address, "OK", True) for w in control_plane.workers
    )
    for worker in control_plane.workers:
        assert worker.engine.adapters.names == ("live",)
    unloaded = await control_plane.stub.UnloadAdapter(
        admin_pb2.AdapterAdminRequest(name="live"), metadata=AUTH
    )
    assert [w.code for w in unloaded.workers] == ["OK", "OK"]
    listed = await control_plane.stub.ListAdapters(admin_pb2.ListAdaptersRequest(), metadata=AUTH)
    assert [(w.adapters, w.held_adapters) for w in listed.workers] == [(["live"], [])] * 2
    assert [(r.name, r.directory, r.forgotten) for r in listed.remembered] == [
        ("live", directory, False)
    ]
    await control_plane.stub.ForgetAdapter(
        admin_pb2.AdapterAdminRequest(name="live"), metadata=AUTH
    )
    assert [w.engine.adapters.names for w in control_plane.workers] == [(), ()]
    # Forgotten everywhere: every worker says NOT_FOUND, so the call does.
    with pytest.raises(aio.AioRpcError) as gone:
        await control_plane.stub.UnloadAdapter(
            admin_pb2.AdapterAdminRequest(name="live"), metadata=AUTH
        )
    assert gone.value.code() == grpc.StatusCode.NOT_FOUND
    assert "2 of 2 workers failed" in (gone.value.details() or "")


async def test_a_refusal_every_worker_gives_is_the_calls_status_naming_the_worker(
    control_plane: ControlPlane,
) -> None:
    big = str(adapter_dir(control_plane.root, "big", rank=64))
    with pytest.raises(aio.AioRpcError) as refused:
        await control_plane.stub.LoadAdapter(
            admin_pb2.AdapterAdminRequest(name="big", directory=big), metadata=AUTH
        )
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = refused.value.details() or ""
    assert "rank 64 is over the engine's max_lora_rank 16" in details, details
    assert (
        control_plane.workers[0].address in details or control_plane.workers[1].address in details
    )
    # Not remembered: nothing to apply to later workers.
    listed = await control_plane.stub.ListAdapters(admin_pb2.ListAdaptersRequest(), metadata=AUTH)
    assert not listed.remembered


async def test_a_pool_names_its_own_cluster_and_an_empty_one_is_unavailable(
    control_plane: ControlPlane,
) -> None:
    pooled = await serve_worker(lora_on(Adapters("base", {})))
    control_plane.workers.append(pooled)
    control_plane.discover({"worker": control_plane.workers[:2], "worker-code": [pooled]})
    directory = str(adapter_dir(control_plane.root, "live"))
    reply = await control_plane.stub.LoadAdapter(
        admin_pb2.AdapterAdminRequest(name="live", directory=directory, pool="code"),
        metadata=AUTH,
    )
    assert reply.cluster == "worker-code" and [w.address for w in reply.workers] == [pooled.address]
    assert [w.engine.adapters.names for w in control_plane.workers] == [(), (), ("live",)]
    with pytest.raises(aio.AioRpcError) as empty:
        await control_plane.stub.LoadAdapter(
            admin_pb2.AdapterAdminRequest(name="live", directory=directory, pool="chat"),
            metadata=AUTH,
        )
    assert empty.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "'worker-chat'" in (empty.value.details() or "")
    with pytest.raises(aio.AioRpcError) as bad:
        await control_plane.stub.ListAdapters(
            admin_pb2.ListAdaptersRequest(pool="No Pool"), metadata=AUTH
        )
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (bad.value.details() or "").startswith("pool:")


async def test_a_worker_that_joins_later_gets_the_remembered_loads_and_forgets(
    control_plane: ControlPlane,
) -> None:
    old = str(adapter_dir(control_plane.root, "old"))
    for name, directory in (("old", old), ("live", str(adapter_dir(control_plane.root, "live")))):
        await control_plane.stub.LoadAdapter(
            admin_pb2.AdapterAdminRequest(name=name, directory=directory), metadata=AUTH
        )
    await control_plane.stub.ForgetAdapter(admin_pb2.AdapterAdminRequest(name="old"), metadata=AUTH)
    # A worker serving "old" from its settings joins (or one restarts without "live").
    joined = await serve_worker(lora_on(Adapters("base", {"old": Path(old)})))
    control_plane.workers.append(joined)
    control_plane.discover({"worker": control_plane.workers})
    await control_plane.fleet.reconcile()
    assert joined.engine.adapters.names == ("live",)
    assert await joined.engine.adapters.held(joined.engine.cache) == ("live",)
    # The others had both already: nothing asked of them again.
    assert [w.engine.cache.adds for w in control_plane.workers] == [2, 2, 1]


async def test_the_admin_api_wants_a_key_and_is_off_without_a_keys_file(
    control_plane: ControlPlane,
) -> None:
    request = admin_pb2.ListAdaptersRequest()
    for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", KEY),)):
        with pytest.raises(aio.AioRpcError) as refused:
            await control_plane.stub.ListAdapters(request, metadata=metadata)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "authorization: Bearer" in (refused.value.details() or "")
    # Rotated in place: the new key at once, the old one no more.
    (control_plane.root / "admin-keys").write_text("another-key\n")
    await control_plane.stub.ListAdapters(
        request, metadata=(("authorization", "Bearer another-key"),)
    )
    with pytest.raises(aio.AioRpcError) as old:
        await control_plane.stub.ListAdapters(request, metadata=AUTH)
    assert old.value.code() == grpc.StatusCode.UNAUTHENTICATED
    server, port = await admin_server(AdminKeys(None), control_plane.fleet)
    try:
        async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(aio.AioRpcError) as off:
                await admin_pb2_grpc.AdapterAdminStub(channel).LoadAdapter(
                    admin_pb2.AdapterAdminRequest(name="x", directory="/x"), metadata=AUTH
                )
    finally:
        await server.stop(None)
    assert off.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "off: set TOKENMESH_CONTROLPLANE_ADMIN_KEYS_FILE" in (off.value.details() or "")


async def test_a_worker_with_several_front_ends_refuses_adapters_at_run_time(
    tmp_path: Path,
) -> None:
    worker = await serve_worker(lora_on(Adapters("base", {})), frontends=2)
    try:
        async with aio.insecure_channel(worker.address) as channel:
            with pytest.raises(aio.AioRpcError) as refused:
                await admin_pb2_grpc.WorkerAdminStub(channel).LoadAdapter(
                    admin_pb2.WorkerAdapterRequest(name="x", directory=str(tmp_path))
                )
    finally:
        await worker.server.stop(None)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "frontends=2" in (refused.value.details() or "")


async def test_a_discovery_change_reconciles_at_once_and_shutdown_ends_it(
    control_plane: ControlPlane,
) -> None:
    directory = str(adapter_dir(control_plane.root, "live"))
    await control_plane.stub.LoadAdapter(
        admin_pb2.AdapterAdminRequest(name="live", directory=directory), metadata=AUTH
    )
    # The interval is an hour: only the discovery change can bring it.
    reconciling = asyncio.create_task(control_plane.fleet.keep_reconciled(3600))
    await asyncio.sleep(0.05)
    joined = await serve_worker(lora_on(Adapters("base", {})))
    control_plane.workers.append(joined)
    control_plane.discover({"worker": control_plane.workers})
    for _ in range(250):  # 5 s at most
        if joined.engine.adapters.names == ("live",):
            break
        await asyncio.sleep(0.02)
    assert joined.engine.adapters.names == ("live",)
    control_plane.cache.close()
    async with asyncio.timeout(5):
        await reconciling
