"""Per-tenant limits: request rate, concurrent streams, generated-token quota; refusals are fast."""

# Each gateway replica counts on its own (no shared store on the request path): a tenant's
# effective limits are its configured ones times the number of replicas. Divide by the replica
# count, or put a global limit in front (Envoy's global rate limit service) where that matters.

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

import grpc
from aiolimiter import AsyncLimiter
from grpc import aio

from tokenmesh.common.errors import ResourceExhausted
from tokenmesh.common.interceptors import admitted
from tokenmesh.common.tenants import Limits, Tenant, current_tenant
from tokenmesh.gateway.core.tenancy.metrics import TenantMetrics


def _number(value: float) -> str:
    """A limit as people write it: 5, 0.5, 86400 (not 8.64e+04)."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


class LimitExceeded(ResourceExhausted):
    """A tenant limit refused a request; `outcome` is its metrics label."""

    def __init__(self, outcome: str, message: str, retry_after_ms: int) -> None:
        super().__init__(message, retry_after_ms)
        self.outcome = outcome


class Charge(NamedTuple):
    """What charging generated tokens did: whether they fitted in the quota (nothing is charged
    when they do not), and the tokens left after it (None: the tenant has no quota)."""

    fitted: bool
    left: int | None


@dataclass
class _TenantState:
    limits: Limits
    # aiolimiter's leaky bucket; it never waits here: acquired only when it has capacity.
    rate: AsyncLimiter | None
    in_flight: int = 0
    # The quota's fixed window (its index since the epoch) and the tokens charged in it.
    window: int = -1
    used: int = 0


def _bucket(limits: Limits) -> AsyncLimiter | None:
    size = limits.bucket_size
    if size is None or limits.requests_per_second is None:
        return None
    # max_rate per time_period drains at requests_per_second and holds `size` at most.
    return AsyncLimiter(size, size / limits.requests_per_second)


class TenantLimiter:
    """Every tenant's counters, in one process. Limits come with the tenant, so a reloaded keys
    file applies at the tenant's next request: a changed rate starts a fresh bucket, streams in
    flight and tokens used in the window are kept."""

    def __init__(
        self, concurrency_retry_after_ms: int, clock: Callable[[], float] = time.time
    ) -> None:
        self._concurrency_retry_after_ms = concurrency_retry_after_ms
        # Wall-clock seconds: quota windows align to the epoch on every replica.
        self._clock = clock
        self._states: dict[str, _TenantState] = {}

    def _state(self, tenant: Tenant) -> _TenantState:
        state = self._states.get(tenant.id)
        if state is None:
            state = self._states[tenant.id] = _TenantState(tenant.limits, _bucket(tenant.limits))
        elif state.limits != tenant.limits:
            old, state.limits = state.limits, tenant.limits
            if (old.requests_per_second, old.bucket_size) != (
                tenant.limits.requests_per_second,
                tenant.limits.bucket_size,
            ):
                state.rate = _bucket(tenant.limits)
            if old.window_seconds != tenant.limits.window_seconds:
                state.window, state.used = -1, 0
        return state

    def _roll(self, state: _TenantState) -> float:
        """Start a new quota window if the last one is over; the seconds left in this one."""
        now = self._clock()
        window_seconds = state.limits.window_seconds
        window = math.floor(now / window_seconds)
        if window != state.window:
            state.window, state.used = window, 0
        return (window + 1) * window_seconds - now

    def quota_left(self, tenant: Tenant) -> int | None:
        """Tokens the tenant may still generate in this window (None: no quota)."""
        state = self._state(tenant)
        quota = state.limits.tokens_per_window
        if quota is None:
            return None
        self._roll(state)
        return max(quota - state.used, 0)

    def check_quota(self, tenant: Tenant) -> None:
        """LimitExceeded (quota_exhausted) when the tenant has no tokens left."""
        state = self._state(tenant)
        quota = state.limits.tokens_per_window
        if quota is None:
            return
        seconds_left = self._roll(state)
        if state.used >= quota:
            raise LimitExceeded(
                "quota_exhausted",
                f"tenant token quota {quota} per {_number(state.limits.window_seconds)}s used up",
                math.ceil(seconds_left * 1000),
            )

    def charge(self, tenant: Tenant, tokens: int = 1) -> Charge:
        """Charge generated tokens to the tenant's quota, saying in the same look-up what is
        left (the quota meter asks after every token)."""
        state = self._state(tenant)
        quota = state.limits.tokens_per_window
        if quota is None:
            return Charge(True, None)
        self._roll(state)
        if state.used + tokens > quota:
            return Charge(False, quota - state.used)
        state.used += tokens
        return Charge(True, quota - state.used)

    async def admit(self, tenant: Tenant) -> None:
        """Count a new RPC of the tenant in, or refuse it at once with LimitExceeded: at its
        concurrent-stream limit, out of token quota, or over its request rate. Never waits.
        Each admitted RPC must be let out with release()."""
        state = self._state(tenant)
        limits = state.limits
        at_most = limits.max_concurrent_streams
        if at_most is not None and state.in_flight >= at_most:
            raise LimitExceeded(
                "concurrency_limited",
                f"tenant concurrent stream limit {at_most} reached",
                self._concurrency_retry_after_ms,
            )
        self.check_quota(tenant)
        if state.rate is not None and limits.requests_per_second is not None:
            if not state.rate.has_capacity():
                # The bucket is at most one request over: one drips out in 1/rate seconds.
                raise LimitExceeded(
                    "rate_limited",
                    f"tenant request rate limit {_number(limits.requests_per_second)}/s exceeded",
                    math.ceil(1000 / limits.requests_per_second),
                )
            # Has capacity, so this returns without waiting (no await point before the take).
            await state.rate.acquire()
        state.in_flight += 1

    def release(self, tenant: Tenant) -> None:
        state = self._states.get(tenant.id)
        if state is not None and state.in_flight > 0:
            state.in_flight -= 1


async def admit_counted(
    limiter: TenantLimiter, metrics: TenantMetrics, tenant: Tenant
) -> Callable[[], None]:
    """Admit a request of the tenant (LimitExceeded if refused), counted in its metrics; returns
    what lets it out. Every API's requests, gRPC or HTTP, come in here."""
    try:
        await limiter.admit(tenant)
    except LimitExceeded as refused:
        metrics.request(tenant, refused.outcome)
        raise
    metrics.request(tenant, "admitted")
    return partial(limiter.release, tenant)


class LimitsInterceptor(aio.ServerInterceptor):
    """Admits each RPC of an authenticated tenant against its limits (after AuthInterceptor,
    inside error mapping); RPCs without a tenant (open methods) pass. A refusal is
    RESOURCE_EXHAUSTED naming the limit, with retry-after-ms in the trailers."""

    def __init__(self, limiter: TenantLimiter, metrics: TenantMetrics) -> None:
        self._limiter = limiter
        self._metrics = metrics

    async def _admit(self, context: aio.ServicerContext[Any, Any]) -> Callable[[], None] | None:
        tenant = current_tenant()
        if tenant is None:
            return None
        return await admit_counted(self._limiter, self._metrics, tenant)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        return None if handler is None else admitted(handler, self._admit)
