"""LoRA adapters by name: the worker's settings, the engine arguments they need (through vLLM's
own parser), the adapter a request's `model` picks and the NOT_FOUND naming what is served;
which adapters a worker loads when, and what it counts of that (against a stand-in for vLLM's
adapter cache: its add_lora, list_loras and least-recently-used eviction); the gateway's
catalog learning them from a worker (a gRPC server in the test), and the key an adapter's
requests get. tests/integration/test_adapters.py runs them on real engines."""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc import aio
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from tokenmesh.common.channels import Dependency
from tokenmesh.common.errors import DependencyError, Internal, InvalidArgument, NotFound
from tokenmesh.common.pools import POOL_HEADER
from tokenmesh.gateway.core.catalog import (
    MISS_REFRESH_SECONDS,
    MODEL_NAME_TTL_SECONDS,
    ModelCard,
    ModelCatalog,
    ModelDenied,
    ModelNotFound,
    Served,
)
from tokenmesh.gateway.core.prefix_key import affinity_key
from tokenmesh.gateway.core.tenancy.auth import KeysFile
from tokenmesh.localmesh.probes import free_port
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc
from tokenmesh.worker.adapters import AdapterMetrics, Adapters, lora_engine_args
from tokenmesh.worker.config import WorkerSettings
from tokenmesh.worker.engine_args import engine_args


def adapter_dir(root: Path, name: str, rank: int = 8) -> Path:
    path = root / name
    path.mkdir()
    (path / "adapter_config.json").write_text(
        json.dumps({"r": rank, "lora_alpha": 16, "target_modules": ["q_proj"]})
    )
    return path


def settings(lora: dict[str, Path], **more: Any) -> WorkerSettings:
    return WorkerSettings(served_model_name="base", lora_modules=lora, **more)


def test_a_request_names_the_model_or_one_of_its_adapters(tmp_path: Path) -> None:
    adapters = Adapters.of(
        settings({"sql": adapter_dir(tmp_path, "a"), "chat": adapter_dir(tmp_path, "b")})
    )
    assert adapters.names == ("sql", "chat")
    assert adapters.for_model("") is None and adapters.for_model("base") is None
    sql, chat = adapters.for_model("sql"), adapters.for_model("chat")
    assert sql is not None and chat is not None
    # Ids in the settings' order from 1, as vLLM's server numbers --lora-modules.
    assert (sql.lora_int_id, chat.lora_int_id) == (1, 2)
    assert (sql.lora_path, sql.base_model_name) == (str(tmp_path / "a"), "base")
    with pytest.raises(NotFound) as unknown:
        adapters.for_model("other")
    assert str(unknown.value) == "model: 'other' is not served here; served: base, sql, chat"


def test_adapters_turn_lora_on_with_a_rank_that_holds_the_largest(tmp_path: Path) -> None:
    configured = settings({"a": adapter_dir(tmp_path, "a", 8), "b": adapter_dir(tmp_path, "b", 20)})
    assert lora_engine_args(configured) == {"enable_lora": True, "max_lora_rank": 32}
    parsed = engine_args(configured)
    assert parsed.enable_lora and parsed.max_lora_rank == 32
    # The operator's own rank stands; no adapters, no LoRA.
    own = settings({"a": adapter_dir(tmp_path, "c")}, engine_args={"max_lora_rank": 64})
    assert engine_args(own).max_lora_rank == 64
    assert lora_engine_args(settings({})) == {}
    assert not engine_args(settings({})).enable_lora


@pytest.mark.parametrize(
    ("lora", "more", "says"),
    [
        ({"a": "missing"}, {}, "lora_modules.a: missing has no adapter_config.json"),
        ({"base": "ADAPTER"}, {}, "lora_modules.base: the model's own name"),
        ({" a": "ADAPTER"}, {}, "is not a name"),
        ({"a": "ADAPTER"}, {"engine_args": {"enable_lora": False}}, "enable_lora is false"),
    ],
)
def test_bad_adapter_settings_stop_the_worker_naming_them(
    tmp_path: Path, lora: dict[str, str], more: dict[str, Any], says: str
) -> None:
    made = adapter_dir(tmp_path, "adapter")
    paths = {name: made if path == "ADAPTER" else Path(path) for name, path in lora.items()}
    with pytest.raises(ValidationError, match=says):
        settings(paths, **more)


