"""The model the workers serve, as the OpenAI API names and lists it."""

from __future__ import annotations

import time

import grpc

from tokenmesh.common.channels import Dependency
from tokenmesh.common.errors import DependencyError, NotFound
from tokenmesh.v1 import inference_pb2, inference_pb2_grpc

# How long the served model's name is trusted before the workers are asked again.
MODEL_NAME_TTL_SECONDS = 30.0


class ModelNotFound(NotFound):
    field = "model"


class ModelCatalog:
    """The model the workers serve (their served_model_name), asked of a worker through the
    mesh and cached: what /v1/models lists and what a request's `model` must name."""

    def __init__(self, worker: Dependency, timeout: float) -> None:
        self._stub = inference_pb2_grpc.InferenceServiceStub(worker.channel)
        self._timeout = timeout
        self._name: str | None = None
        self._asked = 0.0
        self._max_model_len = 0

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
        return self._name

    async def check(self, requested: str) -> str:
        served = await self.name()
        if requested != served:
            raise ModelNotFound(
                f"the model {requested!r} does not exist; this mesh serves {served!r}"
            )
        return served

    @property
    def max_model_len(self) -> int:
        return self._max_model_len
