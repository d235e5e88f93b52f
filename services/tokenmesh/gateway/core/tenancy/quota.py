"""Token quotas: tokens are charged as they stream; the stream ends when the quota runs out."""

from __future__ import annotations

from collections.abc import AsyncGenerator

from tokenmesh.common.tenants import Tenant
from tokenmesh.common.tokens import cut, ends_stream, token_count
from tokenmesh.gateway.core.tenancy.limits import TenantLimiter
from tokenmesh.gateway.core.tenancy.metrics import TenantMetrics
from tokenmesh.v1 import token_pb2


class QuotaMeter:
    """Every token from a worker is charged before it goes on, whichever RPC it is for
    (Generate, GetAnswer, Summarize, a Chat turn), so one long request cannot overrun the
    quota; a message of several tokens is cut after the last that fits. The token that uses
    the last of it ends the stream: it carries
    FINISH_REASON_QUOTA_EXHAUSTED (unless it was the generation's own last token), and closing
    the worker stream cancels the worker call, which aborts the engine request."""

    def __init__(self, limiter: TenantLimiter, metrics: TenantMetrics) -> None:
        self._limiter = limiter
        self._metrics = metrics

    async def metered(
        self, tenant: Tenant, tokens: AsyncGenerator[token_pb2.Token, None]
    ) -> AsyncGenerator[token_pb2.Token, None]:
        # Before the worker is called (it is called on the first read of `tokens`): a tenant
        # with nothing left gets RESOURCE_EXHAUSTED and retry-after-ms, e.g. a Chat turn.
        self._limiter.check_quota(tenant)
        # Tokens of every choice charged so far: the usage of a stream the quota ends.
        charged = 0
        try:
            async for token in tokens:
                count = token_count(token)
                charge = self._limiter.charge(tenant, count)
                if not charge.fitted:
                    # The message holds more tokens than are left: its first ones, up to the
                    # quota, end the stream; none left (another stream of the tenant used the
                    # rest): a message that is not a token ends it, like the worker's end.
                    self._metrics.quota_cutoff(tenant)
                    left = charge.left or 0
                    if left and self._limiter.charge(tenant, left).fitted:
                        self._metrics.tokens(tenant, left)
                        last = cut(token, left)
                        last.finish_reason = token_pb2.FINISH_REASON_QUOTA_EXHAUSTED
                        last.usage.completion_tokens = charged + left
                        yield last
                    else:
                        yield self._end(token, charged)
                    return
                self._metrics.tokens(tenant, count)
                charged += count
                if not ends_stream(token) and charge.left == 0:
                    # The last of the quota: this message ends the stream (and its choice, unless
                    # that ended here anyway).
                    self._metrics.quota_cutoff(tenant)
                    if not token.finish_reason:
                        token.finish_reason = token_pb2.FINISH_REASON_QUOTA_EXHAUSTED
                    token.usage.completion_tokens = charged
                    yield token
                    return
                yield token
        finally:
            await tokens.aclose()

    @staticmethod
    def _end(token: token_pb2.Token, charged: int) -> token_pb2.Token:
        """A message that holds no token and ends the stream (of token's choice, where it would
        have gone)."""
        end = token_pb2.Token(
            index=token.index,
            token_id=-1,
            choice=token.choice,
            finish_reason=token_pb2.FINISH_REASON_QUOTA_EXHAUSTED,
            emitted_unix_nanos=token.emitted_unix_nanos,
        )
        end.usage.completion_tokens = charged
        return end
