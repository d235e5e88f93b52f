"""A prepared call's tokens, streamed from a worker through the gateway (the gateway token
path: the Chat RPC, tenants' token quotas, gRPC-Web, GetAnswer and Summarize)."""

from __future__ import annotations

from collections.abc import AsyncGenerator

from tokenmesh.common.tenants import TENANT_HEADER, current_tenant
from tokenmesh.gateway.config import GatewaySettings
from tokenmesh.gateway.core.documents import remaining_after_margin
from tokenmesh.gateway.core.prepare import PreparedCall
from tokenmesh.gateway.core.tenancy.quota import QuotaMeter
from tokenmesh.gateway.core.workers import WorkerClient
from tokenmesh.v1 import token_pb2


class Pipeline:
    """Streams a prepared call's tokens from the worker Envoy chooses for it."""

    def __init__(
        self, worker: WorkerClient, settings: GatewaySettings, meter: QuotaMeter | None = None
    ) -> None:
        self._worker = worker
        self._margin = settings.deadline_margin_seconds
        # Token quotas (auth on); None: tokens are not metered.
        self._meter = meter

    @property
    def metered(self) -> bool:
        """Whether tokens are charged to quotas (then the gateway must see every token)."""
        return self._meter is not None

    def stream(
        self, call: PreparedCall, remaining: float | None
    ) -> AsyncGenerator[token_pb2.Token, None]:
        """The worker's tokens. For the RPC's tenant (set by the auth interceptor in the RPC's
        context; none with auth off), they are charged to its quota and the worker is told
        whose request it is (x-tenant-id: the gateway's own metadata, never a caller's); the
        call's routing headers go with it for Envoy's choice of worker."""
        tenant = current_tenant()
        time_limit = remaining_after_margin(remaining, self._margin)
        metadata = call.routing_headers()
        if tenant is not None:
            metadata.append((TENANT_HEADER, tenant.id))
        tokens = self._worker.stream(call.request, time_limit, tuple(metadata))
        if tenant is None or self._meter is None:
            return tokens
        return self._meter.metered(tenant, tokens)
