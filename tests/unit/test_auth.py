"""API keys: the keys file (hashes, limits over defaults), lookups, hot reload that survives a
broken file, the metadata a key is read from, the `keys add` command, and the interceptors on
a small in-process server (one message for every refusal, open health, the tenant on the log
line and its requests counted under a bounded label)."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, generate_latest

from tests.support import metric_value
from tokenmesh.common.interceptors import standard_interceptors
from tokenmesh.common.server import Health
from tokenmesh.common.tenants import Limits, Tenant, current_tenant
from tokenmesh.gateway.app import Tenancy
from tokenmesh.gateway.app import serve as serve_gateway
from tokenmesh.gateway.config import GatewaySettings
from tokenmesh.gateway.core.tenancy.auth import (
    UNAUTHENTICATED_MESSAGE,
    KeysFileError,
    KeyStore,
    hash_key,
    new_key,
    presented_key,
)
from tokenmesh.gateway.core.tenancy.metrics import TenantMetrics
from tokenmesh.gateway.keys import add_key, main
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc, token_pb2
from tokenmesh.worker.tenant import TenantMetadataInterceptor

ACME_KEY = "tm_acme-test-key-0123456789"
GLOBEX_KEY = "tm_globex-test-key-0123456789"


def write_keys(path: Path, document: dict[str, Any]) -> None:
    """Replace the file the way editors and `keys add` do (new inode), so the change shows
    whatever the file system's mtime resolution."""
    staged = path.with_suffix(".staged")
    staged.write_text(json.dumps(document))
    os.replace(staged, path)


def keys_document(**tenants: list[str]) -> dict[str, Any]:
    return {
        "defaults": {"requests_per_second": 10, "max_concurrent_streams": 4},
        "tenants": {
            name: {"key_sha256": [hash_key(key) for key in keys]} for name, keys in tenants.items()
        },
    }


@pytest.fixture
def keys_file(tmp_path: Path) -> Path:
    path = tmp_path / "keys.json"
    write_keys(path, keys_document(acme=[ACME_KEY]))
    return path