class AdapterCache:
    """vLLM's engine as adapters see it: add_lora loads one (after a moment), evicting the least
    recently used past `capacity`, and says False for one it holds (touching it); remove_lora
    drops one, saying whether it held it."""

    def __init__(self, capacity: int, broken: str = "") -> None:
        self.capacity, self.broken = capacity, broken
        self.held: OrderedDict[int, str] = OrderedDict()
        self.adds = 0

    async def list_loras(self) -> list[int]:
        return list(self.held)  # a list, as vLLM's

    async def add_lora(self, request: Any) -> bool:
        self.adds += 1
        await asyncio.sleep(0.01)
        if request.lora_name == self.broken:
            raise ValueError("adapter_model.safetensors: no such file")
        if request.lora_int_id in self.held:
            self.held.move_to_end(request.lora_int_id)
            return False
        if len(self.held) >= self.capacity:
            self.held.popitem(last=False)
        self.held[request.lora_int_id] = request.lora_name
        return True

    async def remove_lora(self, lora_id: int) -> bool:
        return self.held.pop(lora_id, None) is not None


def counted(registry: CollectorRegistry, name: str, adapter: str) -> float:
    return registry.get_sample_value(name, {"adapter": adapter}) or 0.0


async def test_adapters_load_where_used_and_count_loads_and_evictions(tmp_path: Path) -> None:
    names = ("a", "b", "c")
    registry = CollectorRegistry()
    adapters = Adapters(
        "base",
        {name: adapter_dir(tmp_path, name) for name in names},
        AdapterMetrics.register(registry),
    )
    engine = AdapterCache(capacity=2)
    # At start: as many as the engine's cache holds, in settings order.
    await adapters.load(engine, 2)
    assert await adapters.held(engine) == ("a", "b")
    assert [counted(registry, "tokenmesh_worker_adapter_loads_total", n) for n in names] == [
        1,
        1,
        0,
    ]
    # The base model and a held adapter: no load.
    assert await adapters.ensure(engine, "base") is None
    held = await adapters.ensure(engine, "b")
    assert held is not None and held.lora_name == "b" and engine.adds == 2
    # Three requests at once for one the engine does not hold: one load, and the least
    # recently used adapter ("a") makes room.
    loaded = await asyncio.gather(*(adapters.ensure(engine, "c") for _ in range(3)))
    assert {request.lora_name for request in loaded if request} == {"c"}
    assert engine.adds == 3
    assert await adapters.held(engine) == ("b", "c")
    assert counted(registry, "tokenmesh_worker_adapter_loads_total", "c") == 1
    assert counted(registry, "tokenmesh_worker_adapter_evictions_total", "a") == 1
    assert counted(registry, "tokenmesh_worker_adapter_evictions_total", "b") == 0
    assert counted(registry, "tokenmesh_worker_adapter_load_seconds_count", "c") == 1
    assert counted(registry, "tokenmesh_worker_adapter_load_seconds_sum", "c") >= 0.01
    # Asked again, "a" loads again.
    await adapters.ensure(engine, "a")
    assert counted(registry, "tokenmesh_worker_adapter_loads_total", "a") == 2


async def test_an_adapter_that_fails_to_load_is_an_internal_error_naming_it(
    tmp_path: Path,
) -> None:
    adapters = Adapters("base", {"good": adapter_dir(tmp_path, "good"), "gone": tmp_path / "gone"})
    engine = AdapterCache(capacity=2, broken="gone")
    failures = await asyncio.gather(
        *(adapters.ensure(engine, "gone") for _ in range(2)), return_exceptions=True
    )
    # Both callers get the one load's failure, which names the adapter and its directory; none
    # is told to retry.
    assert engine.adds == 1
    for failure in failures:
        assert isinstance(failure, Internal), failure
        assert "'gone'" in str(failure) and str(tmp_path / "gone") in str(failure)
    # The next request tries again (the files may be back).
    with pytest.raises(Internal):
        await adapters.ensure(engine, "gone")
    assert engine.adds == 2
    assert await adapters.ensure(engine, "good") is not None


