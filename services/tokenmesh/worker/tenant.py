"""The tenant the gateway named on a call (x-tenant-id), made the RPC's for its log and span."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import grpc
from grpc import aio

from tokenmesh.common.interceptors import with_tenant
from tokenmesh.common.tenants import TENANT_HEADER, Tenant


class TenantMetadataInterceptor(aio.ServerInterceptor):
    """For services behind the gateway (workers): the tenant the gateway named in
    x-tenant-id becomes the RPC's, for its log line and server span. The gateway enforced the
    limits; none apply here."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        metadata = handler_call_details.invocation_metadata or ()
        tenant_id = next((str(v) for k, v in metadata if k == TENANT_HEADER), None)
        if handler is None or not tenant_id:
            return handler
        tenant = Tenant(tenant_id)
        return with_tenant(handler, lambda context: tenant)
