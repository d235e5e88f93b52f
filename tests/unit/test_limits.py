"""Per-tenant limits without processes: the request-rate bucket, concurrent streams, token
quota windows on a fake clock, limits changed by a reload, the quota meter ending a token
stream, and refusals through the error mapping (RESOURCE_EXHAUSTED, retry-after-ms)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import grpc
import pytest
from grpc import aio
from prometheus_client import CollectorRegistry

from tokenmesh.common.errors import RETRY_AFTER_HEADER
from tokenmesh.common.interceptors import admitted, standard_interceptors
from tokenmesh.common.tenants import Limits, Tenant, enter_tenant
from tokenmesh.gateway.core.tenancy.limits import (
    Charge,
    LimitExceeded,
    LimitsInterceptor,
    TenantLimiter,
)
from tokenmesh.gateway.core.tenancy.metrics import TenantMetrics
from tokenmesh.gateway.core.tenancy.quota import QuotaMeter
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc, token_pb2

# Generous bound for a condition that should hold promptly.
PROMPTLY = 10.0


class FakeClock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def tenant(**limits: Any) -> Tenant:
    return Tenant("acme", Limits(**limits))


async def test_no_limits_admit_everything() -> None:
    limiter = TenantLimiter(1000)
    for _ in range(1000):
        await limiter.admit(tenant())
    assert limiter.charge(tenant(), 10**9) == Charge(True, None)
    assert limiter.quota_left(tenant()) is None


async def test_the_rate_bucket_lets_a_burst_through_then_refuses_with_a_hint() -> None:
    slow = tenant(requests_per_second=0.5, burst=3)
    limiter = TenantLimiter(1000)
    for _ in range(3):
        await limiter.admit(slow)
        limiter.release(slow)
    with pytest.raises(LimitExceeded) as refused:
        await limiter.admit(slow)
    assert refused.value.outcome == "rate_limited"
    assert refused.value.message == "tenant request rate limit 0.5/s exceeded"
    assert refused.value.retry_after_ms == 2000
    assert refused.value.trailing_metadata == ((RETRY_AFTER_HEADER, "2000"),)
    # Another tenant has its own bucket.
    await limiter.admit(Tenant("globex", slow.limits))


async def test_the_rate_refills_over_time() -> None:
    # One request drips out in 0.5 s: the refusal right after the first admit holds however
    # slowly the machine runs, and the test still takes only about that long.
    paced = tenant(requests_per_second=2, burst=1)
    limiter = TenantLimiter(1000)
    started = time.monotonic()
    await limiter.admit(paced)
    with pytest.raises(LimitExceeded):
        await limiter.admit(paced)
    while True:
        assert time.monotonic() - started < PROMPTLY, "the bucket never refilled"
        await asyncio.sleep(0.01)
        try:
            await limiter.admit(paced)
        except LimitExceeded:
            continue
        break
    assert time.monotonic() - started >= 0.5 * 0.9  # not before its drip (0.9: float rounding)


async def test_concurrent_streams_are_counted_until_released() -> None:
    two = tenant(max_concurrent_streams=2)
    limiter = TenantLimiter(750)
    await limiter.admit(two)
    await limiter.admit(two)
    with pytest.raises(LimitExceeded) as refused:
        await limiter.admit(two)
    assert refused.value.outcome == "concurrency_limited"
    assert refused.value.message == "tenant concurrent stream limit 2 reached"
    assert refused.value.retry_after_ms == 750
    limiter.release(two)
    await limiter.admit(two)


async def test_the_token_quota_is_a_fixed_window_aligned_to_the_epoch() -> None:
    clock = FakeClock(now=999_995.0)  # 35 s into the window from 999_960 (16_666 x 60)
    limiter = TenantLimiter(1000, clock)
    quota = tenant(tokens_per_window=10, window_seconds=60)
    assert limiter.charge(quota, 7) == Charge(True, 3)
    assert limiter.charge(quota, 4) == Charge(False, 3)
    assert limiter.charge(quota, 3) == Charge(True, 0)
    assert limiter.quota_left(quota) == 0
    with pytest.raises(LimitExceeded) as refused:
        await limiter.admit(quota)
    assert refused.value.outcome == "quota_exhausted"
    assert refused.value.message == "tenant token quota 10 per 60s used up"
    assert refused.value.retry_after_ms == 25_000  # the next one starts at 1_000_020
    clock.now += 25
    assert limiter.quota_left(quota) == 10
    await limiter.admit(quota)


async def test_a_reload_applies_new_limits_and_keeps_what_is_used() -> None:
    clock = FakeClock()
    limiter = TenantLimiter(1000, clock)
    before = tenant(tokens_per_window=10, max_concurrent_streams=1)
    await limiter.admit(before)
    assert limiter.charge(before, 10).fitted
    after = tenant(tokens_per_window=15, max_concurrent_streams=2)
    assert limiter.quota_left(after) == 5
    await limiter.admit(after)  # the first stream is still counted: 2 of 2
    with pytest.raises(LimitExceeded):
        await limiter.admit(after)


async def worker_tokens(count: int, closed: list[bool]) -> AsyncGenerator[token_pb2.Token, None]:
    """A worker's stream of `count` tokens, the last with FINISH_REASON_LENGTH; records
    whether it was closed before its end."""
    try:
        for index in range(count):
            last = index == count - 1
            token = token_pb2.Token(
                index=index,
                text=f"t{index}",
                finish_reason=token_pb2.FINISH_REASON_LENGTH if last else 0,
            )
            if last:
                token.usage.completion_tokens = count
            yield token
    except GeneratorExit:
        closed.append(True)
        raise


def meter(limiter: TenantLimiter) -> QuotaMeter:
    return QuotaMeter(limiter, TenantMetrics(CollectorRegistry(), lambda: {"acme"}))


async def test_the_token_that_uses_the_quota_up_ends_the_stream_and_closes_the_worker() -> None:
    limiter = TenantLimiter(1000, FakeClock())
    quota = tenant(tokens_per_window=5)
    closed: list[bool] = []
    tokens = [t async for t in meter(limiter).metered(quota, worker_tokens(100, closed))]
    assert [t.index for t in tokens] == [0, 1, 2, 3, 4]
    assert tokens[-1].finish_reason == token_pb2.FINISH_REASON_QUOTA_EXHAUSTED
    assert tokens[-1].usage.completion_tokens == 5 and tokens[-1].text == "t4"
    assert closed == [True]
    with pytest.raises(LimitExceeded):  # the next request, before the worker is called
        await anext(meter(limiter).metered(quota, worker_tokens(1, [])))


async def three_a_message(count: int) -> AsyncGenerator[token_pb2.Token, None]:
    """A worker's stream whose messages hold three tokens each (it fell behind the engine)."""
    for index in range(0, count, 3):
        ids = list(range(index, index + 3))
        yield token_pb2.Token(
            index=index,
            token_id=ids[0],
            token_ids=ids,
            text="".join(f"t{i}" for i in ids),
            text_lengths=[len(f"t{i}") for i in ids],
        )