def test_an_adapters_requests_share_one_key_of_their_own() -> None:
    plain = affinity_key("the same prompt", 256)
    assert affinity_key("the same prompt", 256, "") == plain
    sql = affinity_key("the same prompt", 256, "sql")
    assert sql != plain and sql != affinity_key("the same prompt", 256, "chat")
    # Whatever the prompt: the adapter's requests go where the adapter is held.
    assert sql == affinity_key("another prompt altogether", 256, "sql")
    # No prompt keys as an adapter does.
    assert affinity_key("sql", 256) != sql


class Stats(inference_pb2_grpc.InferenceServiceServicer):
    """Two pools' workers behind one address, told apart by the pool header as Envoy's routes
    tell them apart: the default pool's "base" with two adapters, the pool "code"'s "coder"
    with one; the pool "down" never answers. Counts the asks by pool."""

    def __init__(self) -> None:
        self.asked: dict[str, int] = {}
        self.adapters = ["sql", "chat"]

    async def GetEngineStats(self, request: Any, context: Any) -> inference_pb2.EngineStats:
        pool = dict(context.invocation_metadata()).get(POOL_HEADER, "")
        self.asked[pool] = self.asked.get(pool, 0) + 1
        if pool == "down":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no healthy upstream")
        if pool == "code":
            return inference_pb2.EngineStats(model="coder", adapters=["sql"], max_model_len=128)
        return inference_pb2.EngineStats(model="base", adapters=self.adapters, max_model_len=64)