def test_the_file_stores_sha256_hex_and_keys_are_random() -> None:
    assert hash_key("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    keys = {new_key() for _ in range(100)}
    assert len(keys) == 100 and all(key.startswith("tm_") and len(key) > 40 for key in keys)


def test_a_key_names_its_tenant_and_nothing_else_does(keys_file: Path) -> None:
    store = KeyStore(keys_file)
    tenant = store.authenticate(ACME_KEY)
    assert tenant is not None and tenant.id == "acme"
    for wrong in (None, "", "tm_wrong", ACME_KEY + "x", hash_key(ACME_KEY), "k" * 10_000):
        assert store.authenticate(wrong) is None
    assert store.tenant_ids() == {"acme"}


def test_tenant_limits_override_the_defaults_field_by_field(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    document = keys_document(acme=[ACME_KEY], globex=[GLOBEX_KEY])
    document["tenants"]["acme"]["limits"] = {"requests_per_second": 2, "tokens_per_window": 50}
    document["tenants"]["globex"]["limits"] = {"max_concurrent_streams": None}
    write_keys(path, document)
    store = KeyStore(path)
    acme, globex = store.tenant("acme"), store.tenant("globex")
    assert acme is not None and globex is not None
    assert acme.limits == Limits(
        requests_per_second=2, max_concurrent_streams=4, tokens_per_window=50
    )
    # null: unlimited, even though the defaults set a value.
    assert globex.limits == Limits(requests_per_second=10)
    assert acme.limits.bucket_size == 2 and Limits().bucket_size is None


@pytest.mark.parametrize(
    "document",
    [
        {"tenants": {"acme": {"key_sha256": ["not-hex"]}}},
        {"tenants": {"a": {"key_sha256": [hash_key("a")]}, "b": {"key_sha256": [hash_key("a")]}}},
        {"tenants": {"bad tenant": {"key_sha256": []}}},
        {"tenants": {"other": {"key_sha256": []}}},
        {"tenants": {}, "unknown": 1},
        {"defaults": {"requests_per_second": -1}},
    ],
)
def test_an_invalid_file_is_refused_at_start(tmp_path: Path, document: dict[str, Any]) -> None:
    path = tmp_path / "keys.json"
    write_keys(path, document)
    with pytest.raises(KeysFileError):
        KeyStore(path)
    with pytest.raises(KeysFileError, match="cannot read"):
        KeyStore(tmp_path / "missing.json")


async def test_a_gateway_with_a_broken_keys_file_does_not_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "keys.json"
    path.write_text('{"tenants": {"acme": {"key_sha256": ["' + ACME_KEY + '"]}}}')
    with caplog.at_level(logging.ERROR):
        assert await serve_gateway(GatewaySettings(keys_file=path, port=0, metrics_port=-1)) == 1
    assert "gateway not started: invalid keys file" in caplog.text
    assert ACME_KEY not in caplog.text


def test_a_changed_file_applies_and_a_broken_one_keeps_the_last_good(
    keys_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = KeyStore(keys_file)
    assert not store.reload_if_changed()
    write_keys(keys_file, keys_document(acme=[ACME_KEY], globex=[GLOBEX_KEY]))
    assert store.reload_if_changed()
    tenant = store.authenticate(GLOBEX_KEY)
    assert tenant is not None and tenant.id == "globex"
    keys_file.with_suffix(".staged").write_text("{ not json")
    os.replace(keys_file.with_suffix(".staged"), keys_file)
    with caplog.at_level(logging.ERROR):
        assert not store.reload_if_changed()
        assert not store.reload_if_changed()  # logged once per version of the file
        # A key pasted where its hash belongs: refused, and the error does not show it.
        write_keys(keys_file, {"tenants": {"acme": {"key_sha256": [ACME_KEY]}}})
        assert not store.reload_if_changed()
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2 and all("keeping the last good keys" in e for e in errors)
    assert "tenants.acme.key_sha256: Value error" in errors[1]
    assert store.authenticate(GLOBEX_KEY) is not None
    keys_file.unlink()
    assert not store.reload_if_changed() and store.authenticate(ACME_KEY) is not None
    write_keys(keys_file, keys_document(globex=[GLOBEX_KEY]))  # acme's key revoked
    assert store.reload_if_changed()
    assert store.authenticate(ACME_KEY) is None
    assert ACME_KEY not in caplog.text and GLOBEX_KEY not in caplog.text


async def test_watch_polls_the_file(keys_file: Path) -> None:
    store = KeyStore(keys_file)
    watch = asyncio.create_task(store.watch(0.02))
    try:
        write_keys(keys_file, keys_document(globex=[GLOBEX_KEY]))
        for _ in range(250):
            if store.authenticate(GLOBEX_KEY) is not None:
                break
            await asyncio.sleep(0.02)
        assert store.authenticate(GLOBEX_KEY) is not None
    finally:
        watch.cancel()


@pytest.mark.parametrize(
    ("metadata", "key"),
    [
        ((("authorization", "Bearer abc"),), "abc"),
        ((("authorization", "bearer  abc "),), "abc"),
        ((("x-api-key", "abc"),), "abc"),
        ((("x-api-key", "xyz"), ("authorization", "Bearer abc")), "abc"),
        ((("authorization", "Basic abc"),), None),
        ((), None),
        (None, None),
    ],
)
def test_the_key_comes_from_bearer_authorization_or_x_api_key(
    metadata: Any, key: str | None
) -> None:
    assert presented_key(metadata) == key


def test_keys_add_creates_the_file_and_stores_only_the_hash(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "keys.json"
    assert main(["add", "--tenant", "acme", "--file", str(path)]) == 0
    key = capsys.readouterr().out.strip()
    second = add_key(path, "acme")
    third = add_key(path, "globex")
    text = path.read_text()
    assert key not in text and second not in text and hash_key(key) in text
    store = KeyStore(path)
    assert [store.authenticate(k).id for k in (key, second, third)] == ["acme", "acme", "globex"]  # type: ignore[union-attr]
    path.write_text('{"tenants": {"acme": {"key_sha256": []}}, "oops": 1}')
    assert main(["add", "--tenant", "acme", "--file", str(path)]) == 1
    assert "oops" in path.read_text()  # left as it was


def test_keys_hash_prints_what_to_store_for_a_key_made_elsewhere(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO(ACME_KEY + "\n"))
    assert main(["hash"]) == 0
    assert capsys.readouterr().out.strip() == hash_key(ACME_KEY)


# ---- the interceptors on a real (in-process) server


class EchoTenant(inference_pb2_grpc.InferenceServiceServicer):
    """Streams three tokens whose text is the RPC's tenant."""

    async def Generate(self, request: Any, context: Any) -> AsyncIterator[token_pb2.Token]:
        tenant = current_tenant()
        for index in range(3):
            yield token_pb2.Token(index=index, text=tenant.id if tenant else "-")

    async def GetEngineStats(self, request: Any, context: Any) -> inference_pb2.EngineStats:
        tenant = current_tenant()
        return inference_pb2.EngineStats(model=tenant.id if tenant else "-")


async def serve(interceptors: list[aio.ServerInterceptor]) -> tuple[aio.Server, str]:
    server = aio.server(interceptors=interceptors)
    inference_pb2_grpc.add_InferenceServiceServicer_to_server(EchoTenant(), server)
    health = Health(["tokenmesh.v1.InferenceService"])
    health.register(server)
    await health.set_serving()
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


@pytest.fixture
async def gateway_like(keys_file: Path) -> AsyncIterator[tuple[aio.Channel, CollectorRegistry]]:
    """A server with the gateway's interceptor chain and keys file."""
    registry = CollectorRegistry()
    settings = GatewaySettings(keys_file=keys_file)
    tenancy = Tenancy.build(settings, registry)
    server, address = await serve(standard_interceptors(registry, None, tenancy.interceptors))
    async with aio.insecure_channel(address) as channel:
        yield channel, registry
    await server.stop(0)


async def test_every_refusal_has_the_same_message_and_health_stays_open(
    gateway_like: tuple[aio.Channel, CollectorRegistry],
) -> None:
    channel, registry = gateway_like
    stub = inference_pb2_grpc.InferenceServiceStub(channel)
    refusals = [
        (),
        (("authorization", "Bearer tm_nope"),),
        (("authorization", "Bearer"),),
        (("authorization", "Basic " + ACME_KEY),),
        (("x-api-key", "tm_nope"),),
    ]
    for metadata in refusals:
        with pytest.raises(aio.AioRpcError) as error:
            await stub.GetEngineStats(inference_pb2.EngineStatsRequest(), metadata=metadata)
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert error.value.details() == UNAUTHENTICATED_MESSAGE
        with pytest.raises(aio.AioRpcError) as error:
            await stub.Generate(inference_pb2.InferenceRequest(), metadata=metadata).read()
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert error.value.details() == UNAUTHENTICATED_MESSAGE
    health = health_pb2_grpc.HealthStub(channel)
    reply = await health.Check(health_pb2.HealthCheckRequest())
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    text = registry_text(registry)
    assert metric_value(
        text, "tokenmesh_gateway_tenant_requests_total", tenant="other", outcome="unauthenticated"
    ) == 2 * len(refusals)


def registry_text(registry: CollectorRegistry) -> str:
    return generate_latest(registry).decode()


async def test_a_good_key_names_the_tenant_to_the_handler_and_the_log_line(
    gateway_like: tuple[aio.Channel, CollectorRegistry], caplog: pytest.LogCaptureFixture
) -> None:
    channel, registry = gateway_like
    stub = inference_pb2_grpc.InferenceServiceStub(channel)
    with caplog.at_level(logging.INFO, logger="tokenmesh.common.interceptors"):
        stats = await stub.GetEngineStats(
            inference_pb2.EngineStatsRequest(), metadata=(("x-api-key", ACME_KEY),)
        )
        tokens = [
            t
            async for t in stub.Generate(
                inference_pb2.InferenceRequest(),
                # A caller's own x-tenant-id changes nothing at the gateway.
                metadata=(("authorization", f"Bearer {ACME_KEY}"), ("x-tenant-id", "evil")),
            )
        ]
    assert stats.model == "acme" and [t.text for t in tokens] == ["acme"] * 3
    lines = [r for r in caplog.records if r.getMessage().startswith("rpc /")]
    assert [getattr(r, "tenant", None) for r in lines] == ["acme", "acme"]
    assert ACME_KEY not in caplog.text
    assert (
        metric_value(
            registry_text(registry),
            "tokenmesh_gateway_tenant_requests_total",
            tenant="acme",
            outcome="admitted",
        )
        == 2
    )


async def test_behind_the_gateway_the_tenant_comes_from_x_tenant_id() -> None:
    registry = CollectorRegistry()
    server, address = await serve(
        standard_interceptors(registry, None, (TenantMetadataInterceptor(),))
    )
    try:
        async with aio.insecure_channel(address) as channel:
            stub = inference_pb2_grpc.InferenceServiceStub(channel)
            named = await stub.GetEngineStats(
                inference_pb2.EngineStatsRequest(), metadata=(("x-tenant-id", "acme"),)
            )
            anonymous = await stub.GetEngineStats(inference_pb2.EngineStatsRequest())
        assert (named.model, anonymous.model) == ("acme", "-")
    finally:
        await server.stop(0)


def test_tenant_labels_are_bounded_by_the_keys_file() -> None:
    registry = CollectorRegistry()
    metrics = TenantMetrics(registry, lambda: {"acme"})
    assert metrics.label(Tenant("acme")) == "acme"
    assert metrics.label(Tenant("gone")) == "other" and metrics.label(None) == "other"
