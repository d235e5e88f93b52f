"""API keys and tenant limits for HTTP requests: the gRPC interceptors' own checks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tokenmesh.common.tenants import enter_tenant
from tokenmesh.gateway.core.tenancy.auth import KeyStore, resolve_tenant
from tokenmesh.gateway.core.tenancy.limits import TenantLimiter, admit_counted
from tokenmesh.gateway.core.tenancy.metrics import TenantMetrics


@dataclass(frozen=True)
class HttpTenancy:
    """Authenticates and admits an HTTP request as the interceptors do a gRPC call."""

    store: KeyStore | None = None
    limiter: TenantLimiter | None = None
    metrics: TenantMetrics | None = None

    async def admit(self, headers: list[tuple[str, str]]) -> Callable[[], None] | None:
        """Authenticate and admit a request (the tenant becomes the request's); what lets it
        out, or None with keys off."""
        if self.store is None or self.metrics is None or self.limiter is None:
            return None
        tenant = resolve_tenant(self.store, headers, self.metrics)
        enter_tenant(tenant)
        return await admit_counted(self.limiter, self.metrics, tenant)