@pytest.fixture
async def stats() -> AsyncIterator[tuple[Stats, Dependency]]:
    server = aio.server()
    servicer = Stats()
    inference_pb2_grpc.add_InferenceServiceServicer_to_server(servicer, server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    try:
        yield servicer, Dependency("worker", f"127.0.0.1:{port}", 1 << 20)
    finally:
        await server.stop(None)


async def test_the_catalog_knows_which_pool_serves_each_model_and_adapter(
    stats: tuple[Stats, Dependency],
) -> None:
    servicer, worker = stats
    catalog = ModelCatalog(worker, timeout=5.0, pools=("code",))
    assert await catalog.resolve("base") == Served("base", "", "")
    assert await catalog.resolve("chat") == Served("chat", "", "chat")
    assert await catalog.resolve("coder") == Served("coder", "code", "")
    # A name two pools serve is the first pool's.
    assert await catalog.resolve("sql") == Served("sql", "", "sql")
    # An empty name is the mesh's model, the default pool's.
    assert await catalog.resolve("") == Served("")
    assert await catalog.resolve("", frozenset({"base"})) == Served("base")
    assert Served("coder", "code").metadata() == ((POOL_HEADER, "code"),)
    assert Served("base").metadata() == ()
    with pytest.raises(ModelNotFound) as unknown:
        await catalog.resolve("other")
    assert "this mesh serves 'base', 'sql', 'chat', 'coder'" in str(unknown.value)
    assert unknown.value.code == grpc.StatusCode.NOT_FOUND
    assert await catalog.cards(None) == [
        ModelCard("base", None, 64),
        ModelCard("sql", "base", 64),
        ModelCard("chat", "base", 64),
        ModelCard("coder", None, 128),
    ]
    # Each pool was asked once (within the TTL), and its own workers were.
    assert servicer.asked == {"": 1, "code": 1}


async def test_a_name_no_pool_serves_asks_the_pools_again_at_most_once_a_second(
    stats: tuple[Stats, Dependency],
) -> None:
    servicer, worker = stats
    catalog = ModelCatalog(worker, timeout=5.0)
    await catalog.resolve("base")
    # An adapter loaded since the last ask is found at once, not after the TTL.
    servicer.adapters = ["sql", "chat", "new"]
    await asyncio.sleep(MISS_REFRESH_SECONDS)
    assert await catalog.resolve("new") == Served("new", "", "new")
    asked = servicer.asked[""]
    # Unknown names, many at once and again at once: no more asks.
    for _ in range(2):
        results = await asyncio.gather(
            *(catalog.resolve("other") for _ in range(5)), return_exceptions=True
        )
        assert all(isinstance(result, ModelNotFound) for result in results)
    assert servicer.asked[""] == asked


async def test_a_pool_that_never_answered_makes_an_unknown_name_unavailable_not_absent(
    stats: tuple[Stats, Dependency],
) -> None:
    _, worker = stats
    catalog = ModelCatalog(worker, timeout=5.0, pools=("down",))
    # What the answering pools serve is served.
    assert await catalog.resolve("chat") == Served("chat", "", "chat")
    # Any other name might be the silent pool's: UNAVAILABLE naming it, not NOT_FOUND.
    with pytest.raises(DependencyError) as unknown:
        await catalog.resolve("other")
    assert unknown.value.code == grpc.StatusCode.UNAVAILABLE
    assert "no worker answered for the models the pool worker-down serves" in str(unknown.value)
    assert [card.name for card in await catalog.cards(None)] == ["base", "sql", "chat"]


async def test_a_tenant_limited_to_some_models_is_denied_the_others(
    stats: tuple[Stats, Dependency],
) -> None:
    _, worker = stats
    catalog = ModelCatalog(worker, timeout=5.0, pools=("code",))
    allowed = frozenset({"sql", "coder", "elsewhere"})
    assert await catalog.resolve("sql", allowed) == Served("sql", "", "sql")
    assert await catalog.resolve("coder", allowed) == Served("coder", "code")
    # The mesh's model, named or by an empty name, is not among them.
    for requested in ("base", ""):
        with pytest.raises(ModelDenied) as denied:
            await catalog.resolve(requested, allowed)
        assert denied.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert "may not use the model 'base'; it may use 'coder', 'elsewhere', 'sql'" in str(
            denied.value
        )
    # What the mesh does not serve is NOT_FOUND whoever asks.
    with pytest.raises(ModelNotFound):
        await catalog.resolve("other", allowed)
    # /v1/models lists what the tenant may use of what is served.
    assert [card.name for card in await catalog.cards(allowed)] == ["sql", "coder"]


def test_a_keys_files_models_are_a_limit_a_tenant_overrides() -> None:
    keys = KeysFile.model_validate(
        {
            "defaults": {"models": ["base"]},
            "tenants": {
                "plain": {},
                "sql-only": {"limits": {"models": ["sql"]}},
                "any": {"limits": {"models": None}},
            },
        }
    )
    assert keys.resolved("plain").limits.models == {"base"}
    assert keys.resolved("sql-only").limits.models == {"sql"}
    assert keys.resolved("any").limits.models is None
    with pytest.raises(ValidationError, match="models"):
        KeysFile.model_validate({"defaults": {"models": []}})


async def test_a_model_name_over_the_cap_is_refused_naming_the_field_not_repeating_it(
    stats: tuple[Stats, Dependency],
) -> None:
    servicer, worker = stats
    catalog = ModelCatalog(worker, timeout=5.0, max_name_bytes=32)
    long = "m" * 33
    with pytest.raises(InvalidArgument) as refused:
        await catalog.resolve(long)
    assert refused.value.field == "model" and "over the limit of 32" in str(refused.value)
    assert long not in str(refused.value)
    # Refused before any worker is asked.
    assert servicer.asked == {}


async def test_a_silent_pool_is_asked_again_at_most_once_a_second_not_by_every_request(
    stats: tuple[Stats, Dependency],
) -> None:
    servicer, worker = stats
    catalog = ModelCatalog(worker, timeout=5.0, pools=("down",))
    for _ in range(5):
        assert await catalog.resolve("base") == Served("base")
    # The other pools' requests do not wait on the silent pool's workers each time.
    assert servicer.asked == {"": 1, "down": 1}
    await asyncio.sleep(MISS_REFRESH_SECONDS)
    with pytest.raises(DependencyError):
        await catalog.resolve("other")
    assert servicer.asked["down"] == 2


async def test_a_miss_during_a_longer_ask_asks_again_for_what_it_needs(
    stats: tuple[Stats, Dependency],
) -> None:
    servicer, worker = stats
    catalog = ModelCatalog(worker, timeout=5.0, pools=("code",))
    await catalog.resolve("base")
    await asyncio.sleep(MISS_REFRESH_SECONDS)
    # The default pool is due for the TTL's ask, which starts; a miss's ask (every pool over a
    # second old) meanwhile waits on it, then asks the pool it left out.
    catalog._pools[0].asked -= MODEL_NAME_TTL_SECONDS
    ttl = asyncio.ensure_future(catalog._refresh(MODEL_NAME_TTL_SECONDS))
    await asyncio.sleep(0)
    await catalog._refresh(MISS_REFRESH_SECONDS)
    await ttl
    assert servicer.asked == {"": 2, "code": 2}
