"""The gateway's per-tenant counters, with a bounded tenant label."""

from __future__ import annotations

from collections.abc import Callable, Collection

from prometheus_client import CollectorRegistry, Counter

from tokenmesh.common.tenants import Tenant

# The metrics label value for everything that is not a tenant of the keys file.
OTHER_TENANT = "other"


class TenantMetrics:
    """tokenmesh_gateway_tenant_* counters. The tenant label is bounded: a tenant of the keys
    file as it is now, else `other`."""

    def __init__(self, registry: CollectorRegistry, known: Callable[[], Collection[str]]) -> None:
        self._known = known
        self._requests = Counter(
            "tokenmesh_gateway_tenant_requests",
            "RPCs by tenant and outcome: admitted, unauthenticated, rate_limited, "
            "concurrency_limited, quota_exhausted.",
            ["tenant", "outcome"],
            registry=registry,
        )
        self._tokens = Counter(
            "tokenmesh_gateway_tenant_tokens",
            "Generated tokens delivered, by tenant (what its token quota is charged).",
            ["tenant"],
            registry=registry,
        )
        self._quota_cutoffs = Counter(
            "tokenmesh_gateway_tenant_quota_cutoffs",
            "Streams ended early (FINISH_REASON_QUOTA_EXHAUSTED) by a tenant's token quota.",
            ["tenant"],
            registry=registry,
        )

    def label(self, tenant: Tenant | None) -> str:
        if tenant is not None and tenant.id in self._known():
            return tenant.id
        return OTHER_TENANT

    def request(self, tenant: Tenant | None, outcome: str) -> None:
        self._requests.labels(tenant=self.label(tenant), outcome=outcome).inc()

    def tokens(self, tenant: Tenant, count: int = 1) -> None:
        self._tokens.labels(tenant=self.label(tenant)).inc(count)

    def quota_cutoff(self, tenant: Tenant) -> None:
        self._quota_cutoffs.labels(tenant=self.label(tenant)).inc()