async def test_a_message_of_several_tokens_is_cut_at_exactly_the_quota() -> None:
    limiter = TenantLimiter(1000, FakeClock())
    quota = tenant(tokens_per_window=7)
    tokens = [t async for t in meter(limiter).metered(quota, three_a_message(30))]
    assert [(t.index, list(t.token_ids)) for t in tokens] == [
        (0, [0, 1, 2]),
        (3, [3, 4, 5]),
        (6, [6]),
    ]
    assert "".join(t.text for t in tokens) == "t0t1t2t3t4t5t6"
    assert tokens[-1].finish_reason == token_pb2.FINISH_REASON_QUOTA_EXHAUSTED
    assert tokens[-1].usage.completion_tokens == 7
    assert limiter.quota_left(quota) == 0


async def test_a_generation_that_ends_on_the_last_token_keeps_its_reason() -> None:
    limiter = TenantLimiter(1000, FakeClock())
    tokens = [
        t async for t in meter(limiter).metered(tenant(tokens_per_window=3), worker_tokens(3, []))
    ]
    assert tokens[-1].finish_reason == token_pb2.FINISH_REASON_LENGTH


async def test_a_stream_whose_quota_another_used_up_ends_with_a_message_that_is_no_token() -> None:
    limiter = TenantLimiter(1000, FakeClock())
    quota = tenant(tokens_per_window=4)
    first = meter(limiter).metered(quota, worker_tokens(100, []))
    second = meter(limiter).metered(quota, worker_tokens(100, []))
    assert (await anext(first)).index == 0
    assert (await anext(second)).index == 0
    assert (await anext(first)).index == 1
    last = await anext(second)  # the fourth token charged: the quota is used up
    assert last.finish_reason == token_pb2.FINISH_REASON_QUOTA_EXHAUSTED
    end = await anext(first)
    assert end.finish_reason == token_pb2.FINISH_REASON_QUOTA_EXHAUSTED
    assert (end.index, end.token_id, end.text, end.usage.completion_tokens) == (2, -1, "", 2)
    with pytest.raises(StopAsyncIteration):
        await anext(first)


