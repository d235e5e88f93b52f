"""What API keys and tenant limits cost a legitimate stream: two in-process gRPC servers with
the gateway's interceptor stack, one plain and one with the key check and limits (every limit
set, none reached), a 32-message stream per request, requests interleaved so both see the same
load; plus the per-token cost of charging a token quota. Traffic stays on 127.0.0.1.

  python -m loadtests.auth_bench --requests 400
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
from grpc import aio
from prometheus_client import CollectorRegistry

from loadtests.stats import Latencies
from tokenmesh.common.interceptors import standard_interceptors
from tokenmesh.common.tenants import Limits
from tokenmesh.gateway.core.tenancy.auth import (
    AuthInterceptor,
    KeysFile,
    KeyStore,
    TenantEntry,
    hash_key,
)
from tokenmesh.gateway.core.tenancy.limits import LimitsInterceptor, TenantLimiter
from tokenmesh.gateway.core.tenancy.metrics import TenantMetrics
from tokenmesh.v1 import token_pb2

KEY = "tm_benchmark_key"
METHOD = "/bench.Bench/Stream"
MESSAGES = 32
# Every limit set, far above what the benchmark uses: each is checked, none refuses.
LIMITS = Limits(requests_per_second=1e6, max_concurrent_streams=10_000, tokens_per_window=10**12)


async def stream(request: bytes, context: aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
    for index in range(MESSAGES):
        yield token_pb2.Token(index=index, text="x")


def handler() -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(
        "bench.Bench",
        {
            "Stream": grpc.unary_stream_rpc_method_handler(
                stream, response_serializer=token_pb2.Token.SerializeToString
            )
        },
    )


async def start(inner: list[aio.ServerInterceptor]) -> tuple[aio.Server, str]:
    server = aio.server(interceptors=standard_interceptors(CollectorRegistry(), None, inner))
    server.add_generic_rpc_handlers((handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def first_token_and_end(channel: aio.Channel, metadata: tuple[tuple[str, str], ...]):
    call = channel.unary_stream(METHOD, response_deserializer=token_pb2.Token.FromString)(
        b"", metadata=metadata, timeout=10
    )
    started = time.perf_counter()
    first = None
    async for _ in call:
        if first is None:
            first = time.perf_counter() - started
    assert first is not None
    return first, time.perf_counter() - started


def quota_charge_microseconds(limiter: TenantLimiter, store: KeyStore, count: int) -> float:
    tenant = store.authenticate(KEY)
    assert tenant is not None
    started = time.perf_counter()
    for _ in range(count):
        limiter.charge(tenant)
    return (time.perf_counter() - started) / count * 1e6


async def run(requests: int, warmup: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        keys = Path(folder) / "keys.json"
        keys.write_text(
            KeysFile(
                defaults=LIMITS, tenants={"bench": TenantEntry(key_sha256=[hash_key(KEY)])}
            ).model_dump_json()
        )
        store = KeyStore(keys)
        metrics = TenantMetrics(CollectorRegistry(), store.tenant_ids)
        limiter = TenantLimiter(1000)
        keyed_inner = [
            AuthInterceptor(store, ("/grpc.health.v1.Health/",), metrics),
            LimitsInterceptor(limiter, metrics),
        ]
        plain, plain_address = await start([])
        keyed, keyed_address = await start(keyed_inner)
        ttft = {"plain": Latencies(), "keyed": Latencies()}
        whole = {"plain": Latencies(), "keyed": Latencies()}
        metadata = {"plain": (), "keyed": (("authorization", f"Bearer {KEY}"),)}
        async with (
            aio.insecure_channel(plain_address) as plain_channel,
            aio.insecure_channel(keyed_address) as keyed_channel,
        ):
            channels = {"plain": plain_channel, "keyed": keyed_channel}
            for i in range(warmup + requests):
                order = ("plain", "keyed") if i % 2 else ("keyed", "plain")
                for name in order:
                    first, total = await first_token_and_end(channels[name], metadata[name])
                    if i >= warmup:
                        ttft[name].record(first)
                        whole[name].record(total)
        await plain.stop(None)
        await keyed.stop(None)
        charge_us = quota_charge_microseconds(limiter, store, 100_000)
    return {
        "requests_each": requests,
        "messages_per_stream": MESSAGES,
        "ttft_plain": ttft["plain"].summary(),
        "ttft_keyed": ttft["keyed"].summary(),
        "stream_plain": whole["plain"].summary(),
        "stream_keyed": whole["keyed"].summary(),
        "keyed_ttft_added_p50_ms": round(ttft["keyed"].ms(50) - ttft["plain"].ms(50), 3),
        "keyed_over_plain_ttft_p50": round(ttft["keyed"].ms(50) / ttft["plain"].ms(50), 3),
        "keyed_over_plain_stream_p50": round(whole["keyed"].ms(50) / whole["plain"].ms(50), 3),
        "quota_charge_us_per_token": round(charge_us, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=20)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(run(args.requests, args.warmup)), indent=2))


if __name__ == "__main__":
    main()
