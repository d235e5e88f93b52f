"""The adapter admin API (tokenmesh.v1.AdapterAdmin, keyed): LoRA adapters loaded, unloaded
and forgotten at run time on every worker of a pool, each worker's result reported; loads and
forgets remembered and applied to workers that join or restart later (decision 0034)."""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
from grpc import aio

from tokenmesh.common.errors import (
    DependencyError,
    InvalidArgument,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
)
from tokenmesh.common.pools import pool_cluster, pool_names
from tokenmesh.controlplane.ops import GrpcWorkerProbe
from tokenmesh.controlplane.snapshots import SnapshotCache, worker_addresses
from tokenmesh.v1 import admin_pb2, admin_pb2_grpc, inference_pb2, inference_pb2_grpc

log = logging.getLogger(__name__)

KEYS_SETTING = "TOKENMESH_CONTROLPLANE_ADMIN_KEYS_FILE"


def cluster_of(pool: str) -> str:
    """The Envoy cluster of a worker pool ("" is the default workers'), InvalidArgument naming
    the field for a name no pool can have."""
    try:
        pool_names([pool] if pool else [])
    except ValueError as error:
        raise InvalidArgument("pool", str(error)) from None
    return pool_cluster(pool)


def read_keys(path: Path) -> tuple[bytes, ...]:
    """The admin keys: one a line; blank lines and lines starting with # are skipped."""
    lines = (line.strip() for line in path.read_text().splitlines())
    keys = tuple(line.encode() for line in lines if line and not line.startswith("#"))
    if not keys:
        raise ValueError(f"admin_keys_file: {path} holds no key (one key a line)")
    return keys


class AdminKeys:
    """Who may call the admin API: `authorization: Bearer <key>` with a key of the file, which
    is read again when it changes (a key rotated in place; a malformed edit keeps the last good
    keys). Without a file, the API is off."""

    def __init__(self, path: Path | None) -> None:
        self._path = path
        self._keys: tuple[bytes, ...] = ()
        self._seen: tuple[int, int, int] | None = None
        if path is not None:
            self._reload()

    def _reload(self) -> None:
        assert self._path is not None
        stat = self._path.stat()
        seen = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
        if seen != self._seen:
            self._keys, self._seen = read_keys(self._path), seen

    def check(self, metadata: Sequence[tuple[str, Any]] | None) -> None:
        """Raises unless the call carries one of the keys; every key is compared, each in
        constant time."""
        if self._path is None:
            raise PermissionDenied(
                f"the adapter admin API is off: set {KEYS_SETTING} to a file of admin keys "
                "(one a line) on the control plane to turn it on"
            )
        try:
            self._reload()
        except (OSError, ValueError) as error:
            log.error(
                "admin keys file unreadable; the last keys stand", extra={"error": str(error)}
            )
        given = b""
        for header, value in metadata or ():
            if header == "authorization":
                text = value.decode() if isinstance(value, bytes) else str(value)
                scheme, _, token = text.partition(" ")
                if scheme.lower() == "bearer":
                    given = token.strip().encode()
        found = False
        for key in self._keys:
            found |= hmac.compare_digest(key, given)
        if not given or not found:
            raise Unauthenticated("the adapter admin API needs `authorization: Bearer <admin key>`")