async def two_choices(count: int) -> AsyncGenerator[token_pb2.Token, None]:
    """A worker's stream of two choices, interleaved one token at a time."""
    for index in range(count):
        for choice in (0, 1):
            yield token_pb2.Token(index=index, token_ids=[index], text="x", choice=choice)


async def test_every_choice_is_charged_and_the_quota_ends_the_stream_with_all_counted() -> None:
    limiter = TenantLimiter(1000, FakeClock())
    quota = tenant(tokens_per_window=5)
    tokens = [t async for t in meter(limiter).metered(quota, two_choices(100))]
    assert [(t.choice, t.index) for t in tokens] == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2)]
    assert tokens[-1].finish_reason == token_pb2.FINISH_REASON_QUOTA_EXHAUSTED
    assert tokens[-1].usage.completion_tokens == 5
    assert limiter.quota_left(quota) == 0


# ---- refusals through the interceptor chain, on an in-process server


class Streams(inference_pb2_grpc.InferenceServiceServicer):
    """Generate streams until the caller goes away (holding a concurrency slot)."""

    async def Generate(self, request: Any, context: Any) -> AsyncIterator[token_pb2.Token]:
        index = 0
        while True:
            yield token_pb2.Token(index=index)
            index += 1
            await asyncio.sleep(0.05)

    async def GetEngineStats(self, request: Any, context: Any) -> inference_pb2.EngineStats:
        return inference_pb2.EngineStats()


class FixedTenant(aio.ServerInterceptor):
    """Stands in for AuthInterceptor: every RPC is the given tenant's."""

    def __init__(self, fixed: Tenant) -> None:
        self._tenant = fixed

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        async def admit(context: Any) -> None:
            enter_tenant(self._tenant)

        return admitted(await continuation(details), admit)


@pytest.fixture
async def limited() -> AsyncIterator[inference_pb2_grpc.InferenceServiceStub]:
    registry = CollectorRegistry()
    # One request drips out of the bucket in 20 s: none during the test, however slow.
    limits = tenant(requests_per_second=0.05, burst=3, max_concurrent_streams=1)
    inner = (
        FixedTenant(limits),
        LimitsInterceptor(TenantLimiter(1000), TenantMetrics(registry, lambda: {"acme"})),
    )
    server = aio.server(interceptors=standard_interceptors(registry, None, inner))
    inference_pb2_grpc.add_InferenceServiceServicer_to_server(Streams(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield inference_pb2_grpc.InferenceServiceStub(channel)
    await server.stop(0)


async def test_refusals_are_resource_exhausted_with_retry_after_ms(limited) -> None:
    stream = limited.Generate(inference_pb2.InferenceRequest())
    await stream.read()  # holds the only concurrent slot
    with pytest.raises(aio.AioRpcError) as error:
        await limited.Generate(inference_pb2.InferenceRequest()).read()
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error.value.details() == "tenant concurrent stream limit 1 reached"
    assert dict(error.value.trailing_metadata())[RETRY_AFTER_HEADER] == "1000"
    stream.cancel()
    # Once the server has seen the cancel the slot is free (refusals at the concurrency limit
    # take nothing from the rate bucket, so polling costs nothing).
    deadline = time.monotonic() + PROMPTLY
    while True:
        try:
            await limited.GetEngineStats(inference_pb2.EngineStatsRequest())  # 2nd of 3
            break
        except aio.AioRpcError as refused:
            assert refused.details() == "tenant concurrent stream limit 1 reached"
            assert time.monotonic() < deadline, "the cancelled stream kept its slot"
            await asyncio.sleep(0.02)
    await limited.GetEngineStats(inference_pb2.EngineStatsRequest())  # 3rd of a burst of 3
    with pytest.raises(aio.AioRpcError) as error:
        await limited.GetEngineStats(inference_pb2.EngineStatsRequest())
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error.value.details() == "tenant request rate limit 0.05/s exceeded"
    assert dict(error.value.trailing_metadata())[RETRY_AFTER_HEADER] == "20000"
