"""Tenant identity: who is calling (a contextvar per RPC) and its limits."""

from __future__ import annotations

import math
from contextvars import ContextVar
from dataclasses import dataclass, field

from opentelemetry import trace
from pydantic import BaseModel, ConfigDict, Field

# Metadata the gateway sets on its calls to workers: the authenticated tenant. Services behind
# the gateway trust it (only gateways reach them: Envoy's internal listeners, NetworkPolicies);
# the gateway never forwards a caller's own x-tenant-id.
TENANT_HEADER = "x-tenant-id"
# Span attribute naming the tenant, on the gateway's and the worker's server spans.
TENANT_ATTRIBUTE = "tokenmesh.tenant"


class Limits(BaseModel):
    """One tenant's limits; None means unlimited. A tenant's own block overrides the keys
    file's defaults field by field."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # Sustained requests (RPCs) per second, a token bucket (aiolimiter's leaky bucket) ...
    requests_per_second: float | None = Field(default=None, gt=0)
    # ... that holds this many requests, so a burst of up to `burst` goes through at once
    # (default: requests_per_second rounded up).
    burst: int | None = Field(default=None, ge=1)
    # RPCs in progress at once (a stream counts until it ends; a Chat stream is one).
    max_concurrent_streams: int | None = Field(default=None, ge=1)
    # Generated tokens per fixed window of window_seconds (aligned to the Unix epoch, so every
    # gateway replica's windows start together), charged as each token streams.
    tokens_per_window: int | None = Field(default=None, ge=1)
    window_seconds: float = Field(default=60.0, gt=0)
    # The models and adapters (by the names requests give them) the tenant may use; None: all
    # the mesh serves. Others are PERMISSION_DENIED (403), and /v1/models lists only these.
    models: frozenset[str] | None = Field(default=None, min_length=1)

    @property
    def bucket_size(self) -> int | None:
        """Requests the token bucket holds (None: no rate limit)."""
        if self.requests_per_second is None:
            return None
        return self.burst or max(1, math.ceil(self.requests_per_second))


@dataclass(frozen=True)
class Tenant:
    """An authenticated caller: its id (from the keys file) and its resolved limits."""

    id: str
    limits: Limits = field(default_factory=Limits)


_CURRENT: ContextVar[Tenant | None] = ContextVar("tokenmesh_tenant", default=None)


def current_tenant() -> Tenant | None:
    """The tenant of the RPC being handled: set by AuthInterceptor (gateway) or
    TenantMetadataInterceptor (services behind it); None when auth is off or the method open."""
    return _CURRENT.get()


def enter_tenant(tenant: Tenant) -> None:
    """Make tenant the current RPC's, and name it on the RPC's server span. Each RPC runs in
    a task (so a contextvars Context) of its own: nothing leaks into other RPCs."""
    _CURRENT.set(tenant)
    trace.get_current_span().set_attribute(TENANT_ATTRIBUTE, tenant.id)


def tenant_models() -> frozenset[str] | None:
    """The models the current RPC's tenant may use; None: any (all of them, or auth off)."""
    tenant = current_tenant()
    return None if tenant is None else tenant.limits.models
