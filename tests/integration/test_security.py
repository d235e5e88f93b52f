"""API keys and tenant limits at a real gateway (keys file, JSON logs, traced) in front of the
session's real worker (vLLM) and reranker: refusals and their messages, open health and
reflection, rate and concurrency limits with retry-after-ms, a token quota that ends a stream
and frees the engine, a key added to the file while the gateway runs, the tenant seen by the
worker (its server span) whatever the caller claims, a tenant limited to models refused any
other, and no key in the gateway's log.
Each behaviour has a tenant of its own in the keys file, so their limits do not meet."""

from __future__ import annotations

import json
import random
import re
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
from grpc import aio

from tests.conftest import LOG_DIR, OTLP_ENV
from tests.otlp_collector import OtlpCollector
from tests.support import (
    TINY_MODEL,
    ServiceProcess,
    aborted_since,
    aborted_total,
    engine_empty_at,
    gateway_process,
    generations_finished,
    grpcurl,
    metric_value,
    positions,
    read_rest,
    scrape_metrics,
)
from tokenmesh.gateway.core.tenancy.auth import UNAUTHENTICATED_MESSAGE, hash_key
from tokenmesh.gateway.keys import add_key
from tokenmesh.v1 import llm_pb2, llm_pb2_grpc, token_pb2

pytestmark = pytest.mark.integration

KEYS = {
    "acme": "tm_acme-integration-key-0123456789",
    "ratey": "tm_ratey-integration-key-0123456789",
    "narrow": "tm_narrow-integration-key-0123456789",
    "metered": "tm_metered-integration-key-0123456789",
    "chatty": "tm_chatty-integration-key-0123456789",
    "scoped": "tm_scoped-integration-key-0123456789",
    "served": "tm_served-integration-key-0123456789",
}
# What the session's worker serves (tests/support.py, worker_process): its model's path.
SERVED = str(TINY_MODEL)
QUOTA = 20
CHAT_QUOTA = 10
# A fixed quota window far longer than the test (epoch-aligned: the current one ends in 2033).
FOREVER_SECONDS = 1_000_000_000
RATE = 0.01  # requests per second: after the burst, the next is 100 s away
BURST = 2


