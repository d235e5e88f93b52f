"""The model the workers serve and its LoRA adapters, as requests name them and the OpenAI API
lists them."""

from __future__ import annotations

import time
from collections.abc import Collection

import grpc

from tokenmesh.common.channels import Dependency
from tokenmesh.common.errors import DependencyError, NotFound, PermissionDenied
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc

# How long the served model's name is trusted before the workers are asked again.
MODEL_NAME_TTL_SECONDS = 30.0


class ModelNotFound(NotFound):
    field = "model"


class ModelDenied(PermissionDenied):
    field = "model"


class ModelCatalog:
    """The model the workers serve (their served_model_name) and its adapters, asked of a worker
    through the mesh and cached: what /v1/models lists and what a request's `model` must
    name."""

    def __init__(self, worker: Dependency, timeout: float) -> None:
        self._stub = inference_pb2_grpc.InferenceServiceStub(worker.channel)
        self._timeout = timeout
        self._name: str | None = None
        self._asked = 0.0
        self._max_model_len = 0
        self._adapters: tuple[str, ...] = ()

    async def name(self) -> str:
        if self._name is None or time.monotonic() - self._asked > MODEL_NAME_TTL_SECONDS:
            try:
                stats = await self._stub.GetEngineStats(
                    inference_pb2.EngineStatsRequest(), timeout=self._timeout
                )
            except grpc.aio.AioRpcError as exc:
                if self._name is not None:
                    return self._name  # the last answer stands while no worker answers
                raise DependencyError(
                    exc.code(), f"no worker answered for the model's name: {exc.details()}"
                ) from exc
            self._name, self._asked = stats.model, time.monotonic()
            self._max_model_len = stats.max_model_len
            self._adapters = tuple(stats.adapters)
        return self._name

    async def check(self, requested: str, allowed: Collection[str] | None = None) -> str:
        """The name a request gives, if the mesh serves it (the model, or one of its adapters;
        ModelNotFound naming what it serves otherwise) and, for a tenant limited to some
        models (allowed), it is one of them (ModelDenied naming those)."""
        served = await self.name()
        if requested != served and requested not in self._adapters:
            names = ", ".join(repr(name) for name in (served, *self._adapters))
            raise ModelNotFound(f"the model {requested!r} does not exist; this mesh serves {names}")
        if allowed is not None and requested not in allowed:
            raise ModelDenied(
                f"this API key's tenant may not use the model {requested!r}; it may use "
                + ", ".join(repr(model) for model in sorted(allowed))
            )
        return requested

    async def adapter_of(self, requested: str, allowed: Collection[str] | None = None) -> str:
        """The adapter a request's `model` names (the worker's InferenceRequest.model), "" for
        the model itself (or an empty name, which means it); checked as check() checks it."""
        name = await self.check(requested or await self.name(), allowed)
        return name if name in self._adapters else ""

    def visible(self, allowed: Collection[str] | None) -> list[str]:
        """The model and its adapters, as the workers last listed them, that a tenant limited
        to `allowed` may use (all of them with None)."""
        names = [self._name or "", *self._adapters]
        return [name for name in names if name and (allowed is None or name in allowed)]

    @property
    def adapters(self) -> tuple[str, ...]:
        """The adapters, as the workers last listed them (name() asks)."""
        return self._adapters

    @property
    def max_model_len(self) -> int:
        return self._max_model_len
