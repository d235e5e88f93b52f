"""WorkerAdmin RPC handlers: one engine's adapters added, unloaded and forgotten at run time
(the control plane's AdapterAdmin calls them on every worker of a pool; decision 0034)."""

from __future__ import annotations

from pathlib import Path

from grpc import aio

from tokenmesh.common.errors import FailedPrecondition, InvalidArgument
from tokenmesh.v1 import admin_pb2, admin_pb2_grpc
from tokenmesh.worker.config import WorkerSettings
from tokenmesh.worker.engine import EngineSlot, VllmEngine


class WorkerAdminServicer(admin_pb2_grpc.WorkerAdminServicer):
    def __init__(self, slot: EngineSlot, settings: WorkerSettings) -> None:
        self._slot = slot
        self._frontends = settings.frontends

    def _engine(self, request: admin_pb2.WorkerAdapterRequest) -> VllmEngine:
        if self._frontends > 1:
            # Each front end keeps its own list of adapters; a call reaches one of them.
            raise FailedPrecondition(
                f"adapters at run time need a worker with one front end; this one has "
                f"frontends={self._frontends}"
            )
        if not request.name:
            raise InvalidArgument("name", "required: the adapter's name")
        return self._slot.get()

    async def LoadAdapter(
        self, request: admin_pb2.WorkerAdapterRequest, context: aio.ServicerContext
    ) -> admin_pb2.WorkerAdapterReply:
        engine = self._engine(request)
        if not request.directory:
            raise InvalidArgument("directory", "required: the adapter's directory on the worker")
        adapter_id, new = await engine.add_adapter(request.name, Path(request.directory))
        return admin_pb2.WorkerAdapterReply(changed=new, held=True, adapter_id=adapter_id)

    async def UnloadAdapter(
        self, request: admin_pb2.WorkerAdapterRequest, context: aio.ServicerContext
    ) -> admin_pb2.WorkerAdapterReply:
        engine = self._engine(request)
        held = await engine.unload_adapter(request.name)
        return admin_pb2.WorkerAdapterReply(changed=held, held=False)

    async def ForgetAdapter(
        self, request: admin_pb2.WorkerAdapterRequest, context: aio.ServicerContext
    ) -> admin_pb2.WorkerAdapterReply:
        await self._engine(request).forget_adapter(request.name)
        return admin_pb2.WorkerAdapterReply(changed=True, held=False)
