"""LoRA adapters by name: the worker's settings, the engine arguments they need (through vLLM's
own parser), the adapter a request's `model` picks and the NOT_FOUND naming what is served;
the gateway's catalog learning them from a worker (a gRPC server in the test), and the prefix
key an adapter's requests get. tests/integration/test_adapters.py runs them on real engines."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc import aio
from pydantic import ValidationError

from tokenmesh.common.channels import Dependency
from tokenmesh.common.errors import NotFound
from tokenmesh.gateway.core.catalog import ModelCatalog, ModelNotFound
from tokenmesh.gateway.core.prefix_key import affinity_key
from tokenmesh.localmesh.probes import free_port
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc
from tokenmesh.worker.adapters import Adapters, lora_engine_args
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


def test_an_adapters_prompts_get_keys_of_their_own() -> None:
    plain = affinity_key("the same prompt", 256)
    assert affinity_key("the same prompt", 256, "") == plain
    sql = affinity_key("the same prompt", 256, "sql")
    assert sql != plain and sql != affinity_key("the same prompt", 256, "chat")
    assert sql == affinity_key("the same prompt", 256, "sql")


class Stats(inference_pb2_grpc.InferenceServiceServicer):
    async def GetEngineStats(self, request: Any, context: Any) -> inference_pb2.EngineStats:
        return inference_pb2.EngineStats(model="base", adapters=["sql", "chat"], max_model_len=64)


@pytest.fixture
async def worker() -> AsyncIterator[Dependency]:
    server = aio.server()
    inference_pb2_grpc.add_InferenceServiceServicer_to_server(Stats(), server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    try:
        yield Dependency("worker", f"127.0.0.1:{port}", 1 << 20)
    finally:
        await server.stop(None)


async def test_the_catalog_serves_the_model_and_the_adapters_a_worker_lists(
    worker: Dependency,
) -> None:
    catalog = ModelCatalog(worker, timeout=5.0)
    assert await catalog.check("base") == "base" and await catalog.adapter_of("base") == ""
    assert await catalog.check("sql") == "sql" and await catalog.adapter_of("sql") == "sql"
    assert catalog.adapters == ("sql", "chat")
    with pytest.raises(ModelNotFound) as unknown:
        await catalog.check("other")
    assert "this mesh serves 'base', 'sql', 'chat'" in str(unknown.value)
    assert unknown.value.code == grpc.StatusCode.NOT_FOUND