class AdapterFleet:
    """The adapter calls applied to every worker of a pool (the endpoints discovery gives its
    cluster), and the run-time changes it remembers: each cluster's wanted adapters (a
    directory: loaded; None: forgotten), applied again to workers that lack them whenever
    discovery changes and every reconcile_seconds (a worker that joined, or restarted without
    them)."""

    def __init__(self, cache: SnapshotCache, workers: GrpcWorkerProbe, timeout: float) -> None:
        self._cache = cache
        self._workers = workers
        self._timeout = timeout
        self._wanted: dict[str, dict[str, str | None]] = {}
        # One change at a time, calls and reconciling alike.
        self._lock = asyncio.Lock()

    def addresses(self, cluster: str) -> list[str]:
        current = self._cache.current
        return [str(endpoint) for endpoint in current.clusters.get(cluster, ())] if current else []

    async def _retain(self) -> None:
        """Channels to the workers of every worker cluster only."""
        await self._workers.retain(list(worker_addresses(self._cache)))

    async def _call(
        self, address: str, method: str, name: str, directory: str = ""
    ) -> admin_pb2.WorkerAdapterResult:
        stub = admin_pb2_grpc.WorkerAdminStub(self._workers.channel(address))
        request = admin_pb2.WorkerAdapterRequest(name=name, directory=directory)
        try:
            reply = await getattr(stub, method)(request, timeout=self._timeout)
        except aio.AioRpcError as error:
            return admin_pb2.WorkerAdapterResult(
                address=address, code=error.code().name, message=error.details() or ""
            )
        return admin_pb2.WorkerAdapterResult(address=address, code="OK", held=reply.held)

    async def _apply(
        self, cluster: str, method: str, name: str, directory: str = ""
    ) -> admin_pb2.AdapterAdminReply:
        """The call on every worker of the cluster at once. Fails only when every worker
        failed (with the first one's status) or the cluster has none."""
        addresses = self.addresses(cluster)
        if not addresses:
            raise Unavailable(
                f"pool: the cluster {cluster!r} has no workers (discovery lists none)"
            )
        await self._retain()
        results = await asyncio.gather(
            *(self._call(address, method, name, directory) for address in addresses)
        )
        reply = admin_pb2.AdapterAdminReply(cluster=cluster, workers=results)
        log.info(
            "adapter admin call",
            extra={
                "method": method,
                "adapter": name,
                "cluster": cluster,
                "results": {result.address: result.code for result in results},
            },
        )
        failed = [result for result in results if result.code != "OK"]
        if len(failed) == len(results):
            first = failed[0]
            raise DependencyError(
                grpc.StatusCode[first.code],
                f"{len(failed)} of {len(results)} workers failed; worker {first.address}: "
                f"{first.message}",
            )
        return reply

    async def load(self, pool: str, name: str, directory: str) -> admin_pb2.AdapterAdminReply:
        cluster = cluster_of(pool)
        async with self._lock:
            reply = await self._apply(cluster, "LoadAdapter", name, directory)
            self._wanted.setdefault(cluster, {})[name] = directory
        return reply

    async def unload(self, pool: str, name: str) -> admin_pb2.AdapterAdminReply:
        async with self._lock:
            return await self._apply(cluster_of(pool), "UnloadAdapter", name)

    async def forget(self, pool: str, name: str) -> admin_pb2.AdapterAdminReply:
        cluster = cluster_of(pool)
        async with self._lock:
            reply = await self._apply(cluster, "ForgetAdapter", name)
            self._wanted.setdefault(cluster, {})[name] = None
        return reply

    def remembered(self, pool: str) -> list[admin_pb2.RememberedAdapter]:
        return [
            admin_pb2.RememberedAdapter(
                name=name, directory=directory or "", forgotten=directory is None
            )
            for name, directory in self._wanted.get(cluster_of(pool), {}).items()
        ]

    async def stats(self, address: str) -> inference_pb2.EngineStats | str:
        """A worker's EngineStats, or why it gave none."""
        stub = inference_pb2_grpc.InferenceServiceStub(self._workers.channel(address))
        try:
            stats: inference_pb2.EngineStats = await stub.GetEngineStats(
                inference_pb2.EngineStatsRequest(), timeout=self._timeout
            )
        except aio.AioRpcError as error:
            return f"{error.code().name}: {error.details()}"
        return stats

    async def reconcile(self) -> None:
        """Every worker of a cluster with remembered changes gets those it lacks."""
        async with self._lock:
            await self._retain()
            for cluster, wanted in self._wanted.items():
                for address in self.addresses(cluster):
                    stats = await self.stats(address)
                    if isinstance(stats, str):
                        continue  # not up yet: the next round
                    served = set(stats.adapters)
                    for name, directory in wanted.items():
                        if directory is not None and name not in served:
                            result = await self._call(address, "LoadAdapter", name, directory)
                        elif directory is None and name in served:
                            result = await self._call(address, "ForgetAdapter", name)
                        else:
                            continue
                        log.log(
                            logging.INFO if result.code == "OK" else logging.WARNING,
                            "adapter reconciled",
                            extra={
                                "adapter": name,
                                "worker": address,
                                "forgotten": directory is None,
                                "code": result.code,
                                "error": result.message,
                            },
                        )

    async def keep_reconciled(self, interval: float) -> None:
        """Reconcile whenever discovery changes and every interval seconds, until shutdown."""
        with self._cache.subscribe() as changes:
            while True:
                try:
                    if await asyncio.wait_for(changes.get(), interval) is None:
                        return  # the cache closed: shutting down
                except TimeoutError:
                    pass
                if self._wanted:
                    await self.reconcile()


class AdapterAdminServicer(admin_pb2_grpc.AdapterAdminServicer):
    def __init__(self, keys: AdminKeys, fleet: AdapterFleet) -> None:
        self._keys = keys
        self._fleet = fleet

    def _checked(self, request: Any, context: aio.ServicerContext, *needed: str) -> None:
        self._keys.check(context.invocation_metadata())
        for field in needed:
            if not getattr(request, field):
                raise InvalidArgument(field, "required")

    async def LoadAdapter(
        self, request: admin_pb2.AdapterAdminRequest, context: aio.ServicerContext
    ) -> admin_pb2.AdapterAdminReply:
        self._checked(request, context, "name", "directory")
        return await self._fleet.load(request.pool, request.name, request.directory)

    async def UnloadAdapter(
        self, request: admin_pb2.AdapterAdminRequest, context: aio.ServicerContext
    ) -> admin_pb2.AdapterAdminReply:
        self._checked(request, context, "name")
        return await self._fleet.unload(request.pool, request.name)

    async def ForgetAdapter(
        self, request: admin_pb2.AdapterAdminRequest, context: aio.ServicerContext
    ) -> admin_pb2.AdapterAdminReply:
        self._checked(request, context, "name")
        return await self._fleet.forget(request.pool, request.name)

    async def ListAdapters(
        self, request: admin_pb2.ListAdaptersRequest, context: aio.ServicerContext
    ) -> admin_pb2.ListAdaptersReply:
        self._checked(request, context)
        cluster = cluster_of(request.pool)
        addresses = self._fleet.addresses(cluster)
        replies = await asyncio.gather(*(self._fleet.stats(address) for address in addresses))
        workers = [
            admin_pb2.WorkerAdapters(address=address, error=stats)
            if isinstance(stats, str)
            else admin_pb2.WorkerAdapters(
                address=address, adapters=stats.adapters, held_adapters=stats.held_adapters
            )
            for address, stats in zip(addresses, replies, strict=True)
        ]
        return admin_pb2.ListAdaptersReply(
            cluster=cluster, remembered=self._fleet.remembered(request.pool), workers=workers
        )