def bearer(tenant: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {KEYS[tenant]}"),)


def keys_document() -> dict[str, object]:
    limits = {
        "ratey": {"requests_per_second": RATE, "burst": BURST},
        "narrow": {"max_concurrent_streams": 1},
        "metered": {"tokens_per_window": QUOTA, "window_seconds": FOREVER_SECONDS},
        "chatty": {"tokens_per_window": CHAT_QUOTA, "window_seconds": FOREVER_SECONDS},
        "scoped": {"models": ["an-adapter-elsewhere"]},
        "served": {"models": [SERVED, "an-adapter-elsewhere"]},
    }
    return {
        "defaults": {},
        "tenants": {
            name: {"key_sha256": [hash_key(key)], "limits": limits.get(name, {})}
            for name, key in KEYS.items()
        },
    }


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    path.write_text(json.dumps(keys_document(), indent=2))
    return path


@pytest.fixture(scope="module")
def secured(
    keys_file: Path, worker: ServiceProcess, reranker: ServiceProcess, otlp_collector: OtlpCollector
) -> Iterator[ServiceProcess]:
    """A gateway with a keys file, JSON logs and tracing (to the session's collector)."""
    process = gateway_process(
        LOG_DIR,
        worker.address,
        reranker.address,
        name="gateway-secured",
        keys_file=str(keys_file),
        keys_reload_seconds="0.2",
        log_format="json",
        otlp_endpoint=otlp_collector.address,
    )
    process.env.update(OTLP_ENV)
    process.start()
    try:
        process.wait_serving(60)  # health checks without a key: open
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
async def llm(secured: ServiceProcess) -> AsyncIterator[llm_pb2_grpc.LLMServiceStub]:
    async with aio.insecure_channel(secured.address) as channel:
        yield llm_pb2_grpc.LLMServiceStub(channel)


def generate(max_tokens: int = 4) -> llm_pb2.GenerateRequest:
    return llm_pb2.GenerateRequest(prompt="hello", max_tokens=max_tokens, ignore_eos=True)


async def test_no_key_and_a_wrong_key_get_the_same_unauthenticated(llm) -> None:
    for metadata in ((), (("authorization", "Bearer tm_wrong"),), (("x-api-key", "acme"),)):
        with pytest.raises(aio.AioRpcError) as error:
            await read_rest(llm.Generate(generate(), metadata=metadata, timeout=30))
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert error.value.details() == UNAUTHENTICATED_MESSAGE
    with pytest.raises(aio.AioRpcError) as error:
        await llm.GetAnswer(llm_pb2.Query(prompt="hi", max_tokens=2), timeout=30)
    assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_a_good_key_streams_with_either_header(llm) -> None:
    tokens = [t async for t in llm.Generate(generate(8), metadata=bearer("acme"), timeout=60)]
    assert positions(tokens) == list(range(8))
    assert tokens[-1].finish_reason == token_pb2.FINISH_REASON_LENGTH
    answer = await llm.GetAnswer(
        llm_pb2.Query(prompt="hi", max_tokens=3, ignore_eos=True),
        metadata=(("x-api-key", KEYS["acme"]),),
        timeout=60,
    )
    assert answer.usage.completion_tokens == 3


def test_health_and_reflection_are_open_and_grpcurl_sends_the_key(
    secured: ServiceProcess,
) -> None:
    listed = grpcurl(secured.address, "list")
    assert listed.returncode == 0 and "tokenmesh.v1.LLMService" in listed.stdout
    health = grpcurl(secured.address, "grpc.health.v1.Health/Check")
    assert health.returncode == 0 and "SERVING" in health.stdout
    request = '{"prompt":"hello","max_tokens":3,"ignore_eos":true}'
    called = grpcurl(
        "-H", f"authorization: Bearer {KEYS['acme']}", "-d", request,
        secured.address, "tokenmesh.v1.LLMService/Generate",
    )  # fmt: skip
    assert called.returncode == 0, called.stderr
    # grpcurl prints each message as a JSON object: together they hold the 3 tokens, each at
    # least one (tokens that arrive while an earlier message is still being written go out
    # together: decision 0002).
    messages = [json.loads(part) for part in re.split(r"(?<=\})\n(?=\{)", called.stdout.strip())]
    assert all(message.get("token_ids") for message in messages), called.stdout
    assert sum(len(message["token_ids"]) for message in messages) == 3, called.stdout
    refused = grpcurl("-d", request, secured.address, "tokenmesh.v1.LLMService/Generate")
    assert refused.returncode != 0 and "Unauthenticated" in refused.stderr


async def test_over_the_request_rate_is_resource_exhausted_with_retry_after(llm) -> None:
    for _ in range(BURST):
        await read_rest(llm.Generate(generate(1), metadata=bearer("ratey"), timeout=60))
    call = llm.Generate(generate(1), metadata=bearer("ratey"), timeout=60)
    with pytest.raises(aio.AioRpcError) as error:
        await read_rest(call)
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error.value.details() == f"tenant request rate limit {RATE:g}/s exceeded"
    assert dict(error.value.trailing_metadata())["retry-after-ms"] == str(round(1000 / RATE))
    # Another tenant is not held back.
    await read_rest(llm.Generate(generate(1), metadata=bearer("acme"), timeout=60))


async def test_over_the_concurrent_streams_is_refused_until_one_ends(llm) -> None:
    long = llm.Generate(generate(2000), metadata=bearer("narrow"), timeout=120)
    await long.read()
    with pytest.raises(aio.AioRpcError) as error:
        await read_rest(llm.Generate(generate(1), metadata=bearer("narrow"), timeout=60))
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error.value.details() == "tenant concurrent stream limit 1 reached"
    assert dict(error.value.trailing_metadata())["retry-after-ms"] == "1000"
    long.cancel()
    deadline = time.monotonic() + 10
    while True:  # the gateway lets the stream out as soon as it sees the cancel
        try:
            await read_rest(llm.Generate(generate(1), metadata=bearer("narrow"), timeout=60))
            break
        except aio.AioRpcError as refused:
            assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert time.monotonic() < deadline, "the slot was not released"


async def test_the_token_quota_ends_a_stream_and_frees_the_engine(
    llm, inference, worker: ServiceProcess, secured: ServiceProcess
) -> None:
    aborted_before = aborted_total(worker, "cancelled")
    finished_before = generations_finished(worker)
    tokens = [
        t async for t in llm.Generate(generate(2000), metadata=bearer("metered"), timeout=120)
    ]
    streamed = positions(tokens)
    assert 0 < len(streamed) <= QUOTA
    assert streamed == list(range(len(streamed)))
    assert tokens[-1].finish_reason == token_pb2.FINISH_REASON_QUOTA_EXHAUSTED
    assert tokens[-1].usage.completion_tokens == len(streamed)
    # Closing the worker stream cancelled the worker call, which aborted the engine request,
    # unless the worker had sent all its tokens first (seen on a loaded machine: 2,000 tokens
    # of the tiny model fit in the stream's flow-control window).
    await engine_empty_at(inference, tokens[-1].emitted_unix_nanos)
    aborted = await aborted_since(worker, "cancelled", aborted_before, 1)
    assert aborted + generations_finished(worker) - finished_before == 1
    with pytest.raises(aio.AioRpcError) as error:
        await read_rest(llm.Generate(generate(1), metadata=bearer("metered"), timeout=60))
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error.value.details() == f"tenant token quota {QUOTA} per {FOREVER_SECONDS}s used up"
    retry_after_ms = int(dict(error.value.trailing_metadata())["retry-after-ms"])
    assert 0 < retry_after_ms <= FOREVER_SECONDS * 1000
    metrics = scrape_metrics(secured.metrics_port)
    charged = metric_value(metrics, "tokenmesh_gateway_tenant_tokens_total", tenant="metered")
    assert charged == len(streamed)
    refused = metric_value(
        metrics,
        "tokenmesh_gateway_tenant_requests_total",
        tenant="metered",
        outcome="quota_exhausted",
    )
    assert refused == 1


async def test_answers_and_chat_turns_are_charged_too(llm) -> None:
    answer = await llm.GetAnswer(
        llm_pb2.Query(prompt="hi", max_tokens=6, ignore_eos=True),
        metadata=bearer("chatty"),
        timeout=60,
    )
    assert answer.finish_reason == token_pb2.FINISH_REASON_LENGTH
    chat = llm.Chat(metadata=bearer("chatty"), timeout=60)
    turn = llm_pb2.UserTurn(content="talk", max_tokens=500, ignore_eos=True)
    await chat.write(llm_pb2.ChatMessage(user=turn))
    tokens = []
    while not (event := await chat.read()).HasField("turn_end"):
        tokens.append(event.token)
    assert positions(tokens) == list(range(CHAT_QUOTA - 6))
    assert event.turn_end.finish_reason == token_pb2.FINISH_REASON_QUOTA_EXHAUSTED
    await chat.write(llm_pb2.ChatMessage(user=turn))  # nothing left: the chat is refused
    with pytest.raises(aio.AioRpcError) as error:
        await read_rest(chat)
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "retry-after-ms" in dict(error.value.trailing_metadata())


async def test_a_key_added_to_the_file_works_without_a_restart(
    llm, keys_file: Path, secured: ServiceProcess
) -> None:
    pid = secured.process.pid if secured.process else None
    key = add_key(keys_file, "newcomer")
    deadline = time.monotonic() + 20
    while True:
        try:
            tokens = await read_rest(
                llm.Generate(generate(2), metadata=(("x-api-key", key),), timeout=60)
            )
            break
        except aio.AioRpcError as error:
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED
            assert time.monotonic() < deadline, "the new key was not accepted within 20 s"
    assert positions(tokens) == [0, 1]
    assert secured.process is not None and secured.process.pid == pid
    assert secured.process.poll() is None
    assert key not in secured.log_path.read_text()


async def test_the_worker_sees_the_authenticated_tenant_not_the_callers_claim(
    llm, otlp_collector: OtlpCollector
) -> None:
    trace_id = f"{random.getrandbits(128):032x}"
    traceparent = f"00-{trace_id}-{random.getrandbits(64):016x}-01"
    metadata = (*bearer("acme"), ("x-tenant-id", "mallory"), ("traceparent", traceparent))
    await read_rest(llm.Generate(generate(2), metadata=metadata, timeout=60))

    def server_span(spans, service: str):  # type: ignore[no-untyped-def]
        return next(
            (s for s in spans if s.service == service and s.kind == 2 and "Generate" in s.name),
            None,
        )

    spans = await otlp_collector.wait_for(
        trace_id,
        lambda found: bool(
            server_span(found, "tokenmesh-worker") and server_span(found, "tokenmesh-gateway")
        ),
    )
    assert server_span(spans, "tokenmesh-worker").attributes["tokenmesh.tenant"] == "acme"
    assert server_span(spans, "tokenmesh-gateway").attributes["tokenmesh.tenant"] == "acme"


def test_the_log_names_tenants_and_never_a_key(secured: ServiceProcess) -> None:
    lines = [
        json.loads(line)
        for line in secured.log_path.read_text().splitlines()
        if line.startswith("{")
    ]
    rpcs = [line for line in lines if str(line.get("message", "")).startswith("rpc /")]
    assert any(line.get("tenant") == "acme" and line["grpc_code"] == "OK" for line in rpcs)
    assert any(line["grpc_code"] == "UNAUTHENTICATED" and "tenant" not in line for line in rpcs)
    text = secured.log_path.read_text()
    assert not [name for name, key in KEYS.items() if key in text]


async def test_a_tenant_limited_to_other_models_is_permission_denied_naming_its_own(llm) -> None:
    with pytest.raises(aio.AioRpcError) as denied:
        await read_rest(llm.Generate(generate(), metadata=bearer("scoped"), timeout=30))
    assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
    details = denied.value.details() or ""
    assert "'an-adapter-elsewhere'" in details and repr(SERVED) in details, details
    # Named explicitly, the same; a name the mesh does not serve is still NOT_FOUND first.
    named = llm_pb2.GenerateRequest(prompt="hello", max_tokens=2, model=SERVED)
    with pytest.raises(aio.AioRpcError) as denied:
        await read_rest(llm.Generate(named, metadata=bearer("scoped"), timeout=30))
    assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
    unknown = llm_pb2.GenerateRequest(prompt="hello", max_tokens=2, model="no-such-model")
    with pytest.raises(aio.AioRpcError) as missing:
        await read_rest(llm.Generate(unknown, metadata=bearer("scoped"), timeout=30))
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    # A tenant whose models include the served one streams as any other.
    tokens = [t async for t in llm.Generate(generate(4), metadata=bearer("served"), timeout=60)]
    assert positions(tokens) == list(range(4))
