"""The models the workers serve, pool by pool, and their LoRA adapters: what a request's `model`
may name, which pool serves it, and what the OpenAI API lists."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import grpc

from tokenmesh.common.channels import Dependency
from tokenmesh.common.errors import DependencyError, NotFound, PermissionDenied
from tokenmesh.common.pools import POOL_HEADER, pool_cluster
from tokenmesh.common.sampling import SamplingLimits
from tokenmesh.common.validation import check_text
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc

# How long what a pool serves is trusted before its workers are asked again.
MODEL_NAME_TTL_SECONDS = 30.0
# A name no pool serves asks them again, at most this often: an adapter loaded at run time
# is served at once, and a flood of unknown names costs the workers one call a second.
MISS_REFRESH_SECONDS = 1.0


class ModelNotFound(NotFound):
    field = "model"


class ModelDenied(PermissionDenied):
    field = "model"


@dataclass(frozen=True)
class Served:
    """Where a request's model is served: its name (the pool's model for an empty one), its
    pool ("" the default) and the adapter the worker answers with ("" the model itself)."""

    name: str
    pool: str = ""
    adapter: str = ""

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The header that routes a call to the pool's workers (none for the default)."""
        return pool_metadata(self.pool)


def pool_metadata(pool: str) -> tuple[tuple[str, str], ...]:
    return ((POOL_HEADER, pool),) if pool else ()


@dataclass(frozen=True)
class ModelCard:
    """A model as /v1/models lists it: an adapter with the model it adapts as its parent."""

    name: str
    parent: str | None
    max_model_len: int


@dataclass
class _Pool:
    """What one pool's workers said they serve, and when; model None until one answered."""

    name: str
    model: str | None = None
    adapters: tuple[str, ...] = ()
    max_model_len: int = 0
    asked: float = -1e18
    # Why its workers did not answer the last time, if they did not.
    error: str = ""
    code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE
    failed: float = -1e18

    def due(self, now: float, older_than: float) -> bool:
        """Its answer is older than `older_than`, and its workers did not just fail to answer
        (a silent pool is asked again at most once a second, not by every request)."""
        return now - self.asked > older_than and now - self.failed > MISS_REFRESH_SECONDS

    def serves(self) -> tuple[str, ...]:
        return () if self.model is None else (self.model, *self.adapters)


class ModelCatalog:
    """What each pool's workers serve (their served_model_name and adapters), asked of a worker
    of each pool through the mesh and cached; the default pool's model is the mesh's model,
    which an empty `model` means. A name served by two pools is the first's (the default,
    then worker_pools' order)."""

    def __init__(
        self,
        worker: Dependency,
        timeout: float,
        pools: Sequence[str] = (),
        max_name_bytes: int = SamplingLimits().max_model_name_bytes,
    ) -> None:
        self._stub = inference_pb2_grpc.InferenceServiceStub(worker.channel)
        self._timeout = timeout
        self._max_name_bytes = max_name_bytes
        self._pools = [_Pool(name) for name in ("", *pools)]
        self._asking: asyncio.Future[None] | None = None

    async def _refresh(self, older_than: float) -> None:
        """Ask every pool whose answer is older than `older_than` seconds, once for all who
        wait: asks in flight are shared, and one made for a longer age is followed by one of
        our own if it left a pool we need asked."""
        for _ in range(2):
            now = time.monotonic()
            if not any(pool.due(now, older_than) for pool in self._pools):
                return
            asking, ours = self._asking, self._asking is None
            if asking is None:
                asking = self._asking = asyncio.ensure_future(self._ask_all(older_than))
                asking.add_done_callback(lambda _: setattr(self, "_asking", None))
            await asyncio.shield(asking)
            if ours:
                return

    async def _ask_all(self, older_than: float) -> None:
        now = time.monotonic()
        await asyncio.gather(
            *(self._ask(pool) for pool in self._pools if pool.due(now, older_than))
        )

    async def _ask(self, pool: _Pool) -> None:
        try:
            stats = await self._stub.GetEngineStats(
                inference_pb2.EngineStatsRequest(),
                timeout=self._timeout,
                metadata=pool_metadata(pool.name),
            )
        except grpc.aio.AioRpcError as exc:
            # The last answer stands while no worker answers; the next request asks again.
            pool.error = exc.details() or exc.code().name
            pool.code, pool.failed = exc.code(), time.monotonic()
            return
        pool.model, pool.adapters = stats.model, tuple(stats.adapters)
        pool.max_model_len, pool.asked, pool.error = stats.max_model_len, time.monotonic(), ""

    def _unanswered(self) -> DependencyError | None:
        """Why some pool's workers never answered (what they serve is unknown), if one did not."""
        for pool in self._pools:
            if pool.model is None:
                return DependencyError(
                    pool.code,
                    f"no worker answered for the models the pool {pool_cluster(pool.name)} "
                    f"serves: {pool.error or 'not asked yet'}",
                )
        return None

    async def name(self) -> str:
        """The mesh's model: the default pool's, which an empty `model` names."""
        await self._refresh(MODEL_NAME_TTL_SECONDS)
        default = self._pools[0]
        if default.model is None:
            raise DependencyError(
                default.code,
                f"no worker answered for the model's name: {default.error}",
            )
        return default.model

    def _find(self, requested: str) -> Served | None:
        for pool in self._pools:
            if requested == pool.model:
                return Served(requested, pool.name)
            if requested in pool.adapters:
                return Served(requested, pool.name, requested)
        return None

    async def resolve(self, requested: str, allowed: Collection[str] | None = None) -> Served:
        """Where the model a request names is served (an empty name: the mesh's model), if the
        mesh serves it (ModelNotFound naming what it serves otherwise) and, for a tenant limited
        to some models (allowed), it is one of them (ModelDenied naming those)."""
        if not requested and allowed is None:
            return Served("")  # the mesh's model, for anyone: nothing to check or ask
        # Every path's model names come here: a name over the cap is refused naming the field,
        # before a refusal below would repeat it.
        check_text("model", requested, self._max_name_bytes, required=False)
        requested = requested or await self.name()
        await self._refresh(MODEL_NAME_TTL_SECONDS)
        served = self._find(requested)
        if served is None:
            # Perhaps loaded since: the pools are asked again (at most once a second).
            await self._refresh(MISS_REFRESH_SECONDS)
            served = self._find(requested)
        if served is None:
            unknown = self._unanswered()
            if unknown is not None:
                raise unknown  # a pool that never answered may serve it
            names = ", ".join(repr(name) for name in self.served())
            raise ModelNotFound(f"the model {requested!r} does not exist; this mesh serves {names}")
        if allowed is not None and requested not in allowed:
            raise ModelDenied(
                f"this API key's tenant may not use the model {requested!r}; it may use "
                + ", ".join(repr(model) for model in sorted(allowed))
            )
        return served

    def served(self) -> list[str]:
        """Every model and adapter the pools last listed, in pool order, each once."""
        return list(dict.fromkeys(name for pool in self._pools for name in pool.serves()))

    async def cards(self, allowed: Collection[str] | None) -> list[ModelCard]:
        """The models and their adapters (as /v1/models lists them) a tenant limited to
        `allowed` may use (all of them with None)."""
        await self.name()
        cards: dict[str, ModelCard] = {}
        for pool in self._pools:
            if pool.model is None:
                continue
            for name in pool.serves():
                parent = None if name == pool.model else pool.model
                if name not in cards and (allowed is None or name in allowed):
                    cards[name] = ModelCard(name, parent, pool.max_model_len)
        return list(cards.values())
